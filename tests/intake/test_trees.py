"""Input and output containers kept as data (cuvild/intake/trees.py): any dataclass-like
output (a transformers ModelOutput, a registered dataclass, a namedtuple, dicts, nesting) is
accepted without its class, named by its field paths, and rebuilt only in a client that has
the class registered; a type name that is not a class is refused, and none is imported."""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from archives import model_json, rewrite

from cuvild.client.trees import container_spec, rebuild
from cuvild.intake.safe_load import UnsafeArchive, load_archive
from cuvild.intake.summary import summarize
from cuvild.intake.trees import leaf_names


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]
    extra: dict[str, torch.Tensor]


torch.export.register_dataclass(Out, serialized_type_name="cuviltest.outputs.Out")
Point = collections.namedtuple("Point", "x y")
pytree._register_namedtuple(Point, serialized_type_name="cuviltest.outputs.Point")  # noqa: SLF001 - torch.export's way to name a namedtuple


class Nested(torch.nn.Module):
    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> Out:
        return Out(x * scale, (x + 1, x + 2), {"mask": x > 0})


class Mixed(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Point]:
        return x - 1, Point(x, x * 3)


def saved(module: torch.nn.Module, tmp_path: Path, *args: torch.Tensor,
          **kwargs: torch.Tensor) -> Path:
    path = tmp_path / f"{type(module).__name__}.pt2"
    torch.export.save(torch.export.export(module, args, kwargs), path)
    return path


def test_a_dataclass_output_is_named_by_field_path_and_kept_as_data(tmp_path: Path) -> None:
    x, scale = torch.randn(2, 3), torch.full((2, 3), 2.0)
    ep, info = load_archive(saved(Nested(), tmp_path, x, scale=scale))
    summary = summarize(ep, info.trees["out_spec"])
    assert [i["name"] for i in summary["inputs"]] == ["x", "scale"]  # keyword inputs by name
    assert [o["name"] for o in summary["outputs"]] == [
        "logits", "hidden.0", "hidden.1", "extra.mask"]
    assert "cuviltest.outputs.Out" in summary["out_spec"]
    # The program itself returns plain dicts: the daemon never needs the class.
    out = ep.module()(x, scale=scale)
    assert type(out) is dict and list(out) == ["logits", "hidden", "extra"]
    torch.testing.assert_close(out["logits"], x * scale)
    # A client with the class registered gets it back; the leaves in their order.
    names = [o["name"] for o in summary["outputs"]]
    leaves = dict(zip(names, pytree.tree_leaves(Nested()(x, scale=scale)), strict=True))
    back = rebuild(container_spec(summary["out_spec"]), names, leaves)
    assert isinstance(back, Out) and back.extra["mask"].dtype == torch.bool
    torch.testing.assert_close(back.hidden[1], x + 2)


def test_tuples_keep_positional_names_and_namedtuples_their_fields(tmp_path: Path) -> None:
    ep, info = load_archive(saved(Mixed(), tmp_path, torch.randn(4)))
    summary = summarize(ep, info.trees["out_spec"])
    assert [o["name"] for o in summary["outputs"]] == ["output0", "output1.x", "output1.y"]
    assert container_spec(summary["out_spec"]) is None  # a tuple at the root: the dict
    by_name = {"output0": 1, "output1.x": 2, "output1.y": 3}
    assert rebuild(None, list(by_name), by_name) is by_name


def test_a_client_without_the_class_gets_the_dict_and_imports_nothing() -> None:
    leaf = {"type": None, "context": None, "children_spec": []}
    spec = json.dumps([1, {"type": "cuvil_absent_module.Output", "context": '["a"]',
                           "children_spec": [leaf]}])
    assert leaf_names(spec) == ["a"]
    assert container_spec(spec) is None
    import sys
    assert "cuvil_absent_module" not in sys.modules


def _with_out_spec(saved_mlp: Path, tmp_path: Path, typ: str, context: str) -> Path:
    program = model_json(saved_mlp)
    leaf = {"type": None, "context": None, "children_spec": []}
    spec = [1, {"type": typ, "context": context, "children_spec": [leaf]}]
    program["graph_module"]["module_call_graph"][0]["signature"]["out_spec"] = json.dumps(spec)
    return rewrite(saved_mlp, tmp_path / "spec.pt2", {"models/model.json": json.dumps(program)})


@pytest.mark.parametrize("typ", ["os.system", "builtins.eval", "torch.__class__.Evil",
                                 "__main__.__builtins__.Evil", "evil", "a.b;c.D",
                                 "__import__('os').X"])
def test_a_type_that_is_not_a_class_name_is_refused(saved: dict, tmp_path: Path,
                                                    typ: str) -> None:
    with pytest.raises(UnsafeArchive) as err:
        load_archive(_with_out_spec(saved["mlp"][0], tmp_path, typ, '["y"]'))
    assert err.value.entry == "models/model.json"
    assert "does not name a container class" in err.value.reason, err.value.reason


@pytest.mark.parametrize("context", ['["a", "b"]', '"a"', "null", '[["a"], []', '[1]',
                                     '["a\\u0027+x+\\u0027"]'])
def test_a_container_whose_fields_cannot_be_read_is_refused(saved: dict, tmp_path: Path,
                                                            context: str) -> None:
    with pytest.raises(UnsafeArchive) as err:
        load_archive(_with_out_spec(saved["mlp"][0], tmp_path, "somelib.Output", context))
    assert err.value.entry == "models/model.json"
    assert "field name" in err.value.reason or "tree spec key" in err.value.reason, \
        err.value.reason


def test_a_user_class_from_main_is_accepted(saved: dict, tmp_path: Path) -> None:
    ep, info = load_archive(_with_out_spec(saved["mlp"][0], tmp_path, "__main__.MyOutput",
                                           '["y"]'))
    assert [o["name"] for o in summarize(ep, info.trees["out_spec"])["outputs"]] == ["y"]
