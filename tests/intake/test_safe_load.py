"""Tests for cuvild.intake.safe_load: crafted archives are refused without running anything
(legit ones, and malformed files, are in test_archive_format.py).

Each attack test first runs the crafted archive through plain ``torch.export.load`` as a
control (proving the payload really executes there), then checks that
``load_exported_program`` raises ``UnsafeArchive`` and that a fresh marker stays absent.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.export.pt2_archive.constants
from archives import entry, model_json, rewrite
from torch._export.serde import schema

from cuvild.intake.safe_load import (
    UnsafeArchive,
    load_exported_program,
    validate_archive,
)


class TouchOnUnpickle:
    """Pickles to `exec("...touch(marker)")`: unpickling it runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str]]:
        return (exec, (f"import pathlib; pathlib.Path({self.marker!r}).touch()",))


def evil_torch_save(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(TouchOnUnpickle(marker), buf)
    return buf.getvalue()


def first_symbol(src: Path) -> str:
    """The expr_str of the dynamic batch dim, e.g. "Symbol('s77', positive=True, ...)"."""
    sizes = model_json(src)["graph_module"]["graph"]["tensor_values"]["x"]["sizes"]
    return sizes[0]["as_expr"]["expr_str"]


def touch_code(marker: Path) -> str:
    return f"__import__('pathlib').Path({str(marker)!r}).touch()"


# ------------------------------------------------------------------------ the attacks
# Each builder: (legit archives, marker, dst) -> crafted archive.


def attack_example_inputs(saved: dict, marker: Path, dst: Path) -> Path:
    # torch: deserialize_torch_artifact -> torch.load(weights_only=False) fallback
    return rewrite(saved["mlp"][0], dst, {"data/sample_inputs/model.pt": evil_torch_save(marker)})


def attack_pickled_weight(saved: dict, marker: Path, dst: Path) -> Path:
    # torch: _load_state_dict, use_pickle=True -> torch.load(weights_only=False)
    src = saved["mlp"][0]
    config = json.loads(entry(src, "data/weights/model_weights_config.json"))
    config["config"]["l1.weight"].update(use_pickle=True, path_name="weight_9")
    return rewrite(
        src,
        dst,
        {
            "data/weights/model_weights_config.json": json.dumps(config),
            "data/weights/weight_9": evil_torch_save(marker),
        },
    )


def attack_pickled_constant(saved: dict, marker: Path, dst: Path) -> Path:
    # torch: _load_constants, tensor_* with use_pickle=True -> torch.load(weights_only=False)
    config = {"config": {"c": {"path_name": "tensor_0", "is_param": False, "use_pickle": True}}}
    config["config"]["c"]["tensor_meta"] = None
    return rewrite(
        saved["mlp"][0],
        dst,
        {
            "data/constants/model_constants_config.json": json.dumps(config),
            "data/constants/tensor_0": evil_torch_save(marker),
        },
    )


def _custom_object(kind: str, payload: bytes, saved: dict, dst: Path) -> Path:
    meta = {"path_name": f"{kind}_0", "is_param": False, "use_pickle": True, "tensor_meta": None}
    return rewrite(
        saved["mlp"][0],
        dst,
        {
            "data/constants/model_constants_config.json": json.dumps({"config": {"obj": meta}}),
            f"data/constants/{kind}_0": payload,
        },
    )


def attack_opaque_object(saved: dict, marker: Path, dst: Path) -> Path:
    # torch: _load_constants, opaque_obj_* -> pickle.loads
    return _custom_object("opaque_obj", pickle.dumps(TouchOnUnpickle(marker), 2), saved, dst)


def attack_torchbind_object(saved: dict, marker: Path, dst: Path) -> Path:
    # torch: _load_constants, custom_obj_* -> torch._C._pickle_load_obj (TorchScript unpickler)
    return _custom_object("custom_obj", pickle.dumps(TouchOnUnpickle(marker), 2), saved, dst)


def attack_sympy_eval(saved: dict, marker: Path, dst: Path) -> Path:
    # torch: GraphModuleDeserializer._parse_sym_expr -> sympy.sympify(expr_str) == eval
    src = saved["dyn"][0]
    text, sym = entry(src, "models/model.json").decode(), first_symbol(src)
    return rewrite(
        src, dst, {"models/model.json": text.replace(sym, f"{touch_code(marker)} or {sym}")}
    )


def attack_fx_name_injection(saved: dict, marker: Path, dst: Path) -> Path:
    # torch: sync_fx_node/placeholder keep raw names; GraphModule.recompile() exec()s
    # "def forward(self, ..., <name>):" -> a default argument runs at definition time.
    src = saved["mlp"][0]
    program = model_json(src)
    graph = program["graph_module"]["graph"]
    name = f"y={touch_code(marker)}"
    graph["inputs"].append({"as_tensor": {"name": name}})
    graph["tensor_values"][name] = copy.deepcopy(graph["tensor_values"]["x"])
    spec = {"user_input": {"arg": {"as_tensor": {"name": name}}}}
    program["graph_module"]["signature"]["input_specs"].append(spec)
    return rewrite(src, dst, {"models/model.json": json.dumps(program)})


def attack_guards_code(saved: dict, marker: Path, dst: Path) -> Path:
    # torch: ExportedProgram.module() -> _unlift._convert_guards_code_to_fn -> exec(guards)
    src = saved["mlp"][0]
    program = model_json(src)
    program["guards_code"] = [f"{touch_code(marker)} is None"]
    return rewrite(src, dst, {"models/model.json": json.dumps(program)})


def attack_treespec_import(saved: dict, marker: Path, dst: Path) -> Path:
    # torch: treespec_loads -> pytree.enum_object_hook -> importlib.import_module(fqn)
    src = saved["mlp"][0]
    program = model_json(src)
    module = f"cuvil_evil_{abs(hash(str(marker)))}"
    (marker.parent / f"{module}.py").write_text(f"{touch_code(marker)}\n")
    context = json.dumps([{"__enum__": True, "fqn": f"{module}:X", "name": "a"}])
    leaf = {"type": None, "context": None, "children_spec": []}
    spec = [1, {"type": "builtins.dict", "context": context, "children_spec": [leaf]}]
    program["graph_module"]["module_call_graph"][0]["signature"]["out_spec"] = json.dumps(spec)
    return rewrite(src, dst, {"models/model.json": json.dumps(program)})


def attack_legacy_format(saved: dict, marker: Path, dst: Path) -> Path:
    # torch: load_pt2 fails -> torch.export.load falls back to the pre-2.8 zip layout whose
    # serialized_*.pt payloads go through torch.load(weights_only=False) fallbacks.
    evil = evil_torch_save(marker)
    program = entry(saved["mlp"][0], "models/model.json")
    with zipfile.ZipFile(dst, "w") as z:
        z.writestr("version", ".".join(map(str, schema.SCHEMA_VERSION)))
        z.writestr("serialized_exported_program.json", program)
        for name in ("state_dict", "constants", "example_inputs"):
            z.writestr(f"serialized_{name}.pt", evil)
    return dst


# name -> (builder, when the control payload runs under plain torch: "load", "module"
# (at ep.module()), "never" (not reachable through torch.export.load on this torch)).
# Older torch (2.11) may lack opaque objects / guards_code; then those controls are "never".
_HAS_OPAQUE = hasattr(torch.export.pt2_archive.constants, "OPAQUE_OBJ_FILENAME_PREFIX")
_HAS_GUARDS = "guards_code" in {f.name for f in dataclasses.fields(schema.ExportedProgram)}
ATTACKS: dict[str, tuple[Callable[[dict, Path, Path], Path], str]] = {
    "example_inputs_pickle": (attack_example_inputs, "load"),
    "use_pickle_weight": (attack_pickled_weight, "load"),
    "use_pickle_constant": (attack_pickled_constant, "load"),
    "opaque_object_pickle": (attack_opaque_object, "load" if _HAS_OPAQUE else "never"),
    "torchbind_custom_object": (attack_torchbind_object, "never"),
    "sympy_expr_eval": (attack_sympy_eval, "load"),
    "fx_name_injection": (attack_fx_name_injection, "load"),
    "guards_code_exec": (attack_guards_code, "module" if _HAS_GUARDS else "never"),
    "treespec_module_import": (attack_treespec_import, "load"),
    "legacy_format_fallback": (attack_legacy_format, "load"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_attack_runs_under_torch_but_is_refused(
    attack: str, saved: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build, when = ATTACKS[attack]
    monkeypatch.syspath_prepend(str(tmp_path))  # lets the import attack find its module
    control_marker = tmp_path / "control_marker"
    crafted = build(saved, control_marker, tmp_path / "control.pt2")
    try:
        ep = torch.export.load(crafted)
        if when == "module":
            ep.module()(torch.randn(2, 4))
    except Exception:
        pass  # torch usually fails *after* the payload ran
    if when == "never":
        # E.g. the TorchScript unpickler cannot call Python globals: torch refuses this
        # file before anything runs. Our loader must still refuse it on sight.
        assert not control_marker.exists()
    else:
        assert control_marker.exists(), f"{attack}: control payload did not run under torch"

    marker = tmp_path / "our_marker"
    crafted = build(saved, marker, tmp_path / "ours.pt2")
    with pytest.raises(UnsafeArchive) as err:
        ep = load_exported_program(crafted)
        ep.module()(torch.randn(2, 4))  # only reached on failure: show what would happen
    assert not marker.exists()
    assert err.value.entry and err.value.reason and err.value.entry in str(err.value)


def test_refusals_name_the_entry_and_reason(saved: dict, tmp_path: Path) -> None:
    expected = {
        "example_inputs_pickle": ("data/sample_inputs/model.pt", "exec"),
        "use_pickle_weight": ("data/weights/model_weights_config.json", "use_pickle"),
        "use_pickle_constant": ("data/constants/model_constants_config.json", "use_pickle"),
        "opaque_object_pickle": ("data/constants/opaque_obj_0", "pickle"),
        "torchbind_custom_object": ("data/constants/custom_obj_0", "torchbind"),
        "sympy_expr_eval": ("models/model.json", "not allowed"),
        "fx_name_injection": ("models/model.json", "identifier"),
        "guards_code_exec": ("models/model.json", "guard"),
        "treespec_module_import": ("models/model.json", "import"),
    }
    for attack, (entry_name, word) in expected.items():
        crafted = ATTACKS[attack][0](saved, tmp_path / "m", tmp_path / f"{attack}.pt2")
        with pytest.raises(UnsafeArchive) as err:
            validate_archive(crafted)
        assert err.value.entry == entry_name, attack
        assert word in err.value.reason, (attack, err.value.reason)


def _set(path: str, value: object) -> Callable[[dict], None]:
    """Mutation helper: assign ``value`` at a '/'-separated path inside model.json."""

    def mutate(program: dict) -> None:
        *parents, last = path.split("/")
        obj: object = program
        for key in parents:
            obj = obj[int(key) if isinstance(obj, list) else key]  # type: ignore[index]
        obj[int(last) if isinstance(obj, list) else last] = value  # type: ignore[index]

    return mutate


GM = "graph_module"
NODE0 = f"{GM}/graph/nodes/0"
SPEC = f"{GM}/module_call_graph/0/signature"
LEAF = {"type": None, "context": None, "children_spec": []}


@pytest.mark.parametrize(
    "mutate, word",
    [
        # FX codegen: pytree kwargs keys are pasted as '<key>' into forward()
        (
            _set(
                f"{SPEC}/in_spec",
                json.dumps(
                    [
                        1,
                        {
                            "type": "builtins.dict",
                            "context": "[\"a'+x+'\"]",
                            "children_spec": [LEAF],
                        },
                    ]
                ),
            ),
            "tree spec key",
        ),
        # pytree defaultdict context: importlib.import_module(default_factory_module)
        (
            _set(
                f"{SPEC}/out_spec",
                json.dumps(
                    [
                        1,
                        {
                            "type": "collections.defaultdict",
                            "context": json.dumps(
                                {
                                    "default_factory_module": "os",
                                    "default_factory_name": "system",
                                    "dict_context": [],
                                }
                            ),
                            "children_spec": [],
                        },
                    ]
                ),
            ),
            "defaultdict",
        ),
        (
            _set(f"{GM}/graph/custom_obj_values", {"obj": {"name": "obj", "class_fqn": "x"}}),
            "torchbind",
        ),
        (_set(f"{NODE0}/metadata/nn_module_stack", 'a,b") or x("'), "forbidden"),
        (_set(f"{NODE0}/metadata/stack_trace", 'File "a", line 1, in f\rimport os'), "control"),
        (_set(f"{NODE0}/metadata/source_fn_stack", "n,torch.__class__.__init__"), "dotted"),
        (_set(f"{NODE0}/metadata/custom", "{not json"), "JSON"),
        (_set(f"{NODE0}/name", "a;b"), "identifier"),
        (_set(f"{NODE0}/inputs/0/name", "x=1"), "identifier"),
        (_set(f"{GM}/signature/input_specs/0/parameter/parameter_name", 'l1")+x+("'), "forbidden"),
        (_set(f"{SPEC}/forward_arg_names", ["x", "y=print()"]), "identifier"),
        (_set("guards_code", ["L['x'].size()[0] == len('')"]), "guard"),
        (_set("guards_code", ["L['x\\'].size()[0] == 1"]), "guard"),
        (_set("verifiers", ["CUSTOM"]), "verifier"),
        (
            _set(f"{NODE0}/target", "torch.ops.higher_order.triton_kernel_wrapper_mutation"),
            "higher-order",
        ),
        (_set(f"{NODE0}/inputs/0/arg", {"as_operator": "torch.ops.myns.op.default"}), "namespace"),
    ],
)
def test_program_json_sinks_are_guarded(
    saved: dict, tmp_path: Path, mutate: Callable[[dict], None], word: str
) -> None:
    program = model_json(saved["mlp"][0])
    mutate(program)
    path = rewrite(saved["mlp"][0], tmp_path / "m.pt2", {"models/model.json": json.dumps(program)})
    with pytest.raises(UnsafeArchive) as err:
        load_exported_program(path)
    assert err.value.entry == "models/model.json"
    assert word in err.value.reason, err.value.reason


@pytest.mark.parametrize(
    "expr",
    [
        "sympify('1')",
        "Symbol('s0').__class__",
        "lambdify(Symbol('s0'), 1)",
        "Symbol('s0', evil=__import__('os'))",
        "Pow(Symbol('s0'), Integer(10000000))",
        "[Symbol('s0')][0]",
        "preview(Symbol('s0'))",
    ],
)
def test_sympy_expressions_outside_grammar(saved: dict, tmp_path: Path, expr: str) -> None:
    src = saved["dyn"][0]
    text, sym = entry(src, "models/model.json").decode(), first_symbol(src)
    path = rewrite(src, tmp_path / "e.pt2", {"models/model.json": text.replace(sym, expr)})
    with pytest.raises(UnsafeArchive, match="not allowed|too large"):
        load_exported_program(path)


def _with_node(saved: dict, tmp_path: Path, target: str, **node: object) -> Path:
    src = saved["mlp"][0]
    program = model_json(src)
    arg = {"name": "", "arg": {"as_string": "x"}, "kind": 1}
    new = {"target": target, "inputs": [arg], "outputs": [{"as_none": True}]}
    program["graph_module"]["graph"]["nodes"].insert(0, {**new, "metadata": {}, **node})
    return rewrite(src, tmp_path / "node.pt2", {"models/model.json": json.dumps(program)})


@pytest.mark.parametrize(
    "target",
    [
        "torch.os.system",  # resolves by getattr chain in torch's deserializer
        "torch.ops.evil_ns.run.default",  # unknown namespace
        "torch.ops.aten.save.default",  # aten op that writes files
        "torch.ops.aten.add.Tensor.__call__",
        "torch.ops.aten.__class__.default",  # a Python attribute, not an operator
        "torch.ops.aten.__dict__.default",
        "torch.ops.aten.__and__.__call__",
        "torch.ops.aten.not_an_op.default",  # no schema in the dispatcher's registry
        "torch.ops.higher_order.call_torchbind",
        "#evil:op",  # extension-op registry lookup
        "builtins.eval",
    ],
)
def test_disallowed_op_targets_are_named(saved: dict, tmp_path: Path, target: str) -> None:
    with pytest.raises(UnsafeArchive) as err:
        load_exported_program(_with_node(saved, tmp_path, target))
    assert err.value.entry == "models/model.json"
    assert repr(target) in err.value.reason


class Masks(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((a > 0) & (b > 0)) | ~(a < b)  # aten.__and__ / __or__, as attention masks do


def test_dunder_named_aten_ops_are_real_operators(tmp_path: Path) -> None:
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    path = tmp_path / "masks.pt2"
    torch.export.save(torch.export.export(Masks(), (a, b)), path)
    info = validate_archive(path)
    assert {"torch.ops.aten.__and__.Tensor", "torch.ops.aten.__or__.Tensor"} <= info.op_targets
    assert torch.equal(load_exported_program(path).module()(a, b), Masks()(a, b))


def test_a_torch_save_file_is_refused_saying_what_to_do_instead(tmp_path: Path) -> None:
    """A model saved with torch.save is refused (a pickle) with the way out: export, then
    torch.export.save, or the client's load, which does both (issue 48)."""
    path = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2), path)
    with pytest.raises(UnsafeArchive, match=r"torch\.save file.*torch\.export\.save\(program"):
        validate_archive(path)


def test_dim_dynamic_leaves_an_attribute_that_torch_export_save_pickles(tmp_path: Path) -> None:
    """Dim.DYNAMIC marks the caller's example tensor (`_specialize_on`), so the archive's
    example inputs pickle a tensor with attributes (torch._tensor._rebuild_from_type_v2):
    torch's own, on its weights_only list, and accepted (issue 48)."""
    x = torch.randn(2, 4)
    program = torch.export.export(torch.nn.Linear(4, 2), (x,),
                                  dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
    torch.export.save(program, tmp_path / "m.pt2")
    validate_archive(tmp_path / "m.pt2")


def test_a_size_read_from_the_data_that_torch_cannot_load_back_is_refused_saying_so(
        tmp_path: Path) -> None:
    """BART's sequence classifier: torch.export.load fails on its archive too (torch 2.13);
    the refusal says why and what to export instead."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=32, num_labels=3, use_cache=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    model = transformers.BartForSequenceClassification(config).eval()
    ids = torch.cat([torch.randint(3, 64, (2, 7)), torch.full((2, 1), 2)], 1)
    path = tmp_path / "bart.pt2"
    torch.export.save(torch.export.export(model, (), {"input_ids": ids}), path)
    try:
        torch.export.load(path)
    except AssertionError as e:  # torch's own loader: the same failure (torch 2.13)
        assert "unbacked symbols" in str(e)
    else:  # a torch that reads it back: so does the safe loader
        load_exported_program(path)
        return
    with pytest.raises(UnsafeArchive, match="a size read from the data"):
        load_exported_program(path)


def test_a_mixture_of_experts_exported_with_transformers_defaults_loads_as_transformers_runs(
        tmp_path: Path) -> None:
    """transformers' MoE layers (Mixtral here) export their default experts implementation
    as transformers' own op: it is let through, defined as transformers defines it where a
    process has not (cuvild/intake/foreign_ops.py), and the program computes as
    transformers; cuvild's definition computes as transformers' own code."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations import moe

    from cuvild.intake.foreign_ops import grouped_mm

    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 6))
    path = tmp_path / "moe.pt2"
    torch.export.save(torch.export.export(model, (), {"input_ids": ids}), path)
    assert "torch.ops.transformers.grouped_mm_fallback.default" in validate_archive(
        path).op_targets
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = load_exported_program(path).module()(input_ids=ids)["logits"]
    torch.testing.assert_close(got, want)
    rows, weight = torch.randn(7, 5), torch.randn(3, 5, 4)
    offs = torch.tensor([2, 2, 7])  # (the second expert gets no row)
    assert torch.equal(grouped_mm(rows, weight, offs),
                       moe._grouped_mm_fallback(rows, weight, offs))  # noqa: SLF001 - theirs


class MinusInf(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(x < 0, float("-inf")).softmax(-1)  # (a router's, a causal mask's)


def test_an_infinite_float_argument_loads_and_other_strings_in_its_place_are_refused(
        tmp_path: Path) -> None:
    """torch writes a float argument JSON cannot hold as "Infinity", "-Infinity" or "NaN"
    (a masked_fill with -inf: PhiMoE's router, nn.Transformer's causal mask): such a model
    loads and computes as torch (it was refused as 'expected float, got str'); another
    string where a float goes is still refused (torch's own reader takes any float())."""
    x = torch.randn(3, 4)
    path = tmp_path / "inf.pt2"
    torch.export.save(torch.export.export(MinusInf(), (x,)), path)
    program = model_json(path)
    (node,) = [n for n in program["graph_module"]["graph"]["nodes"]
               if n["target"].endswith("masked_fill.Scalar")]
    assert node["inputs"][2]["arg"] == {"as_float": "-Infinity"}
    assert torch.equal(load_exported_program(path).module()(x), MinusInf()(x))
    node["inputs"][2]["arg"] = {"as_float": "-1e308"}
    edited = rewrite(path, tmp_path / "edited.pt2", {"models/model.json": json.dumps(program)})
    with pytest.raises(UnsafeArchive, match="as_float: expected float, got str"):
        load_exported_program(edited)


class GradRegions(torch.nn.Module):
    """A router computed under `torch.no_grad()` as PhiMoE's is, two regions, and a region's
    value returned as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        with torch.no_grad():
            scale = h.abs().amax(-1, keepdim=True).clamp(min=1e-3)
        h = self.a(h / scale)
        with torch.no_grad():
            gate = h > 0.25
        return self.b(h * gate), scale


def test_a_no_grad_region_is_inlined_and_computes_as_torch(tmp_path: Path) -> None:
    """torch.export writes `with torch.no_grad():` as a higher-order op over a submodule; the
    loader puts its ops back in the graph (inference: the grad mode changes nothing), so no
    part is ever handed a submodule as an input (PhiMoE failed to build so)."""
    torch.manual_seed(0)
    model, x = GradRegions().eval(), torch.randn(3, 8)
    path = tmp_path / "regions.pt2"
    torch.export.save(torch.export.export(model, (x,)), path)
    assert "torch.ops.higher_order.wrap_with_set_grad_enabled" in validate_archive(
        path).op_targets
    ep = load_exported_program(path)
    assert not [n for n in ep.graph.nodes if n.op in ("get_attr", "call_module")
                or "higher_order" in str(n.target)]
    assert not list(ep.graph_module.named_children())
    (output,) = [n for n in ep.graph.nodes if n.op == "output"]
    assert [a.name for a in output.args[0]] == list(ep.graph_signature.user_outputs)
    with torch.no_grad():
        for got, want in zip(ep.module()(x), model(x), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
