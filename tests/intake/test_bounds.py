"""Per-archive bounds of the safe loader (hardening issue, findings 9-11): every amount of work
or memory an archive can ask for is bounded, and the refusal names the entry and the bound.

- 9: numbers in shape expressions (digits, exponents, computed exponents, value sizes, depth)
  and in guards;
- 10: the example-inputs pickle scan (streamed, bounded opcodes and bytes), the JSON entries
  (bytes and items, checked before parsing);
- 11: tensors materialise no more than their payload bytes (no stride-0 blow-up), and the
  graph's metadata of parameters/buffers/constants matches their payloads.

Each crafted archive is refused before the expensive work: no test here takes the O(N**2)
time the findings measured. The last tests check that real archives still pass, also through
the isolated ``inspect_archive``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from archives import (
    Expanded,
    entry,
    model_json,
    rewrite,
    torch_save_with_pickle,
)

from cuvild.intake import grammar, payload_checks, safe_load
from cuvild.intake.safe_load import (
    UnsafeArchive,
    load_archive,
    load_exported_program,
    validate_archive,
)
from cuvild.intake.summary import _inspect_in_child, inspect_archive, summarize

ROOT = Path(__file__).resolve().parents[2]
MODEL = "models/model.json"
WEIGHTS = "data/weights/model_weights_config.json"
SAMPLE = "data/sample_inputs/model.pt"
SYMBOL = "Symbol('s77', positive=True, integer=True)"  # how torch writes the batch symbol


def refused(path: Path, entry_name: str, *words: str) -> UnsafeArchive:
    with pytest.raises(UnsafeArchive) as err:
        load_exported_program(path)
    assert err.value.entry == entry_name, err.value
    for word in words:
        assert word in err.value.reason, err.value.reason
    return err.value


def with_expr(saved: dict, tmp_path: Path, expr: str) -> Path:
    """The dynamic MLP with its batch dim's expression replaced by ``expr``."""
    src = saved["dyn"][0]
    text = entry(src, MODEL).decode()
    assert SYMBOL in text
    return rewrite(src, tmp_path / "expr.pt2", {MODEL: text.replace(SYMBOL, expr, 1)})


# ------------------------------------------------------- finding 9: shape expressions


@pytest.mark.parametrize(
    "expr, words",
    [
        # O(N**2) in mpmath/sympy: 300k digits took 3.7 s at intake, 6.4 s at prepare
        ("Integer(Float('1e300000'))", ["exponent over the limit of 400"]),
        ("Float('1e300000')", ["exponent over the limit of 400"]),
        ("Float('-2.5E-300000', precision=53)", ["exponent over the limit of 400"]),
        (f"Float('{'9' * 5000}')", ["5000 digits", "limit of 64 digits"]),
        ("Float('1.5', precision=100000000)", ["precision is limited to 256 bits"]),
        ("Float('1.5', 100000000)", ["Float takes one literal"]),
        (f"Integer({2**64 + 1})", ["limited to 2**64"]),
    ],
)
def test_numeric_literals_are_bounded(saved: dict, tmp_path: Path, expr: str,
                                      words: list[str]) -> None:
    refused(with_expr(saved, tmp_path, expr), MODEL, *words)


@pytest.mark.parametrize(
    "expr, words",
    [
        # the literal-exponent cap was bypassed by computing the exponent
        ("Pow(3, Add(2000000, 0))", ["exponent 'Add(2000000, 0)'", "only a literal up to 64"]),
        ("Pow(Integer(2), Mul(Integer(1000), Integer(1000)))", ["only a literal up to 64"]),
        ("PowByNatural(Integer(7), Integer(1000000))", ["only a literal up to 64"]),
        ("LShift(Integer(1), Integer(10000000))", ["only a literal up to 64"]),
        ("FloatPow(Float('10.0'), Float('1e6'))", ["only a literal up to 64"]),
        # every exponent small, but nested: 2**(64 * 64**3) bits
        (
            f"Pow(Pow(Pow(Integer({2**64 - 1}), 64), 64), 64)",
            ["bits, over the limit of 65536 bits"],
        ),
        ("Integer(Pow(Float('1e400'), 64))", ["over the limit of 65536 bits"]),
    ],
)
def test_exponents_are_small_literals(saved: dict, tmp_path: Path, expr: str,
                                      words: list[str]) -> None:
    refused(with_expr(saved, tmp_path, expr), MODEL, *words)


