"""`auto`: candidates checked against eager, the fastest kept, and a cached reload compiles
nothing (asserted on the cache, not on time); the prior orders and prunes the search, and
`allowed` restricts it. Only torch (free) and openvino (fast) are compiled here."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
import torch

import cuvild
from cuvild.client.samples import MLP
from partitioner.profile import DeviceProfile
from partitioner.split import split_program
from runtimes import registry, select
from runtimes.base import CompileError
from runtimes.cache import CompileCache, keep_inductor_headers
from runtimes.registry import allowed_runtimes
from runtimes.select import build_part

CPU = DeviceProfile(id="cpu0", kind="cpu", cores=[0], runtimes=["openvino", "torch"])


def part_and_samples():
    torch.manual_seed(0)
    model, x = MLP(width=64, depth=2).eval(), torch.randn(2, 64)
    ep = cuvild.export(model, (x,))
    split = split_program(ep, {n.name: "p0" for n in ep.graph.nodes if n.op == "call_function"})
    part = split.parts[0]
    calls = []

    def samples():
        calls.append(1)
        with torch.no_grad():
            return [[x]], [[model(x)]]

    return part.module, samples, calls


def test_auto_picks_a_correct_candidate_and_reloads_without_compiling(tmp_path, monkeypatch):
    module, samples, calls = part_and_samples()
    cache = CompileCache(tmp_path)
    first = build_part(module, CPU, "fp32", samples, cache)
    assert {c.runtime for c in first.candidates} == {"openvino", "torch"}
    assert all(c.status == "ok" and c.rel_error <= 1e-4 for c in first.candidates)
    assert first.runtime in ("openvino", "torch") and not first.from_cache
    recorded = [p for p in (tmp_path / "choices").glob("*.json") if p.name[0] != "p"]
    assert len(recorded) == 1  # the choice is recorded (beside the prior, prior-*.json)

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled on a cached reload")

    ov = registry.runtime_class("openvino")
    monkeypatch.setattr(ov, "compile", no_compile)
    again = build_part(module, CPU, "fp32", samples, cache)
    assert again.from_cache and again.compiled == [] and again.runtime == first.runtime
    assert len(calls) == 1  # sample data was made once, for the first build only


def test_no_runtime_for_the_device_is_a_clear_error(tmp_path):
    module, samples, _ = part_and_samples()
    gpu = DeviceProfile(id="gpu0", kind="gpu", runtimes=["triton"])
    with pytest.raises(CompileError, match="no runtime could build this part for gpu0"):
        build_part(module, gpu, "fp32", samples, CompileCache(tmp_path))


def write_prior(cache: CompileCache, **runtimes: dict) -> None:
    tally = {name: {"wins": 0, "skipped": 0, "ratios": [], "compile_s": [], **t}
             for name, t in runtimes.items()}
    cache.prior_path(CPU, "fp32").write_text(json.dumps(tally))


@pytest.fixture
def quick_timing(monkeypatch):
    monkeypatch.setattr(select, "TIMING_BUDGET_S", 0.01)


def test_no_history_tries_every_candidate_and_starts_the_prior(tmp_path, quick_timing):
    module, samples, _ = part_and_samples()
    cache = CompileCache(tmp_path)
    built = build_part(module, CPU, "fp32", samples, cache)
    assert [c.runtime for c in built.candidates] == ["openvino", "torch"]  # registry order
    assert [c.status for c in built.candidates] == ["ok", "ok"]
    prior = cache.prior(CPU, "fp32")
    assert prior[built.runtime]["wins"] == 1 and prior[built.runtime]["ratios"] == [1.0]
    assert all(len(prior[n]["ratios"]) == 1 and prior[n]["compile_s"] for n in prior)


def test_the_prior_orders_the_candidates(tmp_path, quick_timing):
    module, samples, _ = part_and_samples()
    cache = CompileCache(tmp_path)
    write_prior(cache, torch={"wins": 4, "ratios": [1.0] * 4},
                openvino={"wins": 1, "ratios": [1.0, 1.1, 1.2, 1.1, 1.25]})  # close: tried
    built = build_part(module, CPU, "fp32", samples, cache)
    assert [(c.runtime, c.status) for c in built.candidates] == [("torch", "ok"),
                                                                  ("openvino", "ok")]


def test_a_runtime_that_always_lost_is_skipped_and_a_restart_loads_the_winner(
        tmp_path, quick_timing, monkeypatch):
    module, samples, calls = part_and_samples()
    cache = CompileCache(tmp_path)
    write_prior(cache, torch={"wins": 5, "ratios": [1.0] * 5},
                openvino={"ratios": [1.5, 2.1, 2.5, 1.8, 3.0]})
    built = build_part(module, CPU, "fp32", samples, cache)
    assert built.runtime == "torch" and built.compiled == ["torch"]
    skipped = built.candidates[1]
    assert (skipped.runtime, skipped.status) == ("openvino", "skipped")
    assert skipped.reason == ("lost every one of 5 recorded searches on this device by "
                              ">=1.3x (median 2.1x)")
    prior = cache.prior(CPU, "fp32")
    assert prior["openvino"]["skipped"] == 1 and prior["torch"]["wins"] == 6

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled on a restart")

    monkeypatch.setattr(registry.runtime_class("openvino"), "compile", no_compile)
    monkeypatch.setattr(select, "_try", no_compile)  # nothing compiled or timed
    again = build_part(module, CPU, "fp32", samples, cache)
    assert again.from_cache and again.runtime == "torch" and again.compiled == []
    assert len(calls) == 1


def test_a_loser_is_still_tried_while_no_candidate_is_accurate(tmp_path, quick_timing,
                                                               monkeypatch):
    module, samples, _ = part_and_samples()
    cache = CompileCache(tmp_path)
    write_prior(cache, torch={"wins": 5, "ratios": [1.0] * 5},
                openvino={"ratios": [1.5, 2.1, 2.5]})

    def broken(*args, **kwargs):
        raise CompileError("torch broke")

    monkeypatch.setattr(registry.runtime_class("torch"), "compile", broken)
    built = build_part(module, CPU, "fp32", samples, cache)
    assert [(c.runtime, c.status) for c in built.candidates] == [("torch", "failed"),
                                                                  ("openvino", "ok")]
    assert built.runtime == "openvino"


def test_a_runtime_slower_to_compile_than_the_time_left_is_skipped(tmp_path, quick_timing):
    module, samples, _ = part_and_samples()
    cache = CompileCache(tmp_path)
    write_prior(cache, torch={"wins": 3, "ratios": [1.0] * 3},
                openvino={"ratios": [0.9, 1.0], "compile_s": [400.0, 350.0, 500.0]})
    built = build_part(module, CPU, "fp32", samples, cache, timeout_s=300)
    assert built.candidates[1].status == "skipped"
    assert built.candidates[1].reason.startswith("expected to compile in 400 s (median of 3")


def test_a_runtime_skipped_often_in_a_row_is_tried_again(tmp_path, quick_timing):
    module, samples, _ = part_and_samples()
    cache = CompileCache(tmp_path)
    write_prior(cache, torch={"wins": 5, "ratios": [1.0] * 5},
                openvino={"ratios": [2.0] * 5, "skipped": select.RETRY_AFTER})
    built = build_part(module, CPU, "fp32", samples, cache)
    assert [c.status for c in built.candidates] == ["ok", "ok"]
    assert cache.prior(CPU, "fp32")["openvino"]["skipped"] == 0


def test_record_search_tallies_wins_ratios_and_compile_times(tmp_path):
    cache = CompileCache(tmp_path)

    def cand(runtime, status, ms, compile_s=1.0, cached=False):
        return {"runtime": runtime, "status": status, "median_ms": ms,
                "compile_s": compile_s, "cached": cached}

    for _ in range(25):
        cache.record_search(CPU, "fp32", [cand("openvino", "ok", 2.0),
                                          cand("torch", "ok", 3.0, cached=True),
                                          cand("llvm-cpu", "timeout", 0.0, 300.0),
                                          cand("triton", "unavailable", 0.0)], "openvino")
    prior = cache.prior(CPU, "fp32")
    assert set(prior) == {"openvino", "torch", "llvm-cpu"}
    assert prior["openvino"]["wins"] == 25 and len(prior["openvino"]["ratios"]) == 20
    assert prior["torch"]["ratios"][-1] == 1.5 and prior["torch"]["compile_s"] == []
    assert prior["llvm-cpu"]["ratios"] == [] and prior["llvm-cpu"]["compile_s"][-1] == 300.0
    other = DeviceProfile(id="cpu0", kind="cpu", cores=[0, 1], runtimes=CPU.runtimes)
    assert cache.prior(other, "fp32") == {} and cache.prior(CPU, "bf16") == {}
    cache.prior_path(CPU, "fp32").write_text("{not json")
    assert cache.prior(CPU, "fp32") == {}  # only a hint: unreadable means no history


def test_allowed_restricts_the_search(tmp_path, quick_timing):
    module, samples, _ = part_and_samples()
    cache = CompileCache(tmp_path)
    built = build_part(module, CPU, "fp32", samples, cache, allowed=["torch", "llvm-cpu"])
    assert [c.runtime for c in built.candidates] == ["torch"]
    assert cache.prior(CPU, "fp32") == {}  # one candidate is no choice: nothing learned
    with pytest.raises(CompileError, match=r"none of the allowed runtimes \['triton'\]"):
        build_part(module, CPU, "fp32", samples, CompileCache(tmp_path / "b"),
                   allowed=["triton"])


def test_allowed_runtimes_by_device_id_then_kind():
    npu = DeviceProfile(id="npu0", kind="npu", emulated=True)
    cfg = {"cpu": ["openvino", "onnxruntime"], "npu0": ["openvino"], "npu": ["torch"]}
    assert allowed_runtimes(cfg, CPU) == ["openvino", "onnxruntime"]
    assert allowed_runtimes(cfg, npu) == ["openvino"]
    assert allowed_runtimes({}, CPU) is None


def test_a_candidate_near_the_roofline_floor_ends_the_search(tmp_path, quick_timing):
    """With no history, the first accurate candidate within 1.25x of the part's roofline
    floor skips the rest, saying why; a floor it does not reach skips nothing."""
    module, samples, _ = part_and_samples()
    far = build_part(module, CPU, "fp32", samples, CompileCache(tmp_path / "far"),
                     floor_ms=1e-9)
    assert all(c.status == "ok" for c in far.candidates)
    near = build_part(module, CPU, "fp32", samples, CompileCache(tmp_path / "near"),
                      floor_ms=1e6)
    first, *rest = near.candidates
    assert first.status == "ok" and near.runtime == first.runtime
    assert rest and all(c.status == "skipped" for c in rest)
    assert "within 1.25x of its roofline floor" in rest[0].reason


def test_a_runtime_that_returns_nan_is_refused_naming_it(tmp_path, quick_timing, monkeypatch):
    """A NaN compares false with every bound: it must never pass as accurate (an fp16 part
    whose inputs overflow fp16 gives NaN; the check took it for an error of 0)."""
    module, samples, _ = part_and_samples()
    real = registry.runtime_class("torch").compile

    def nan_in_one_value(self, part, spec):
        exe = real(self, part, spec)
        run = exe.run

        def poisoned(inputs):
            out = [t.clone() for t in run(inputs)]
            out[0].view(-1)[0] = float("nan")
            return out

        exe.run = poisoned
        return exe

    monkeypatch.setattr(registry.runtime_class("torch"), "compile", nan_in_one_value)
    with pytest.raises(CompileError, match="torch: failed .returned inf or NaN in 1 of"):
        build_part(module, CPU, "fp32", samples, CompileCache(tmp_path), allowed=["torch"])


def test_close_candidates_are_timed_again_in_turn_and_the_faster_wins(monkeypatch):
    """Two accurate runtimes first timed 1.0 and 1.2 ms (each alone, at its compile, on a
    host that drifted) are timed again in turn: the one that runs faster then wins. One over
    CLOSE of the fastest, or inaccurate, is not run again. (A fake clock: no timing here.)"""
    clock = [0.0]
    monkeypatch.setattr(select.time, "perf_counter", lambda: clock[0])
    runs: dict[str, int] = {}

    class Exe:
        def __init__(self, name: str, ms: float) -> None:
            self.name, self.ms = name, ms

        def run(self, inputs):  # noqa: ANN001, ANN202
            runs[self.name] = runs.get(self.name, 0) + 1
            clock[0] += self.ms / 1e3

    exes = {"a": Exe("a", 2.0), "b": Exe("b", 1.0), "slow": Exe("slow", 0.1),
            "wrong": Exe("wrong", 0.1)}
    tried = [select.Candidate("a", "ok", rel_error=1e-6, median_ms=1.0),
             select.Candidate("b", "ok", rel_error=1e-6, median_ms=1.2),
             select.Candidate("slow", "ok", rel_error=1e-6, median_ms=5.0),
             select.Candidate("wrong", "ok", rel_error=1.0, median_ms=0.5)]
    select.retime_close(tried, exes, [], 1e-3)
    assert set(runs) == {"a", "b"} and min(runs.values()) >= 3 * 2  # 3 rounds of blocks
    assert (tried[0].median_ms, tried[1].median_ms) == pytest.approx((2.0, 1.0))
    assert min((c for c in tried[:2]), key=lambda c: c.median_ms).runtime == "b"

    # parts longer than a block run once a block, that run counted: no run is thrown away
    runs.clear()
    budget_ms = select.TIMING_BUDGET_S * 1e3
    exes = {"long": Exe("long", budget_ms), "longer": Exe("longer", 1.5 * budget_ms)}
    tried = [select.Candidate("long", "ok", rel_error=1e-6, median_ms=90.0),
             select.Candidate("longer", "ok", rel_error=1e-6, median_ms=80.0)]
    select.retime_close(tried, exes, [], 1e-3)
    assert runs == {"long": 3, "longer": 3}  # the 3 rounds at least, past the budget
    assert tried[0].median_ms < tried[1].median_ms


def test_a_cache_entry_is_signed_and_one_that_fails_is_rebuilt(tmp_path):
    """Compile-cache entries are code the daemon loads: each has a manifest of its files'
    sha256 signed with the daemon's key, verified before a load; a changed, added or missing
    file, no manifest, or another key's signature drops the entry (issue 49, 10)."""
    key = b"k" * 32
    cache = CompileCache(tmp_path, key=key)

    def write(into):
        (into / "part.bin").write_bytes(b"\x7fELF code")
        (into / "sub").mkdir()
        (into / "sub" / "blob").write_bytes(b"weights")

    entry = cache.store("e1", write, {"runtime": "openvino", "runtime_version": "1"})
    assert cache.lookup("e1") == entry
    art = cache.artifact("e1")
    assert art["verified"] and len(art["hash"]) == 16 and art["runtime_version"] == "1"
    assert CompileCache(tmp_path, key=b"x" * 32).lookup("e1") is None  # another key's
    cache.store("e2", write, {})
    (cache.entries / "e2" / "sub" / "blob").write_bytes(b"tampered")
    assert cache.lookup("e2") is None and not (cache.entries / "e2").exists()
    cache.store("e3", write, {})
    (cache.entries / "e3" / "extra.so").write_bytes(b"more code")
    assert cache.lookup("e3") is None
    cache.store("e4", write, {})
    (cache.entries / "e4" / "manifest.json").unlink()  # an entry from before signing
    assert cache.lookup("e4") is None
    assert cache.rejected == 3


