"""partitioner/split.py `last_rows`: a language model's split with its logits computed at the
last position only (what generation reads): the head applied to one row, not every row of a
prompt's chunk. The same values as the whole split's last row, on the same weight tensors
(nothing copied), for Llama's and GPT-2's exports (Gemma's head is Llama's); None for a
model whose first output is no linear over positions."""

from __future__ import annotations

import lm_models
import pytest
import torch

from partitioner.split import last_rows, split_program
from runtimes.torch_eager import remember_initial, reset


def split_of(ep: torch.export.ExportedProgram, parts: int = 1):  # noqa: ANN201
    nodes = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    cut = len(nodes) // parts
    return split_program(ep, [(f"p{k}", nodes[k * cut:(k + 1) * cut if k < parts - 1 else None])
                              for k in range(parts)])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_logits_of_the_last_position_alone_are_the_whole_splits_last_row(
        family: str) -> None:
    split = split_of(lm_models.export(lm_models.lm(family), dynamic=True), parts=2)
    twin = last_rows(split)
    assert twin is not None and twin.outputs == split.outputs
    changed = [p for p, q in zip(split.parts, twin.parts, strict=True) if p is not q]
    assert [p.id for p in changed] == [split.parts[-1].id]  # only the head's part is new
    new = next(q for q in twin.parts if q.id == changed[0].id)
    for name, value in changed[0].module.named_buffers():  # the same tensors, not copies
        assert getattr(new.module, name) is value, name
    ids, position = torch.tensor([[5, 17, 42, 99, 3]]), torch.arange(5)
    with torch.no_grad():
        for p in split.parts:
            remember_initial(p.module)
        (whole,) = split.run(ids, position)
        for p in split.parts:
            reset(p.module)
        (last,) = twin.run(ids, position)
    assert whole.shape[1] == 5 and last.shape == (1, 1, whole.shape[-1])
    torch.testing.assert_close(last, whole[:, -1:], rtol=1e-5, atol=1e-5)


def test_a_model_whose_output_is_no_linear_over_positions_has_no_last_rows() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.fc(x))

    ep = torch.export.export(Net(), (torch.randn(2, 3, 8),))
    assert last_rows(split_of(ep)) is None
    flat = torch.export.export(torch.nn.Linear(8, 4), (torch.randn(2, 8),))
    assert last_rows(split_of(flat)) is None  # [batch, features]: no positions to cut
