"""A program that keeps state (a language model's cache, updated in place) split into parts
computes what it does whole, step after step (partitioner/split.py): an update in place goes
with the value it updates, a value other parts read before a later update is sent as it
was then, and a split that would update a copy, or where no one copy serves every reader,
is refused (ValueError: the load serves one device instead), never run wrong."""

from __future__ import annotations

import copy

import lm_models
import pytest
import torch

from partitioner.plan import plan_model
from partitioner.profile import DeviceProfile
from partitioner.split import split_program
from runtimes.torch_eager import remember_initial


def chunks(ep: torch.export.ExportedProgram, k: int) -> list[tuple[str, list[str]]]:
    """The program's nodes in k runs of graph order (always acyclic)."""
    names = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    size = -(-len(names) // k)
    return [(f"p{i}", names[i * size:(i + 1) * size]) for i in range(k)]


def steps(run, prompt: list[int], tokens: int) -> list[torch.Tensor]:  # noqa: ANN001
    """Logits of the prompt in one run, then of `tokens` steps on the greedy token."""
    out = [run(torch.tensor([prompt]), torch.arange(len(prompt)))]
    for i in range(tokens):
        token = int(out[-1][0, -1].argmax())
        out.append(run(torch.tensor([[token]]), torch.tensor([len(prompt) + i])))
    return out


def whole(ep: torch.export.ExportedProgram):  # noqa: ANN201
    """The program run whole, its state kept from one call to the next (its own buffers)."""
    module = ep.module()
    return lambda ids, position: module(input_ids=ids, cache_position=position)


PROMPTS = {True: [5, 17, 42, 99], False: [5]}  # (one token a step: a one-token prompt)


@pytest.fixture(scope="module", params=[True, False], ids=["dynamic", "one-token"])
def program(request: pytest.FixtureRequest) -> tuple:
    """The tiny Llama exported (of a dynamic length, or for one token a step) and the
    logits it gives whole over a generation."""
    ep = lm_models.export(lm_models.lm("llama"), dynamic=request.param)
    want = steps(whole(copy.deepcopy(ep)), PROMPTS[request.param], 6)
    return ep, request.param, want


@pytest.mark.parametrize("k", [2, 3, 5, 8, 13])
def test_a_split_language_model_computes_what_it_does_whole(program: tuple, k: int) -> None:
    ep, dynamic, want = program
    split = split_program(copy.deepcopy(ep), chunks(ep, k))  # (its parts hold its buffers)
    for part in split.parts:
        remember_initial(part.module)
    got = steps(lambda *x: split.run(*x)[0], PROMPTS[dynamic], 6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_the_cache_position_and_its_update_go_where_it_is_written() -> None:
    """Planned over a CPU and an NPU that holds almost nothing, one token a step: the
    cache's start position is written (`copy_`) in one part, viewed (`to`) in another and
    updated in place there (`+= 1`), which would update a copy; the view and its update go
    to the part that writes it, and the split computes what the program does whole (it was
    refused before: 8 of 10 such plans of the tiny Llama one token a step, 3 of 8 of a
    dynamic length)."""
    cpu = DeviceProfile(id="cpu0", kind="cpu", runtimes=["torch"], peak_gflops={"fp32": 50.0},
                        mem_bw_gbs=10.0, link_bw_gbs=10.0)
    npu = DeviceProfile(id="npu0", kind="npu", emulated=True, runtimes=["openvino"],
                        peak_gflops={"fp32": 50.0}, mem_bw_gbs=20.0, link_bw_gbs=10.0,
                        memory_gb=0.0002)
    ep = lm_models.export(lm_models.lm("llama"))
    want = steps(whole(copy.deepcopy(ep)), PROMPTS[False], 6)
    plan = plan_model(ep, [cpu, npu])
    assert len({p.device for p in plan.parts}) == 2
    split = split_program(copy.deepcopy(ep), [(p.id, p.nodes) for p in plan.parts])
    for part in split.parts:
        remember_initial(part.module)
    got = steps(lambda *x: split.run(*x)[0], PROMPTS[False], 6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


class Twice(torch.nn.Module):
    """A buffer updated in place twice, the first update's value read by another op."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.s.add_(x)
        y = t * 2
        t.add_(1)
        return y + t * 3


def test_a_split_that_cannot_keep_the_state_is_refused_not_run_wrong() -> None:
    """The buffer's first update in one part, its second (which a later op reads) in
    another, which would update a copy: refused, and the load then serves one device
    (cuvild/load/prepare.py `_one_device`)."""
    ep = torch.export.export(Twice(), (torch.ones(4),))
    names = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    assert names == ["add_", "mul", "add__1", "mul_1", "add"]  # (the graph as exported)
    with pytest.raises(ValueError, match="updated in place by another part: the program "
                                         "cannot be split there"):
        split_program(ep, [("p0", ["add_"]), ("p1", ["mul"]), ("p2", names[2:])])