def test_eviction_leaves_another_workers_entry_in_the_making(tmp_path, monkeypatch):
    """The workers of a daemon share its compile cache, each evicting after its own store: an
    entry another one is writing (`.tmp-*`, its meta.json written before it is renamed into
    place) is not an entry yet, and one gone meanwhile is skipped. Evicting stat'ed the
    meta.json of a temp another worker had just renamed: that worker's build failed
    (FileNotFoundError, a CI run's split model on the emulated NPU)."""
    cache = CompileCache(tmp_path, key=b"k" * 32)

    def write(into):
        (into / "part.bin").write_bytes(b"x" * 100)

    cache.store("old", write, {})
    making = cache.entries / ".tmp-another-worker"
    making.mkdir()
    (making / "meta.json").write_text("{}")
    gone = cache.entries / "gone"  # listed, then removed by another worker before its stat
    gone.mkdir()
    listed = list(cache.entries.iterdir())
    shutil.rmtree(gone)
    monkeypatch.setattr(type(cache.entries), "iterdir", lambda self: iter(listed))
    cache.max_bytes = 0
    assert cache.evict() == ["old"]
    assert (making / "meta.json").exists()


def test_a_lower_precision_slower_than_the_part_built_is_not_measured(tmp_path, quick_timing,
                                                                     monkeypatch):
    """Under a budget a lower precision competes with the part's own, built first: a build
    that runs slower than it could never be chosen, so its error on every sample is not
    measured (fp16 on a CPU without fp16 units, a 128-token prompt: 4.4x fp32)."""
    module, samples, _ = part_and_samples()
    checked = []
    monkeypatch.setattr(select, "set_error", lambda got, want: checked.append(1) or 0.0)
    with pytest.raises(CompileError, match="not faster, its error not measured") as refused:
        build_part(module, CPU, "bf16", samples, CompileCache(tmp_path), allowed=["torch"],
                   slower_than=("fp32", 1e-6))
    (cand,) = refused.value.candidates
    assert cand.status == "skipped" and cand.median_ms > 0 and not checked
    built = build_part(module, CPU, "bf16", samples, CompileCache(tmp_path / "again"),
                       allowed=["torch"], slower_than=("fp32", 1e6))
    assert built.runtime == "torch" and checked


