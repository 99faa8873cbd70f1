"""The prefix cache: a finished generation's sequence kept with the tokens its state holds, so
that a later prompt beginning with some of them runs only the rest.

A chat sends its whole conversation again each turn, and many requests begin with one system
prompt: without this each runs its prompt from the start. vLLM keeps the KV blocks of
finished requests, hashed by the tokens before them, and shares them; here the unit is a
whole sequence (cuvild/run/sequences.py), kept as its generation left it, at no cost (no
copy). A new prompt takes the kept sequence that shares the most tokens with it:
- all of them (the prompt goes on where the kept one stopped: a chat's next turn): the
  sequence itself, taken out of the cache;
- fewer (a system prompt, then another question): where the model's state can be cut back
  (`State.croppable`: a static KV cache and its written counts, nothing else), a copy of
  it holding those tokens alone (a `CopySequence` with a length); the kept one stays.
At least the prompt's last token runs (its logits pick the first new token), and the shared
part must be `least` tokens or more, fewer are not worth a copy. Kept sequences are bounded
by `budget` bytes of state, the least recently used going first, and are live sequences:
they count toward `engine.sequences.max_live` (one is ended to make room before a new
sequence is refused), end after `engine.sequences.idle_timeout_s` unused, and go with their
model or their worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cuvild.run.sequences import Live, Sequences

if TYPE_CHECKING:
    from cuvild.core.loaded import LoadedModel

log = logging.getLogger(__name__)
LEAST = 16  # tokens a hit shares at the least (vLLM caches whole 16-token blocks)


@dataclass
class Kept:
    live: Live
    tokens: tuple[int, ...]  # what its state holds, from position 0
    nbytes: int


def shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens `a` and `b` have in common."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Prefixes:
    def __init__(self, sequences: Sequences, copy: Callable[[Live, Live, int], None],
                 budget: int, least: int = LEAST) -> None:
        """`copy(source, to, length)`: sequence `to` starts from `source`'s state cut back to
        its first `length` positions (Runner.copy_sequence); `budget`: bytes of kept state
        at most (0: none kept)."""
        self.sequences, self.copy = sequences, copy
        self.budget, self.least = budget, least
        self._kept: OrderedDict[int, Kept] = OrderedDict()  # by slot, least recently used first
        self._lock = threading.Lock()
        sequences.spare = self.spare

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, model: LoadedModel, live: Live, tokens: Sequence[int]) -> bool:
        """Keep `live` (its generation ended; its state holds `tokens`): False where it is
        not kept (too short, the budget, not live), the caller then ends it."""
        assert model.state is not None
        nbytes = model.state.nbytes
        if len(tokens) < self.least or nbytes > self.budget or not self.sequences.alive(live):
            return False
        live.last = time.monotonic()  # (its idle time counts from now)
        with self._lock:
            self._kept[live.slot] = Kept(live, tuple(tokens), nbytes)
            over = self._over()
        for old in over:
            self._end(old, "over engine.sequences.prefix_cache_mib")
        return True

    def _over(self) -> list[Kept]:
        """Those taken out to bring the kept state within the budget (under the lock)."""
        out = []
        while sum(k.nbytes for k in self._kept.values()) > self.budget:
            out.append(self._kept.popitem(last=False)[1])
        return out

    def take(self, model: LoadedModel, prompt: Sequence[int],
             begin: Callable[[], Live]) -> tuple[Live, int] | None:
        """A sequence whose state holds `prompt`'s first n tokens, and n; None where no kept
        one shares `least` or more with it. `begin()` makes the new sequence a shorter cut
        is copied into."""
        assert model.state is not None
        kept, n = self._best(model, prompt)
        if kept is None:
            return None
        if n == len(kept.tokens):
            return kept.live, n  # (taken out of the cache by _best)
        live = begin()  # (may end a kept one to make room: this one too, then a miss)
        try:
            with kept.live.lock:  # (no step of it, and it does not end, meanwhile)
                if not self.sequences.alive(kept.live):
                    raise RuntimeError("it ended meanwhile")
                self.copy(kept.live, live, n)
        except Exception as e:  # noqa: BLE001 - a miss: the prompt runs from its start
            self.sequences.end(live, "ended (its state did not copy)")
            log.warning("model %s: a kept prefix of %d tokens did not copy (%s); the prompt "
                        "runs from its start", model.key, n, e)
            return None
        return live, n

    def _best(self, model: LoadedModel, prompt: Sequence[int]) -> tuple[Kept | None, int]:
        """The kept sequence sharing the most of `prompt` (at most all but its last token)
        that may give them (all it holds; or a cut, where the state is croppable), and how
        many: one giving all it holds is taken out of the cache."""
        assert model.state is not None
        most = len(prompt) - 1
        with self._lock:
            dead = [k for k in self._kept.values() if not self.sequences.alive(k.live)]
            for k in dead:
                del self._kept[k.live.slot]
            best, n = None, 0
            for kept in self._kept.values():
                if kept.live.key != model.key:
                    continue
                m = min(shared(kept.tokens, prompt), most)
                if m > n and (m == len(kept.tokens) or model.state.croppable):
                    best, n = kept, m
            if best is None or n < self.least:
                return None, 0
            if n == len(best.tokens):
                del self._kept[best.live.slot]
                best.live.last = time.monotonic()  # (not reaped as idle before its step)
            else:
                self._kept.move_to_end(best.live.slot)
        return best, n

    def spare(self) -> bool:
        """End the least recently used kept sequence (live sequences are at their cap):
        False where none is kept."""
        with self._lock:
            if not self._kept:
                return False
            old = self._kept.popitem(last=False)[1]
        self._end(old, "to make room under engine.sequences.max_live")
        return True

    def _end(self, old: Kept, why: str) -> None:
        with old.live.lock:  # (not while a shorter cut of it is copied: `take`)
            self.sequences.end(old.live, f"ended (the prefix cache's least recently used, {why})")