def test_expression_depth_is_bounded(saved: dict, tmp_path: Path) -> None:
    deep = "Add(" * 100 + SYMBOL + ", Integer(0))" * 100
    refused(with_expr(saved, tmp_path, deep), MODEL, "nested deeper than the limit of 64")
    chain = " + ".join(["s77"] * 100)  # str() form: a left-deep chain of BinOps
    refused(with_expr(saved, tmp_path, chain), MODEL, "nested deeper than the limit of 64")


def test_small_literals_and_symbols_still_pass() -> None:
    for expr in [
        "Pow(Symbol('s0', positive=True, integer=True), Integer(-1))",
        "Pow(Symbol('s0'), Rational(1, 2))",
        "PowByNatural(Symbol('s0'), Symbol('s1'))",
        "Float('0.10000000000000001', precision=53)",
        "Integer(Float('1e300'))",
        "Mul(Integer(3), Add(Symbol('s1'), Symbol('s2')))",
        "FloorDiv(Add(s17, s77), 2)",
    ]:
        grammar.check_sym_expr(expr, "expr")


@pytest.mark.parametrize(
    "guard, words",
    [
        ("((((9**64)**64)**64)**64) > 0", ["over the limit of 65536 bits"]),
        (" + ".join(["L['x'].size()[0]"] * 100) + " > 0", ["nested deeper than the limit"]),
        (f"L['x'].size()[0] == {2**64 + 1}", ["limited to 2**64"]),
    ],
)
def test_guards_are_bounded(saved: dict, tmp_path: Path, guard: str, words: list[str]) -> None:
    src = saved["pair"][0]
    program = model_json(src)
    program["guards_code"] = [*program["guards_code"], guard]
    path = rewrite(src, tmp_path / "g.pt2", {MODEL: json.dumps(program)})
    refused(path, MODEL, "guard", *words)


# ---------------------------------------- finding 10: the pickle scan and JSON entries


def _sample_with_nones(saved: dict, tmp_path: Path, count: int) -> Path:
    src = saved["mlp"][0]
    pickle_bytes = b"\x80\x02" + b"N" * count + b"."
    inner = torch_save_with_pickle(entry(src, SAMPLE), pickle_bytes)
    return rewrite(src, tmp_path / "nones.pt2", {SAMPLE: inner}, deflate=True)


def test_six_million_none_opcodes_are_refused(saved: dict, tmp_path: Path) -> None:
    # 6M NONE opcodes deflate to a few KB; the old scan listed every opcode (+600 MiB, 5.9 s)
    path = _sample_with_nones(saved, tmp_path, 6_000_000)
    assert path.stat().st_size < 100_000
    refused(path, SAMPLE, "data.pkl is 6000003 bytes", f"limit of {4 << 20} bytes")


def test_pickle_opcodes_are_bounded(saved: dict, tmp_path: Path) -> None:
    path = _sample_with_nones(saved, tmp_path, 1_000_000)  # under the byte limit
    refused(path, SAMPLE, f"more than {payload_checks.MAX_SAMPLE_OPCODES} opcodes", "limit")


def test_padded_model_json_is_refused_before_inflating(saved: dict, tmp_path: Path) -> None:
    src = saved["mlp"][0]
    text = entry(src, MODEL)
    padded = text + b" " * (safe_load.MAX_JSON_BYTES + 1 - len(text))  # valid JSON
    path = rewrite(src, tmp_path / "pad.pt2", {MODEL: padded}, deflate=True)
    assert path.stat().st_size < 200_000  # ~32 KB on disk, 32 MiB inflated
    refused(path, MODEL, f"over the limit of {safe_load.MAX_JSON_BYTES} bytes")


