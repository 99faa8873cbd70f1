"""Archives as files: legit ones load and match eager (state, annotations, dynamic shapes,
guards), malformed ones (empty, truncated, corrupt, traversing, symlinked, oversize, bad JSON)
are refused naming the entry."""

from __future__ import annotations

import io
import json
import stat
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.export.pt2_archive.constants
from archives import entry, model_json, rewrite

from cuvild.intake.safe_load import (
    ArchiveInfo,
    UnsafeArchive,
    load_exported_program,
    validate_archive,
)

# ------------------------------------------------------------------------ legit loads


SHAPES = {
    "mlp": [(2, 4)],
    "conv": [(2, 3, 10, 10)],
    "state": [(2, 3)],
    "dyn": [(2, 4)],
    "pair": [(4, 5), (4, 5)],
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_legit_archives_match_eager(saved: dict, name: str) -> None:
    path, module = saved[name]
    ep = load_exported_program(path)
    assert isinstance(ep, torch.export.ExportedProgram)
    assert ep.example_inputs is None  # never read
    args = [torch.randn(*shape) for shape in SHAPES[name]]
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(*args), module(*args), rtol=0, atol=0)
        reference = torch.export.load(path)  # trusted here: we made the file
        torch.testing.assert_close(ep.module()(*args), reference.module()(*args), rtol=0, atol=0)
    if name in ("dyn", "pair"):  # other sizes inside the declared ranges
        args = [torch.randn(17, *shape[1:]) for shape in SHAPES[name]]
        torch.testing.assert_close(ep.module()(*args), module(*args), rtol=0, atol=0)
    if name == "pair":
        assert model_json(path)["guards_code"]  # torch's own guards pass our guard grammar
        assert ep._guards_code == model_json(path)["guards_code"]  # noqa: SLF001 - the archive field under test


def test_state_keeps_buffers_constants_and_aliasing(saved: dict) -> None:
    path, module = saved["state"]
    ep = load_exported_program(path)
    assert set(ep.state_dict) == set(torch.export.load(path).state_dict)
    assert isinstance(ep.state_dict["lin.weight"], torch.nn.Parameter)
    torch.testing.assert_close(ep.state_dict["scale"], module.scale)
    assert len(ep.constants) >= 1


def test_weights_are_the_archives_pages_and_writes_to_them_stay_in_the_process(
        saved: dict, tmp_path: Path) -> None:
    """A stored weight is mapped copy-on-write, not copied: the program's tensors read the
    file's pages (shared by every process that loads it), and a tensor written in place (a
    cache buffer) gets a page of its own: the file, and the next load, are unchanged."""
    import hashlib
    import shutil

    path = shutil.copy(saved["state"][0], tmp_path / "state.pt2")
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    ep = load_exported_program(path)
    assert str(path) in Path("/proc/self/maps").read_text()
    scale = ep.state_dict["scale"].clone()
    with torch.no_grad():
        ep.state_dict["scale"].add_(100.0)
        ep.state_dict["lin.weight"].zero_()
    assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == digest
    again = load_exported_program(path)
    torch.testing.assert_close(again.state_dict["scale"], scale)
    assert again.state_dict["lin.weight"].abs().sum() > 0


def test_a_deflated_weight_is_read_not_mapped(saved: dict, tmp_path: Path) -> None:
    """A weight entry compressed (not as torch writes one) is inflated and CRC-checked by
    zipfile, and loads the same."""
    src, module = saved["mlp"]
    weights = {f"data/weights/{n}": entry(src, f"data/weights/{n}")
               for n in ("weight_0", "weight_1")}
    path = rewrite(src, tmp_path / "deflated.pt2", weights, deflate=True)
    with zipfile.ZipFile(path) as z:
        assert any(i.compress_type == zipfile.ZIP_DEFLATED for i in z.infolist())
    x = torch.randn(*SHAPES["mlp"][0])
    with torch.no_grad():
        torch.testing.assert_close(load_exported_program(path).module()(x), module(x),
                                   rtol=0, atol=0)


def test_custom_annotations_survive(saved: dict) -> None:
    ep = load_exported_program(saved["mlp"][0])
    annotations = [
        n.meta["custom"]["cuvil.partition"] for n in ep.graph.nodes if "custom" in n.meta
    ]
    assert annotations
    assert annotations[0] == {"device": "dev0", "pin": True}
    assert all(isinstance(a["device"], str) for a in annotations)