def test_a_mixed_precision_built_without_a_budget_takes_its_low_precisions_tolerance() -> None:
    """A restart (or the guard's plan, cuvild/load/guard.py) may build only the mix a search
    chose, with no budget given: it was a KeyError ('bf16+fp32') that failed the load."""
    from runtimes.base import TOLERANCE

    assert select.own_tolerance("bf16+fp32") == TOLERANCE["bf16"]
    assert select.own_tolerance("fp16+fp32") == TOLERANCE["fp16"]
    assert select.own_tolerance("int8+fp32") == TOLERANCE["int8+fp32"]
    assert select.own_tolerance("fp32") == TOLERANCE["fp32"]


def test_a_parts_digest_names_its_code_and_every_weights_bytes() -> None:
    """runtimes/cache.py graph_digest: the compile cache's key for a part. The same part
    (and another module on the same weights: a model's buckets) digests alike, a weight
    written in place or a different graph does not; a weight's hash is kept for its tensor
    while its data is unchanged."""
    from runtimes.cache import _WEIGHTS, graph_digest, weight_digest

    class Layer(torch.nn.Module):
        def __init__(self, linear: torch.nn.Linear, act: object) -> None:
            super().__init__()
            self.linear, self.act = linear, act

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.linear(x))  # type: ignore[operator]

    model = Layer(torch.nn.Linear(8, 8), torch.relu).eval()
    one = torch.fx.symbolic_trace(model)
    first = graph_digest(one)
    assert graph_digest(torch.fx.symbolic_trace(model)) == first  # (the same weights)
    weight = model.linear.weight
    assert _WEIGHTS[id(weight)][2] == weight_digest(weight)
    was = weight[0, 0].item()
    with torch.no_grad():
        weight[0, 0] = was + 1.0  # (an in-place write: its version moves)
    assert graph_digest(one) != first
    with torch.no_grad():
        weight[0, 0] = was
    assert graph_digest(one) == first  # (the same bytes again)
    other = torch.fx.symbolic_trace(Layer(model.linear, torch.tanh))
    assert graph_digest(other) != first
    key = id(weight)
    del model, one, other, weight
    import gc

    gc.collect()
    assert key not in _WEIGHTS  # (gone with its tensor)


