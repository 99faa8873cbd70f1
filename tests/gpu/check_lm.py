"""The lease script's language-model section (check_gpu.py runs it as a child: `--child lm`):
a decoder's stateful part on the GPU through the torch runtime (runtimes/torch_cuda.py), as
the daemon builds it for a GPU.

A small decoder written here (the lent machine may have no transformers), its KV cache as
buffers written in place, exported as transformers' static-cache export is (inputs
`input_ids` [1, 1] and `cache_position` [1]):
- greedy tokens on the GPU at fp32 equal the host's (the torch runtime on the CPU), and the
  per-step logits error at fp32, bf16 and fp16 against the host's fp32;
- a decode step's time at context 64 and 512 on the GPU (fp32, bf16) next to torch eager of
  the same module on the GPU (the floor of an eager step: ours should be within ~1.1x) and the
  part on the host's CPU;
- the runtime's own view: the GPU is offered for the part (registry), the state pool is on it;
- the engine's (`engine_row`, where the lease's measured profile is given): the decoder
  loaded as the daemon loads it, on the measured CPU and GPU, its plan (where it goes and
  why), 16 greedy tokens through the engine's sequences equal the host's, a step's time.

`python3 tests/gpu/check_lm.py [STATE_DIR]` runs it alone (STATE_DIR: a daemon's state
directory, whose measured profile the engine row uses); on a host without CUDA it runs the
same steps through the device path on the host (a dry run of this script) and says so.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu")]

import check_parts  # noqa: E402 - after the path

from partitioner.annotate import export  # noqa: E402 - after the path
from partitioner.profile import DeviceProfile  # noqa: E402
from partitioner.split import split_program  # noqa: E402
from runtimes import state, torch_cuda  # noqa: E402
from runtimes.base import CompileSpec  # noqa: E402
from runtimes.torch_eager import INITIAL, TorchExecutable, TorchRuntime, remember_initial  # noqa: E402

HIDDEN, HEADS, LAYERS, VOCAB, CONTEXT = 1024, 16, 8, 32000, 576  # ~134M parameters
STEPS = 16  # greedy tokens compared
POSITIONS = (64, 512)  # where a decode step is timed (the keys it attends)
RUNS = 20


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN, bias=False)
        self.register_buffer("k", torch.zeros(1, HEADS, CONTEXT, HIDDEN // HEADS))
        self.register_buffer("v", torch.zeros(1, HEADS, CONTEXT, HIDDEN // HEADS))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        a = nn.functional.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask)
        x = x + self.out(a.transpose(1, 2).reshape(b, n, HIDDEN))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        keys = torch.arange(CONTEXT, device=cache_position.device)
        mask = (keys[None, :] <= cache_position[:, None])[None, None]
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cache_position, mask)
        return self.head(self.norm(x))


def decoder_part() -> tuple[Decoder, Any, torch.fx.GraphModule, list[str]]:
    """The decoder, its exported program, the program's one part and the part's inputs."""
    torch.manual_seed(0)
    model = Decoder().eval()
    with torch.no_grad():  # logits far apart: a greedy token is no near tie
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    ep = export(model, (torch.tensor([[1]]), torch.tensor([0])))
    nodes = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    program = split_program(ep, [("p0", nodes)])
    part = program.parts[0]
    remember_initial(part.module)
    return model, ep, part.module, list(part.inputs)


def step_inputs(names: list[str], pos: int, token: int) -> list[torch.Tensor]:
    given = {"input_ids": torch.tensor([[token]]), "cache_position": torch.tensor([pos])}
    return [given[next(k for k in given if k in name)] for name in names]


def greedy(exe: Any, names: list[str], scope: str) -> tuple[list[int], list[torch.Tensor]]:
    ids, logits = [1], []
    for pos in range(STEPS):
        exe.use(1, scope)
        (out,) = exe.run(step_inputs(names, pos, ids[-1]))
        logits.append(out[0, -1])
        ids.append(int(out[0, -1].argmax()))
    state.drop_scope(scope)
    return ids[1:], logits


def step_ms(run: Callable[[], Any]) -> float:
    """Median ms of `run` (check_parts.py's timing: warm-up runs, then each synchronised)."""
    check_parts.DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    return check_parts.ms(run, RUNS)


def check(keep: Callable[[str, Any], None], left: Callable[[], float],
          state_dir: Path | None = None) -> None:
    cuda = torch.cuda.is_available()
    gpu = DeviceProfile(id="gpu0", kind="gpu", runtimes=["triton"])
    keep("device", torch.cuda.get_device_name(0) if cuda else
         "no CUDA device: a dry run, the device path on the host")
    t0 = time.perf_counter()
    model, ep, part, names = decoder_part()
    keep("export_s", round(time.perf_counter() - t0, 2))
    keep("offered", torch_cuda.target(gpu) is not None and TorchRuntime().can_target(gpu, "fp32"))
    host = TorchRuntime().compile(part, CompileSpec(device=DeviceProfile(id="cpu0", kind="cpu"),
                                                    example_inputs=step_inputs(names, 0, 1)))
    want, ref_logits = greedy(host, names, "host")
    rows: dict[str, Any] = {}
    for precision in ("fp32", "bf16", "fp16") if cuda else ("fp32",):  # (a dry run: one pass)
        if left() < 30:
            rows[precision] = "skipped: past the time budget"
            continue
        if cuda:
            spec = CompileSpec(device=gpu, precision=precision,
                               example_inputs=step_inputs(names, 0, 1))
            exe = TorchRuntime().compile(part, spec)
        else:  # the same code path on the host's own device
            exe = TorchExecutable(torch_cuda.on_device(part, torch.device("cpu"), INITIAL), None,
                                  torch.device("cpu"))
        rows[precision] = precision_row(exe, names, want, ref_logits)
        keep("rows", rows)
    if cuda and left() > 20:
        keep("torch_eager_gpu", eager_rows(model))
    if left() > 20:  # the part on the host's CPU (its cores), as the daemon would place it there
        keep("host_cpu_fp32", {**timed(host, names),
                               "threads": torch.get_num_threads()})
    profiles = sorted((state_dir / "profiles").glob("*.json")) if state_dir else []
    if profiles and left() > 60:
        keep("engine", engine_row(ep, profiles[-1], want))
    if profiles and left() > 60:  # a decoder that does not fit the accelerator: split
        weights = sum(t.numel() * t.element_size() for t in ep.state_dict.values())
        keep("engine_split", engine_row(ep, profiles[-1], want, weights / 2 / 1e9))


def engine_row(ep: Any, profile: Path, want: list[int],
               fits_gb: float | None = None) -> dict[str, Any]:
    """The decoder's program through the engine (planned, built and stepped as the daemon
    does) on the devices of the lease's measured profile (its state as exported: the runs
    before step on copies, runtimes/state.py). `fits_gb`: the first device that is no CPU
    holds only this much (half the weights): the plan splits the decoder over it and the
    CPU (partitioner/place.py `fit_memory`), served as planned, not as the load's guard
    would choose (a split that cannot keep the state as it runs whole: the CPU alone,
    partitioner/split.py)."""
    import os
    import tempfile

    from cuvild.core.arena import Arena
    from cuvild.core.loaded import Out
    from cuvild.engine.engine import Engine
    from cuvild.intake.summary import summarize
    from cuvild.run.generate import Sampling, generate
    from partitioner.plan import plan_model

    devices = [DeviceProfile.from_dict(d) for d in json.loads(profile.read_text())["devices"]]
    capped = next((d for d in devices if d.kind != "cpu"), None) if fits_gb else None
    if capped is not None:
        capped.memory_gb = fits_gb
    work = Path(tempfile.mkdtemp(prefix="cuvild-lm-"))
    torch.export.save(ep, work / "decoder.pt2")
    arena = Arena(f"{os.getpid()}-lm")
    engine = Engine(devices, work / "cache", arena, workers="thread")
    row: dict[str, Any] = {"devices": [d.id for d in devices],
                           "capped": f"{capped.id} holds {fits_gb:.3f} GB" if capped else None}
    try:
        t0 = time.perf_counter()
        # (capped: the split as planned, served as it is: its own tokens and step timed,
        # not the load's guard's choice, cuvild/load/guard.py)
        plan = plan_model(ep, devices) if capped is not None else None
        loaded = engine.prepare("decoder", "decoder", "1", work / "decoder.pt2",
                                summarize(ep)["inputs"], plan=plan)
        row["load_s"] = round(time.perf_counter() - t0, 2)
        row["parts"] = [f"{p.id}@{p.device}/{p.runtime}/{p.precision}"
                        for p in loaded.plan.parts]
        row["notes"] = loaded.plan.notes[:12]
        # the plan priced for a generation (partitioner/phases.py): its predicted decode step
        # here and on each device alone, beside the step measured below
        row["predicted"] = {k: loaded.plan.phases.get(k) for k in ("plan", "alone")}
        live = engine.runner.sequences.begin(loaded.key, "s", [p.device
                                                               for p in loaded.plan.parts])
        times: list[float] = []

        def step(ids: list[int], position: int) -> Any:
            inputs = [torch.tensor([ids]), torch.arange(position, position + len(ids))]
            t = time.perf_counter()
            (logits,) = engine.runner.step(loaded, live, inputs, Out({}))
            times.append(time.perf_counter() - t)
            return logits.numpy()[0, -1]

        got = list(generate(step, [1], Sampling(max_tokens=STEPS), CONTEXT))
        engine.runner.sequences.end(live)
        row.update(greedy_equal=got == want, step_ms=round(statistics.median(times) * 1e3, 3))
    finally:
        engine.close()
        arena.close()
    return row


def timed(exe: Any, names: list[str]) -> dict[str, float]:
    """A decode step's time at each of POSITIONS (the keys it attends), on one sequence."""
    out = {}
    for pos in POSITIONS:
        def run(pos: int = pos) -> Any:
            exe.use(1, "timed")
            return exe.run(step_inputs(names, pos, 7))
        out[f"step_ms_at_{pos}"] = step_ms(run)
    state.drop_scope("timed")
    return out


def precision_row(exe: Any, names: list[str], want: list[int],
                  ref_logits: list[torch.Tensor]) -> dict[str, Any]:
    got, logits = greedy(exe, names, "device")
    error = max(float((a - b).norm() / b.norm()) for a, b in zip(logits, ref_logits,
                                                                 strict=True))
    exe.use(1, "where")
    exe.run(step_inputs(names, 0, 1))
    pool = state.pool("where", exe.initial, exe._layout)  # noqa: SLF001 - where it is
    where = str(next(iter(pool.tensors.values())).device)
    state.drop_scope("where")
    return {"greedy_equal": got == want,
            "same_tokens": sum(a == b for a, b in zip(got, want, strict=True)), "of": STEPS,
            "max_step_error": f"{error:.2e}", "pool_device": where,
            **timed(exe, names)}


def eager_rows(model: Decoder) -> dict[str, float]:
    """torch eager of the module itself on the GPU, host tensors in and out: an eager step's
    floor (the torch runtime runs the part eagerly there too)."""
    eager = {}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        on = Decoder().to("cuda", dtype).eval()
        on.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()})
        for pos in POSITIONS:
            ids, at = torch.tensor([[7]]), torch.tensor([pos])
            with torch.inference_mode():
                eager[f"{precision}_step_ms_at_{pos}"] = step_ms(
                    lambda on=on, ids=ids, at=at: on(ids.cuda(), at.cuda()).float().cpu())
    return eager


def main() -> int:
    found: dict[str, Any] = {}
    deadline = time.monotonic() + 300

    def keep(key: str, value: Any) -> None:
        found[key] = value
        print(f"{key}: {json.dumps(value, default=str)}", flush=True)

    check(keep, lambda: deadline - time.monotonic(), Path(sys.argv[1]) if sys.argv[1:] else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
