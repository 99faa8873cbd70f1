"""Generation: a causal language model's tokens, one step at a time, on a sequence's state.

A generative model is one whose inputs are `input_ids` [1, n] and `cache_position` [n] and
whose first output is the logits [1, n, vocab] (transformers' TorchExportableModuleForDecoder
OnlyLM export: its KV cache is buffers the graph updates in place, kept per sequence by the
worker that runs it, cuvild/run/sequences.py). `generate` feeds the prompt (the prefill),
then picks each next token from the last logits (`pick`: greedy, or sampled with
temperature, top-k, top-p and min-p from a seeded generator, as transformers' `generate`
does; the repetition penalty, OpenAI's logit bias and frequency and presence penalties
first, and a grammar's mask, where asked) until max_tokens, a stop token (none before
min_tokens), the grammar's end or the end of the context. `logprobs` gives a token's
log-probability and the likeliest others', for OpenAI's `logprobs`
(cuvild/serve/generate_http.py).

The prefill runs in chunks: a model exported with a dynamic length `n` (its buckets, built
once each: cuvild/load/buckets.py) takes the prompt CHUNKS tokens at a time, the largest that
fit first (128 tokens: one run; 100: 64 + 16 + 16 + 4), and decodes one token a run; a model
exported for n = 1 takes the prompt token by token. A run reads every weight once, whatever
its length, so fewer runs are faster: a 128-token prompt of the 200M Llama in one run, not
two of 64. (Padding a chunk up to a longer one would save more runs, but transformers'
static cache writes at its own running count of tokens, which padding would advance.) Each
length is a bucket: five here, within the default `max_buckets` of 8.

Plain numpy: the daemon needs no torch to generate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from cuvild.core.layout import BadInput
from cuvild.core.loaded import Out
from protos.orders import RawTensor

if TYPE_CHECKING:
    from cuvild.core.loaded import LoadedModel
    from cuvild.run.sequences import Live

INPUTS = ("input_ids", "cache_position")
CHUNKS = (128, 64, 16, 4, 1)  # prefill chunk lengths, the largest that fits first (1: decode)


@dataclass
class Sampling:
    """How the next token is chosen. temperature 0: greedy (the argmax)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: all
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[int] = field(default_factory=tuple)  # token ids that end it (included)
    # OpenAI's: subtracted from a token's logit for each time it was generated before
    # (frequency) and once if it was (presence), as vLLM does: the generated tokens only
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # OpenAI's: token id -> a number in [-100, 100] added to its logit at every step
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    # vLLM's and transformers': the logit of a token of the prompt or the output divided by
    # it where positive, multiplied where negative (1: none)
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # a token less likely than min_p x the likeliest's is never picked
    min_tokens: int = 0  # the stop tokens (eos among them) held off until this many

    def check(self) -> Sampling:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise BadInput(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise BadInput(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise BadInput(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise BadInput(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise BadInput(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(t, int) for t in self.stop):
            raise BadInput(f"stop must be token ids (integers), got {list(self.stop)!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not -2 <= value <= 2):
                raise BadInput(f"{name} must be a number in [-2, 2], got {value!r}")
        return self._check_more()

    def _check_more(self) -> Sampling:
        number, penalty = (int, float), self.repetition_penalty
        if (not isinstance(penalty, number) or isinstance(penalty, bool)
                or not penalty > 0):
            raise BadInput(f"repetition_penalty must be a number > 0, got "
                           f"{self.repetition_penalty!r}")
        if not isinstance(self.min_p, number) or isinstance(self.min_p, bool) or not (
                0 <= self.min_p <= 1):
            raise BadInput(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if (not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool)
                or not 0 <= self.min_tokens <= self.max_tokens):
            raise BadInput(f"min_tokens must be an integer from 0 to max_tokens "
                           f"({self.max_tokens}), got {self.min_tokens!r}")
        return self._check_bias()

    def _check_bias(self) -> Sampling:
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise BadInput(f"logit_bias keys must be token ids, got {token!r}")
            if (not isinstance(bias, (int, float)) or isinstance(bias, bool)
                    or not -100 <= bias <= 100):
                raise BadInput(f"logit_bias values must be numbers in [-100, 100], got "
                               f"{bias!r} for token {token}")
        return self

    def adjusted(self, logits: np.ndarray, history: History) -> np.ndarray:
        """`logits` with the repetition penalty of the tokens seen, the logit bias added,
        the frequency and presence penalties of those generated taken off, and the stop
        tokens held off before min_tokens (`history`: the generation's so far)."""
        counts, seen = history.counts, history.seen
        penalties = counts is not None and bool(self.frequency_penalty or self.presence_penalty)
        early = history.made < self.min_tokens and bool(self.stop)
        if not (penalties or self.logit_bias or early or seen is not None):
            return logits
        out = logits.astype(np.float64)
        if seen is not None:
            out[seen] = np.where(out[seen] > 0, out[seen] / self.repetition_penalty,
                                 out[seen] * self.repetition_penalty)
        if self.logit_bias:
            out[list(self.logit_bias)] += list(self.logit_bias.values())
        if penalties:
            out -= self.frequency_penalty * counts + self.presence_penalty * (counts > 0)
        if early:
            out[[t for t in self.stop if 0 <= t < out.size]] = -np.inf
        return out


@dataclass
class History:
    """What the penalties read of a generation so far: how often each token id was
    generated (frequency, presence), which ids the prompt and the output hold (repetition),
    how many were generated (min_tokens)."""

    sampling: Sampling
    prompt: Sequence[int]
    counts: np.ndarray | None = None
    seen: np.ndarray | None = None
    made: int = 0

    def start(self, vocab: int) -> History:
        if self.sampling.repetition_penalty != 1:
            self.seen = np.zeros(vocab, bool)
            self.seen[[t for t in self.prompt if 0 <= t < vocab]] = True
        return self

    def add(self, token: int, vocab: int) -> None:
        self.made += 1
        if self.seen is not None:
            self.seen[token] = True
        if self.sampling.frequency_penalty or self.sampling.presence_penalty:
            self.counts = np.zeros(vocab) if self.counts is None else self.counts
            self.counts[token] += 1


def pick(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """The next token from one position's logits [vocab]."""
    if sampling.temperature == 0:
        return int(np.argmax(logits))
    scores = logits.astype(np.float64) / sampling.temperature
    if 0 < sampling.top_k < scores.size:
        kth = np.partition(scores, -sampling.top_k)[-sampling.top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if sampling.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = cumulative - probs[order] < sampling.top_p  # the smallest set reaching top_p
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    if sampling.min_p > 0:  # (after top-k and top-p, as transformers' warpers)
        probs = np.where(probs < sampling.min_p * probs.max(), 0.0, probs)
        probs /= probs.sum()
    return int(rng.choice(probs.size, p=probs))


class Constraint(Protocol):
    """A grammar the output is held to (cuvild/serve/structured.py): the logits with the
    tokens that cannot come next at -inf, each token picked taken in, and whether the output
    is complete (it ends there)."""

    def mask(self, logits: np.ndarray) -> np.ndarray: ...
    def accept(self, token: int) -> None: ...
    def done(self) -> bool: ...


Step = Callable[[list[int], int], np.ndarray]  # (token ids, first position) -> their logits
Scores = Callable[[np.ndarray, int], None]  # (a position's logits, the token picked from them)
# (a prompt chunk's logits, one row a position, and its first position)
PromptScores = Callable[[np.ndarray, int], None]


def logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `token` under the model's distribution at a position (the
    softmax of its raw logits: before temperature and penalties, as vLLM reports them) and
    the `top` most likely tokens' (id, log-probability), most likely first."""
    scores = logits.astype(np.float64)
    scores = scores - scores.max()
    log_probs = scores - np.log(np.exp(scores).sum())
    best: list[tuple[int, float]] = []
    if top > 0:
        ids = np.argpartition(-log_probs, min(top, log_probs.size) - 1)[:top]
        ids = ids[np.argsort(-log_probs[ids], kind="stable")]
        best = [(int(i), float(log_probs[i])) for i in ids]
    return float(log_probs[token]), best


def served_step(runner: Any, model: LoadedModel, chunked: LoadedModel, live: Live) -> Step:
    """The Step of a served model on sequence `live`: a prompt's chunks on `chunked` (its
    twin that computes the last position's logits alone: cuvild/load/buckets.py
    last_logits; or the model itself, for every position's), one token on `model`, each run
    on the bucket of its length. It returns the logits it computed, a row a position."""
    order = [model.inputs.index(n) for n in INPUTS]

    def step(ids: list[int], position: int) -> np.ndarray:
        values = (np.array([ids], np.int64),
                  np.arange(position, position + len(ids), dtype=np.int64))
        inputs: list[Any] = [None, None]
        given: list[Any] = [None, None]
        for value, at in zip(values, order, strict=True):
            inputs[at] = RawTensor(value.tobytes(), "int64", value.shape)
            given[at] = ("int64", value.shape)
        target = runner.resolve(chunked if len(ids) > 1 else model, given)  # its bucket
        vocab = target.slots[target.outputs[0]].shape[-1]
        raw = runner.step(target, live, inputs, Out({}, raw=True))[0]
        return np.frombuffer(raw, np.float32).reshape(-1, vocab)

    return step


def generate(step: Step, prompt: Sequence[int], sampling: Sampling, context: int,  # noqa: C901 - the prompt, then the loop
             chunks: Sequence[int] = (1,), scores: Scores | None = None,
             prompt_scores: PromptScores | None = None,
             prefilled: Callable[[np.ndarray], None] | None = None,
             start: np.ndarray | None = None, held: int = 0,
             constraint: Constraint | None = None) -> Iterator[int]:
    """The generated token ids, one at a time. `step(ids, position)` runs the model on `ids`
    at positions from `position` on the sequence's state and returns the logits of the last
    one [vocab] (or of each: [len(ids), vocab]); `chunks`: the lengths a step may take,
    largest first, 1 among them; `context`: the longest sequence the model's cache holds;
    `scores`, where given, is told each position's logits and the token picked from them
    before the token is yielded; `prompt_scores` the logits of each chunk of the prompt and
    its first position; `prefilled` the prompt's last logits once it ran (the sequence's
    state then holds the prompt); with `start` (those logits), the state already holds the
    prompt (a copy of another sequence's that ran it) and the prompt does not run again;
    `held`: the prompt's first tokens the state holds already (a kept prefix:
    cuvild/run/prefixes.py), the rest runs; `constraint`: a grammar each token is picked
    within, the output ending where it is complete. Once it ends (or its caller stops
    taking tokens), the state holds the prompt and every token yielded but the last."""
    sampling.check()
    if not prompt:
        raise BadInput("the prompt is empty: generation starts from at least one token")
    if len(prompt) >= context:
        raise BadInput(f"the prompt is {len(prompt)} tokens; the model's context is {context} "
                       "(its cache's length), and at least one must be left to generate")
    if not 0 <= held < len(prompt) or (held and prompt_scores is not None):
        raise ValueError(f"held {held}: the state holds less than the prompt, and none of a "
                         "prompt whose every position is scored")
    rng = np.random.default_rng(sampling.seed)
    logits, at = (np.empty(0), held) if start is None else (start, len(prompt))
    while at < len(prompt):
        size = next(c for c in chunks if c <= len(prompt) - at)
        logits = step(list(prompt[at:at + size]), at)
        if prompt_scores is not None:
            prompt_scores(np.asarray(logits).reshape(-1, np.asarray(logits).shape[-1]), at)
        at += size
    if prefilled is not None and start is None:
        prefilled(np.asarray(logits))
    position = len(prompt)
    history: History | None = None
    for made in range(1, sampling.max_tokens + 1):
        last = np.asarray(logits).reshape(-1, np.asarray(logits).shape[-1])[-1]
        history = history or History(sampling, prompt).start(last.size)
        adjusted = sampling.adjusted(last, history)
        if constraint is not None:
            adjusted = constraint.mask(adjusted)
        token = pick(adjusted, sampling, rng)
        if constraint is not None:
            constraint.accept(token)
        if scores is not None:
            scores(last, token)
        history.add(token, last.size)
        yield token
        if (token in sampling.stop or position >= context or made == sampling.max_tokens
                or (constraint is not None and constraint.done())):
            return  # (the last token never runs: nothing reads its logits)
        logits = step([token], position)
        position += 1