def test_validate_reports_archive(saved: dict) -> None:
    info = validate_archive(saved["conv"][0])
    assert isinstance(info, ArchiveInfo)
    assert "models/model.json" in info.entries
    assert "torch.ops.aten.conv2d.default" in info.op_targets
    assert info.total_bytes > 0 and info.root == "conv"


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_program_json_is_read_as_torch_reads_it(saved: dict, name: str) -> None:
    """The safe loader's own JSON -> schema conversion (field types looked up once a class)
    builds what torch's `_dict_to_dataclass` does, every field of every node."""
    from torch._export.serde import schema
    from torch._export.serde.serialize import _dict_to_dataclass

    from cuvild.intake.schema_checks import from_json

    data = model_json(saved[name][0])
    assert from_json(schema.ExportedProgram, data) == _dict_to_dataclass(
        schema.ExportedProgram, data)


def test_a_union_of_no_known_field_is_refused_by_name(saved: dict, tmp_path: Path) -> None:
    data = model_json(saved["mlp"][0])
    node = data["graph_module"]["graph"]["nodes"][0]
    node["inputs"][0]["arg"] = {"as_pickle": "x"}
    bad = rewrite(saved["mlp"][0], tmp_path / "bad.pt2", {"models/model.json": json.dumps(data)})
    with pytest.raises(UnsafeArchive, match="Argument: no field 'as_pickle'"):
        validate_archive(bad)


def test_validate_then_load_via_bytesio_root(saved: dict, tmp_path: Path) -> None:
    # Archives saved to a buffer use the root folder "archive".
    buf = io.BytesIO()
    torch.export.save(torch.export.load(saved["mlp"][0]), buf)
    path = tmp_path / "buffer.pt2"
    path.write_bytes(buf.getvalue())
    assert validate_archive(path).root == "archive"
    load_exported_program(path)


# -------------------------------------------------------------------- malformed files


def _zip(path: Path, members: list[tuple[zipfile.ZipInfo | str, bytes]]) -> Path:
    with warnings.catch_warnings(), zipfile.ZipFile(path, "w") as z:
        warnings.simplefilter("ignore")  # duplicate names
        for name, data in members:
            z.writestr(name, data)
    return path


def _legit_members(src: Path) -> list[tuple[zipfile.ZipInfo | str, bytes]]:
    with zipfile.ZipFile(src) as z:
        return [(n, z.read(n)) for n in z.namelist()]


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.pt2"
    path.write_bytes(b"")
    with pytest.raises(UnsafeArchive, match="empty file"):
        load_exported_program(path)


def test_not_a_zip(tmp_path: Path) -> None:
    path = tmp_path / "junk.pt2"
    path.write_bytes(b"\x80\x04hello this is not a zip" * 10)
    with pytest.raises(UnsafeArchive, match="not a readable zip"):
        load_exported_program(path)


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated(saved: dict, tmp_path: Path, keep: float) -> None:
    data = saved["mlp"][0].read_bytes()
    path = tmp_path / "cut.pt2"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(UnsafeArchive):
        load_exported_program(path)


def test_corrupted_entry_crc(saved: dict, tmp_path: Path) -> None:
    data = bytearray(saved["mlp"][0].read_bytes())
    at = data.find(b'"graph_module"')
    data[at + 2] ^= 0x20  # flip a byte inside models/model.json
    path = tmp_path / "crc.pt2"
    path.write_bytes(bytes(data))
    with pytest.raises(UnsafeArchive, match="corrupt or truncated"):
        load_exported_program(path)


def test_a_corrupted_weight_is_refused_by_validation_and_by_the_load(saved: dict,
                                                                    tmp_path: Path) -> None:
    """The load reads each weight once (validation leaves them to it): its CRC is checked
    there."""
    from archives import _root

    src = saved["mlp"][0]
    with zipfile.ZipFile(src) as z:
        info = z.getinfo(f"{_root(src)}/data/weights/weight_0")
    data = bytearray(src.read_bytes())
    at = info.header_offset  # the local header's own name and extra lengths (torch pads)
    start = at + 30 + int.from_bytes(data[at + 26:at + 28], "little") + int.from_bytes(
        data[at + 28:at + 30], "little")
    data[start + 3] ^= 0x40
    path = tmp_path / "weight.pt2"
    path.write_bytes(bytes(data))
    for read in (validate_archive, load_exported_program):
        with pytest.raises(UnsafeArchive, match="weight_0: corrupt or truncated"):
            read(path)


def test_extra_unknown_entry(saved: dict, tmp_path: Path) -> None:
    path = rewrite(saved["mlp"][0], tmp_path / "extra.pt2", {"data/notes.txt": b"hi"})
    with pytest.raises(UnsafeArchive) as err:
        load_exported_program(path)
    assert err.value.entry == "data/notes.txt" and "allow-list" in err.value.reason