def test_json_items_are_bounded(saved: dict, tmp_path: Path) -> None:
    src = saved["mlp"][0]
    text = entry(src, WEIGHTS).rstrip()
    # 2M empty lists: 6 MB of JSON, ~130 MB of Python lists once parsed
    pad = b', "pad": [' + b"[]," * safe_load.MAX_JSON_ITEMS + b"[]]}"
    path = rewrite(src, tmp_path / "items.pt2", {WEIGHTS: text[:-1] + pad}, deflate=True)
    refused(path, WEIGHTS, f"over the limit of {safe_load.MAX_JSON_ITEMS}")


# ------------------------------------ finding 11: materialised bytes and the metadata


def _weights_edit(saved: dict, tmp_path: Path, sizes: list[int], strides: list[int],
                  payload: bytes, *, graph_too: bool = True) -> Path:
    """The MLP with l1.weight declared as ``sizes``/``strides`` over ``payload``."""
    src = saved["mlp"][0]
    config = json.loads(entry(src, WEIGHTS))
    meta = config["config"]["l1.weight"]
    meta["tensor_meta"]["sizes"] = [{"as_int": n} for n in sizes]
    meta["tensor_meta"]["strides"] = [{"as_int": n} for n in strides]
    program = model_json(src)
    if graph_too:  # so that only the payload is at fault
        declared = program["graph_module"]["graph"]["tensor_values"]["p_l1_weight"]
        declared["sizes"], declared["strides"] = meta["tensor_meta"]["sizes"], meta[
            "tensor_meta"]["strides"]
    edits = {WEIGHTS: json.dumps(config), MODEL: json.dumps(program),
             f"data/weights/{meta['path_name']}": payload}
    return rewrite(src, tmp_path / "w.pt2", edits)


def test_stride_zero_huge_weight_is_refused(saved: dict, tmp_path: Path) -> None:
    # 7.4 KB archive, 8192x16384 fp32 over 4 bytes: went READY, the worker peaked at +2.2 GB
    path = _weights_edit(saved, tmp_path, [8192, 16384], [0, 0], b"\0\0\x80\x3f")
    err = refused(path, WEIGHTS, "cannot build 'l1.weight'", "536870912 bytes over 4 bytes",
                  "over the limit")
    assert str(payload_checks.MAX_EXPANSION_BYTES) in err.reason


def test_view_must_fit_its_payload(saved: dict, tmp_path: Path) -> None:
    path = _weights_edit(saved, tmp_path, [8, 4], [4, 1], b"\0" * 64)  # needs 128 bytes
    refused(path, WEIGHTS, "cannot build 'l1.weight'", "reach 128 bytes", "holds 64")


def test_total_materialised_bytes_are_bounded(saved: dict, tmp_path: Path) -> None:
    # each view under the per-tensor slack, together far over it
    src = saved["mlp"][0]
    config = json.loads(entry(src, WEIGHTS))
    template = config["config"]["l1.weight"]
    for i in range(8):
        meta = json.loads(json.dumps(template))
        meta["tensor_meta"]["sizes"] = [{"as_int": 2048}, {"as_int": 1024 + i}]
        meta["tensor_meta"]["strides"] = [{"as_int": 0}, {"as_int": 0}]
        config["config"][f"extra{i}"] = meta
    path = rewrite(src, tmp_path / "t.pt2", {WEIGHTS: json.dumps(config)})
    refused(path, WEIGHTS, "weights config's tensors materialise", "over the limit")


