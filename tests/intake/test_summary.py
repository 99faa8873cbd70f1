"""What intake records of a model's inputs for the engine's checks (cuvild/intake/summary.py),
and the check inputs drawn from it (cuvild/workers/build.sample_inputs): token ids of a text
model are random ids below its embedding table's rows, not all ones, so that a precision
search's check inputs differ from one another."""

from __future__ import annotations

import torch
from torch import nn

from cuvild.intake.registry import ModelRecord
from cuvild.intake.summary import summarize
from cuvild.serve.control import record_to_pb
from cuvild.workers.build import sample_inputs


class Text(nn.Module):
    """Token ids (through a view) and token types into embeddings; a mask that indexes
    nothing; positions used both as an index and in arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.words, self.types, self.positions = (nn.Embedding(100, 8), nn.Embedding(2, 8),
                                                  nn.Embedding(16, 8))

    def forward(self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        x = self.words(ids.view(-1, 5)) + self.types(types) + self.positions(positions)
        return x * mask.unsqueeze(-1) + positions.unsqueeze(-1)


def specs() -> list[dict]:
    # Four tensors: export ties inputs given as one tensor object together.
    ids, types, mask, positions = (torch.ones(2, 5, dtype=torch.long) for _ in range(4))
    ep = torch.export.export(Text(), (ids, types * 0, mask, positions))
    return summarize(ep)["inputs"]


def test_an_input_that_indexes_an_embedding_is_bounded_by_its_rows() -> None:
    bounds = {s["name"]: s.get("high") for s in specs()}
    assert bounds == {"ids": 100, "types": 2, "mask": None, "positions": 16}


def test_check_inputs_draw_ids_below_the_bound_and_differ_by_seed() -> None:
    given = specs()
    first, second = sample_inputs(given, 0), sample_inputs(given, 1)
    ids, types, mask, positions = first
    assert 0 <= ids.min() and ids.max() < 100 and len(ids.unique()) > 1
    assert set(types.unique().tolist()) <= {0, 1} and positions.max() < 16
    assert torch.equal(mask, torch.ones_like(mask))  # a mask of zeros would mask everything
    assert not torch.equal(ids, second[0])
    assert torch.equal(ids, sample_inputs(given, 0)[0])  # deterministic per seed
    Text()(*first)  # valid inputs: every index is in range


def test_the_bound_stays_inside_the_daemon() -> None:
    record = ModelRecord(name="t", version="1", sha256="0" * 64, size_bytes=1, created_at=0.0,
                         inputs=specs())
    assert [t.name for t in record_to_pb(record).inputs] == ["ids", "types", "mask", "positions"]


def test_every_other_check_input_left_pads_the_last_row_of_an_attention_mask() -> None:
    """A transformer's `attention_mask` (by its name): on odd seeds its last row's first half
    is 0, as a decoder's left-padded batch, so a check meets queries that attend no key
    (runtimes/masks.py); a mask of another name, one row, or seed 0 stays ones."""
    spec = {"name": "attention_mask", "dtype": "int64", "shape": [2, 8]}
    other = {**spec, "name": "mask"}
    plain, padded = sample_inputs([spec, other], 0), sample_inputs([spec, other], 1)
    assert torch.equal(plain[0], torch.ones(2, 8, dtype=torch.long))
    assert padded[0][0].tolist() == [1] * 8 and padded[0][1].tolist() == [0] * 4 + [1] * 4
    assert torch.equal(padded[1], torch.ones(2, 8, dtype=torch.long))
    one_row = sample_inputs([{**spec, "shape": [-1, 8]}], 1)[0]
    assert torch.equal(one_row, torch.ones(1, 8, dtype=torch.long))