def test_aotinductor_entry_refused(saved: dict, tmp_path: Path) -> None:
    path = rewrite(saved["mlp"][0], tmp_path / "so.pt2", {"data/aotinductor/model/x.so": b"E"})
    with pytest.raises(UnsafeArchive, match="native code"):
        load_exported_program(path)


@pytest.mark.parametrize("bad", ["mlp/../../etc/evil", "/abs/evil", "mlp/data/./x", "C:/x"])
def test_path_traversal_and_absolute(saved: dict, tmp_path: Path, bad: str) -> None:
    members = _legit_members(saved["mlp"][0]) + [(bad, b"x")]
    with pytest.raises(UnsafeArchive) as err:
        load_exported_program(_zip(tmp_path / "trav.pt2", members))
    assert "path" in err.value.reason


def test_duplicate_names(saved: dict, tmp_path: Path) -> None:
    members = _legit_members(saved["mlp"][0])
    members.append(next(m for m in members if str(m[0]).endswith("models/model.json")))
    with pytest.raises(UnsafeArchive, match="duplicate"):
        load_exported_program(_zip(tmp_path / "dup.pt2", members))


def test_symlink_entry(saved: dict, tmp_path: Path) -> None:
    link = zipfile.ZipInfo("mlp/data/weights/weight_0")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    members = [m for m in _legit_members(saved["mlp"][0]) if m[0] != link.filename]
    with pytest.raises(UnsafeArchive, match="symlink"):
        load_exported_program(_zip(tmp_path / "ln.pt2", [*members, (link, b"/etc/passwd")]))


def test_too_many_entries(saved: dict) -> None:
    with pytest.raises(UnsafeArchive, match="exceed the limit"):
        load_exported_program(saved["mlp"][0], max_entries=5)


def test_oversize_limit(saved: dict, tmp_path: Path) -> None:
    path = saved["mlp"][0]
    total = validate_archive(path).total_bytes
    load_exported_program(path, max_bytes=total)
    with pytest.raises(UnsafeArchive, match="exceed the limit"):
        load_exported_program(path, max_bytes=total - 1)
    # a deflate bomb: tiny on disk, huge declared size
    bomb = tmp_path / "bomb.pt2"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in _legit_members(path):
            z.writestr(name, data)
        z.writestr("mlp/data/weights/weight_7", b"\0" * (64 << 20))
    assert bomb.stat().st_size < (1 << 20)
    with pytest.raises(UnsafeArchive, match="exceed the limit"):
        load_exported_program(bomb, max_bytes=32 << 20)


def test_wrong_archive_format_marker(saved: dict, tmp_path: Path) -> None:
    path = rewrite(saved["mlp"][0], tmp_path / "fmt.pt2", {"archive_format": b"zip"})
    with pytest.raises(UnsafeArchive) as err:
        load_exported_program(path)
    assert err.value.entry == "archive_format"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p["graph_module"]["graph"]["nodes"][0].update(name={"x": 1}),
        lambda p: p["graph_module"]["graph"]["nodes"][0].update(target=["torch"]),
        lambda p: p["graph_module"]["graph"].pop("nodes"),
        lambda p: p.update(verifiers=["EDGE"]),
        lambda p: p["graph_module"]["graph"]["tensor_values"]["x"].update(dtype=999),
        lambda p: p["graph_module"]["graph"]["inputs"][0]["as_tensor"].update(name="nope"),
        lambda p: p.update(schema_version={"major": 999, "minor": 0}),
    ],
    ids=["name-type", "target-type", "missing-field", "verifier", "dtype", "dangling", "ver"],
)
def test_malformed_program_json(saved: dict, tmp_path: Path, mutate: Callable) -> None:
    program = model_json(saved["mlp"][0])
    mutate(program)
    path = rewrite(
        saved["mlp"][0], tmp_path / "bad.pt2", {"models/model.json": json.dumps(program)}
    )
    with pytest.raises(UnsafeArchive) as err:
        load_exported_program(path)
    assert err.value.entry == "models/model.json"


def test_invalid_json_and_weight_sizes(saved: dict, tmp_path: Path) -> None:
    src = saved["mlp"][0]
    path = rewrite(src, tmp_path / "j.pt2", {"models/model.json": b"{not json"})
    with pytest.raises(UnsafeArchive, match="malformed"):
        load_exported_program(path)
    config = json.loads(entry(src, "data/weights/model_weights_config.json"))
    config["config"]["l1.weight"]["tensor_meta"]["sizes"] = [{"as_int": 4096}, {"as_int": 4096}]
    path = rewrite(
        src, tmp_path / "w.pt2", {"data/weights/model_weights_config.json": json.dumps(config)}
    )
    with pytest.raises(UnsafeArchive, match="cannot build"):
        load_exported_program(path)