def test_inductors_precompiled_headers_are_kept_in_its_cache_directory(tmp_path, monkeypatch):
    """A daemon's temporary directory is its scratch, gone with the process; inductor builds
    its precompiled headers under the temporary directory whatever TORCHINDUCTOR_CACHE_DIR
    says: `keep_inductor_headers` links them into that cache. Checked against this torch's
    own idea of where they go (a name it changed would leave the link unused)."""
    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # where this torch puts them: its default cache directory's precompiled_headers
    assert codecache._HEADER_DIR == os.path.join(  # noqa: SLF001 - the path it builds them in
        default_cache_dir(), "precompiled_headers")
    scratch, cache = tmp_path / "scratch", tmp_path / "cache" / "inductor"
    scratch.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    keep_inductor_headers(str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # (a daemon's TMPDIR)
    looked = os.path.join(default_cache_dir(), "precompiled_headers")
    assert os.path.realpath(looked) == str((cache / "precompiled_headers").resolve())


def test_a_mix_is_not_searched_with_a_runtime_that_killed_its_worker_on_that_part(
        tmp_path, monkeypatch) -> None:
    """A mix's search compiles too (runtimes/mixed.py): each compile is marked, and one
    that killed a worker (OpenVINO's SIGFPE at bf16 on an AMX Xeon) is not tried again
    there: the search has no runtime left, which is a mix not built, not a dead worker."""
    from runtimes import crashes
    from runtimes.openvino import OpenVINORuntime

    module, samples, _ = part_and_samples()
    cache = CompileCache(tmp_path)
    marked = []
    real_attempt = crashes.attempt

    def attempt(root, part_key, runtime):  # noqa: ANN001, ANN202 - the marks made
        marked.append((part_key, runtime))
        return real_attempt(root, part_key, runtime)

    monkeypatch.setattr(crashes, "attempt", attempt)
    monkeypatch.setattr(OpenVINORuntime, "compile", lambda *_: (_ for _ in ()).throw(
        RuntimeError("a compiler's own error")))
    with pytest.raises(CompileError, match="compiler's own error"):
        build_part(module, CPU, "bf16+fp32", samples, cache, allowed=["openvino"],
                   mix_target=1e-3)
    assert marked and marked[0][1] == "openvino"  # the search's compile, marked
    (cache.root / crashes.FOLDER).mkdir(exist_ok=True)
    (cache.root / crashes.FOLDER / f"{marked[0][0]}-openvino.crashed").touch()
    monkeypatch.setattr(OpenVINORuntime, "compile", lambda *_: pytest.fail("compiled again"))
    with pytest.raises(CompileError, match="none of .* can build a mixed part"):
        build_part(module, CPU, "bf16+fp32", samples, cache, allowed=["openvino"],
                   mix_target=1e-3)