@pytest.mark.parametrize(
    "field, value, words",
    [
        # the finding: metadata 32x128 over a 64x64 payload; here [2, 16] over [8, 4]
        ("sizes", [{"as_int": 2}, {"as_int": 16}], ["declares shape [2, 16]", "holds [8, 4]"]),
        ("sizes", [{"as_int": 4}, {"as_int": 8}], ["declares shape [4, 8]", "holds [8, 4]"]),
        ("dtype", 6, ["declares dtype float16", "holds float32"]),
    ],
)
def test_graph_metadata_must_match_payloads(saved: dict, tmp_path: Path, field: str,
                                            value: object, words: list[str]) -> None:
    src = saved["mlp"][0]
    program = model_json(src)
    program["graph_module"]["graph"]["tensor_values"]["p_l1_weight"][field] = value
    path = rewrite(src, tmp_path / "meta.pt2", {MODEL: json.dumps(program)})
    refused(path, MODEL, "parameter 'l1.weight'", *words)


def test_buffers_and_constants_are_cross_checked(saved: dict, tmp_path: Path) -> None:
    src = saved["state"][0]
    for arg, kind in (("b_scale", "buffer 'scale'"), ("c_const", "tensor_constant 'const'"),
                      ("b_shift", "buffer 'shift'")):
        program = model_json(src)
        program["graph_module"]["graph"]["tensor_values"][arg]["sizes"] = [{"as_int": 4}]
        path = rewrite(src, tmp_path / f"{arg}.pt2", {MODEL: json.dumps(program)})
        refused(path, MODEL, kind, "declares shape [4]", "holds [3]")


# ------------------------------------------------------------- valid archives still pass


@pytest.mark.parametrize("name", ["mlp", "conv", "state", "dyn", "pair"])
def test_real_archives_pass_every_bound(saved: dict, name: str) -> None:
    path, _ = saved[name]
    info = validate_archive(path)
    assert info.total_bytes > 0
    load_exported_program(path)


def test_small_expanded_buffer_passes(tmp_path: Path) -> None:
    ep = torch.export.export(Expanded(), (torch.randn(2, 16),))
    path = tmp_path / "expanded.pt2"
    torch.export.save(ep, path)
    loaded = load_exported_program(path)
    x = torch.randn(2, 16)
    torch.testing.assert_close(loaded.module()(x), x + 1)


def test_inspection_runs_in_a_limited_child(saved: dict, tmp_path: Path) -> None:
    path = saved["pair"][0]
    ep, info = load_archive(path)
    assert inspect_archive(path, 1 << 30) == summarize(ep, info.trees["out_spec"])
    bad = _weights_edit(saved, tmp_path, [8192, 16384], [0, 0], b"\0\0\x80\x3f")
    with pytest.raises(UnsafeArchive) as err:  # the child's refusal, whole
        inspect_archive(bad, 1 << 30)
    assert err.value.entry == WEIGHTS and "cannot build" in err.value.reason
    with pytest.raises(ValueError, match=r"archive inspection exceeded 1 MiB of memory"):
        _inspect_in_child(path, 1 << 30, 1 << 20, 60)


def test_the_daemons_side_of_an_inspection_imports_no_torch(saved: dict, tmp_path: Path) -> None:
    """Registering an archive checks it in the inspector's child: the daemon's side (here a
    fresh interpreter) imports no torch for an archive accepted or refused."""
    bad = _weights_edit(saved, tmp_path, [8192, 16384], [0, 0], b"\0\0\x80\x3f")
    script = (
        "import sys\n"
        "from cuvild.intake.errors import UnsafeArchive\n"
        "from cuvild.intake.summary import inspect_archive\n"
        f"assert inspect_archive({str(saved['pair'][0])!r}, 1 << 30)['inputs']\n"
        "try:\n"
        f"    inspect_archive({str(bad)!r}, 1 << 30)\n"
        "    sys.exit('the crafted archive was accepted')\n"
        "except UnsafeArchive:\n"
        "    pass\n"
        "sys.exit('torch was imported' if 'torch' in sys.modules else 0)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
