"""Generation for the listeners: a prompt in, tokens out as they come, on a sequence of its
own (cuvild/run/sequences.py, cuvild/run/generate.py).

`Generator.open` checks the request once (the model is served and generative, the prompt is
token ids or text and the model has a tokenizer, the sampling options are sane) and
`Generation.tokens` yields each token (its id and, with a tokenizer, the text it adds) until
max_tokens, a stop token, its grammar's end (cuvild/serve/structured.py) or the context's
end. Its sequence may start as a kept one that holds the prompt's first tokens, and is kept
when the generation ends without a failed step, finished or its caller gone
(cuvild/run/prefixes.py); else it ends with the generator.

A tokenizer is the model repository entry's `tokenizer.json` (`<repository>/<name>/<version>/`
or `<repository>/<name>/`), read with the `tokenizers` library: JSON, never code from the
repository; a link out of the repository or a file over MAX_TOKENIZER_BYTES is refused. The
entry's end-of-sequence tokens (`generation_config.json`'s `eos_token_id`, an id or a list,
and `tokenizer_config.json`'s `eos_token`) end every generation, as vLLM's and OpenAI's do,
unless it asks `ignore_eos`.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cuvild.core.layout import BadInput
from cuvild.core.loaded import LoadedModel
from cuvild.load.buckets import last_logits, step_lengths
from cuvild.load.models import ModelManager
from cuvild.run.generate import CHUNKS, INPUTS, Sampling, generate, logprobs, served_step
from cuvild.run.runner import Runner
from cuvild.run.sequences import Live
from cuvild.serve import chat, reasoning
from cuvild.serve import structured as structured_output
from cuvild.serve.detokenize import continued, release
from cuvild.serve.errors import Refused, find, status

TOKENIZER = "tokenizer.json"
GENERATION_CONFIG = "generation_config.json"  # transformers' (its eos_token_id)
MAX_TOKENIZER_BYTES = 64 << 20
REMEMBERED = 64  # entries of each of the Generator's caches (`_remember`)
OPTIONS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "frequency_penalty",
           "presence_penalty", "logit_bias", "ignore_eos", "structured", "repetition_penalty",
           "min_p", "min_tokens")


@dataclass
class Generation:
    """One checked request: run it with `tokens`."""

    runner: Runner
    model: LoadedModel
    name: str
    version: str
    prompt: list[int]
    sampling: Sampling
    tokenizer: Any = None
    chunks: tuple[int, ...] = (1,)  # the lengths a step takes (cuvild/run/generate.py)
    stop_text: tuple[str, ...] = ()  # strings that end it (not sent)
    ids: list[int] = field(default_factory=list)  # generated so far
    stopped: bool = False  # ended by a stop token or string
    metrics: Any = None  # cuvild.serve.metrics.Metrics: its tokens' times and its end
    # OpenAI's logprobs (None: not asked): each generated token's log-probability and the
    # `top_logprobs` likeliest tokens' (id, log-probability), in `scored` beside `ids`
    top_logprobs: int | None = None
    scored: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # and (OpenAI's `echo` with logprobs) each prompt token's after its first, in
    # `prompt_scored`: the prompt's chunks then run on the model itself, every position's
    # logits computed, not on its twin that computes the last one's alone
    score_prompt: bool = False
    prompt_scored: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # n choices of one prompt (`share`): the first runs the prompt and hands each other a
    # sequence of its own holding a copy of the state it left, and the prompt's last logits
    followers: list[Generation] = field(default_factory=list)
    handed: threading.Event | None = None  # (a follower's: set once it was handed its start)
    start: tuple[Live, Any] | None = None
    failed: BaseException | None = None  # (why none was handed: the first one's error)
    abandoned: bool = False  # (a follower its caller will not run: `abandon`)
    cached: int = 0  # the prompt's first tokens a kept sequence held (cuvild/run/prefixes.py)
    constraint: Any = None  # the grammar its output is held to (cuvild/serve/structured.py)
    thinking: bool | None = None  # a reasoning model's chat: whether its prompt opened it
    _started: bool = False
    _text: str = ""
    _sent: int = 0  # how much of _text was given out

    def tokens(self) -> Iterator[tuple[int, str]]:
        """(token id, the text it adds: "" without a tokenizer), one at a time."""
        model, runner = self.model, self.runner
        assert model.state is not None
        self._started = True
        try:
            live, given = self._begin()
        except BaseException as e:
            self._hand_over(None, e)  # (its followers told why none starts)
            raise
        # a prompt's chunks on the model's twin that computes the last position's logits
        # alone (cuvild/load/buckets.py last_logits), or where the prompt is scored on the
        # model itself; decode steps (one position) on its own
        whole = model.family is None or self.scores_prompt
        step = served_step(runner, model, model if whole else last_logits(model), live)
        top = self.top_logprobs
        scores = None if top is None else (
            lambda logits, token: self.scored.append(logprobs(logits, token, top)))
        prompt_scores = self._score_prompt if self.scores_prompt else None
        t0, last, code = time.perf_counter(), None, "CANCELLED"  # (its caller left)
        failed = False
        try:
            for token in self._released(generate(
                    step, self.prompt, self.sampling, model.state.context, self.chunks, scores,
                    prompt_scores, start=given, held=self.cached, constraint=self.constraint,
                    prefilled=(
                        lambda logits: self._hand_over(live, logits)) if self.followers
                    else None)):
                if self.metrics is not None:  # (before the caller takes it)
                    now = time.perf_counter()
                    self.metrics.token(self.name, self.version, now - (last or t0),
                                       first=last is None)
                    last = now
                yield token
            code = None
        except Exception as e:
            code, failed = status(e).name, True
            self._hand_over(None, e)  # (where the prompt did not run to its end)
            raise
        finally:
            self._hand_over(None, RuntimeError("the first of its n choices ended first"))
            self._end(live, not failed)
            if self.metrics is not None and self.handed is None:  # (n choices: one request)
                self.metrics.generation(self.name, self.version, len(self.prompt),
                                        time.perf_counter() - t0, code, self.cached)

    @property
    def scores_prompt(self) -> bool:
        """Whether every prompt position's logits are scored (echo with logprobs)."""
        return self.score_prompt and self.top_logprobs is not None

    def _end(self, live: Live, whole: bool) -> None:
        """The generation ended: its sequence kept for a later prompt that begins with the
        tokens its state holds (the prompt and each token but the last: `generate`), where
        it ended `whole` (no step failed), else ended."""
        held = [*self.prompt, *self.ids[:-1]]
        if not (whole and self.ids and self.runner.prefixes.keep(self.model, live, held)):
            self.runner.sequences.end(live, "ended (its generation ended)")

    def _begin(self) -> tuple[Live, Any]:
        """The sequence this generation runs on, and the prompt's last logits where another
        ran the prompt (a follower: the sequence is a copy of the state that one left)."""
        if self.handed is None:
            model, runner = self.model, self.runner

            def begin() -> Live:
                return runner.sequences.begin(model.key, f"generate-{next(_ids)}",
                                              sorted(model.parts_by_device))

            hit = None if self.scores_prompt else runner.prefixes.take(model, self.prompt, begin)
            if hit is None:
                return begin(), None
            live, self.cached = hit
            log.debug("model %s: %d of a prompt's %d tokens held by a kept sequence",
                      model.key, self.cached, len(self.prompt))
            return live, None
        if not self.handed.wait(FOLLOW_S):
            raise RuntimeError(f"its prompt did not run in {FOLLOW_S:g} s (the first of its "
                               "n choices runs it for all)")
        if self.start is None:  # (the first one's error itself: its status, its words)
            raise self.failed or RuntimeError("its prompt did not run")
        return self.start

    def _hand_over(self, live: Live | None, logits: Any) -> None:
        """Give each follower a sequence of its own holding a copy of `live`'s state (the
        prompt ran on it) and the prompt's last logits; with `live` None, tell those not
        handed one yet that none comes, and why (`logits` is then the error)."""
        model, runner = self.model, self.runner
        for follower in self.followers:
            if follower.handed is None or follower.handed.is_set():
                continue
            if live is None or follower.abandoned:
                follower.failed = logits if isinstance(logits, Exception) else RuntimeError(
                    "its caller went" if follower.abandoned
                    else f"the first of its n choices ended ({type(logits).__name__})")
                follower.handed.set()
                continue
            try:
                own = runner.sequences.begin(model.key, f"generate-{next(_ids)}",
                                             sorted(model.parts_by_device))
                try:
                    runner.copy_sequence(live, own)
                except BaseException:
                    runner.sequences.end(own, "ended (its state did not copy)")
                    raise
                follower.start = (own, logits)
            except Exception as e:  # noqa: BLE001 - the follower raises it
                follower.failed = e
            follower.handed.set()
        if live is not None:
            log.debug("model %s: a prompt of %d tokens ran once for %d choices (its state "
                      "copied for the others)", model.key, len(self.prompt),
                      len(self.followers) + 1)

    def abandon(self) -> None:
        """A generation its caller will not run (the request went before its turn): a
        follower's handed sequence ends now, not after the idle timeout; one not handed yet
        is handed none (`_hand_over`)."""
        self.abandoned = True
        if self.start is not None and not self._started:
            self.runner.sequences.end(self.start[0], "ended (its choice was not run)")

    def _score_prompt(self, rows: Any, at: int) -> None:
        """The prompt tokens' logprobs from a chunk's logits (`rows`, from position `at`):
        a position's logits score the token after it."""
        assert self.top_logprobs is not None
        for j, row in enumerate(rows):
            if at + j + 1 < len(self.prompt):
                self.prompt_scored.append(logprobs(row, self.prompt[at + j + 1],
                                                   self.top_logprobs))

    def _released(self, tokens: Iterator[int]) -> Iterator[tuple[int, str]]:
        """Each token with the text it lets go: text that may begin a stop string is held
        until a later token shows it does not (a stop string's start is never sent), the
        token that held it sent then; what is held when the generation ends goes with its
        last token."""
        held: tuple[int, str] | None = None
        for token in tokens:
            self.ids.append(token)
            self.stopped = token in self.sampling.stop or (
                self.constraint is not None and self.constraint.done())
            if self.tokenizer is not None:  # the whole output decoded: a token may complete
                # a character another began
                self._text = self.decoded(self.ids)
            piece, self._sent, hit = release(self._text, self._sent, self.stop_text)
            if held is not None:
                yield held
                held = None
            if hit:  # a stop string: the text up to it, and the end
                self._text, self.stopped = self._text[:self._sent], True
                yield token, piece
                return
            if self._sent < len(self._text):
                held = (token, piece)
            else:
                yield token, piece
        if held is not None:
            yield held[0], held[1] + self._text[self._sent:]
            self._sent = len(self._text)

    def decoded(self, ids: list[int]) -> str:
        """The text `ids` add after the prompt (`continued`)."""
        return continued(self.tokenizer, self.prompt, ids)

    @property
    def text(self) -> str:
        return self._text


log = logging.getLogger(__name__)
_ids = itertools.count(1)
FOLLOW_S = 600.0  # how long a follower waits for its prompt to run (`share`)


def share(gens: Sequence[Generation]) -> None:
    """n choices of one prompt: the first runs it, the others start from a copy of the state
    it left (`Generation.followers`), as vLLM's prefix cache shares it; each then samples on
    its own. Not for one that scores its prompt (echo: each scores it as it runs)."""
    if len(gens) < 2 or any(g.score_prompt for g in gens):
        return
    first, *rest = gens
    first.followers = list(rest)
    for follower in rest:
        follower.handed = threading.Event()


class Generator:
    def __init__(self, models: ModelManager, runner: Runner,
                 repository: str | Path | None = None) -> None:
        self.models, self.runner = models, runner
        self.repository = Path(repository).resolve() if repository else None
        self._tokenizers: dict[Path, tuple[float, Any]] = {}
        self._chats: dict[Any, chat.Chat | None] = {}
        self._eos: dict[Any, list[int]] = {}  # (by the files' mtimes, as the templates)
        self._guides = structured_output.Guides()
        self._lock = threading.Lock()
        self.metrics: Any = None  # cuvild.serve.metrics.Metrics, when metrics.enabled

    def open(self, name: str, version: str = "", prompt: Any = None, text: str | None = None,
             options: Mapping[str, Any] | None = None,
             messages: Any = None, tools: list[Any] | None = None,
             chat_options: Mapping[str, Any] | None = None) -> Generation:
        """A checked generation: `prompt` token ids, `text` or a chat's `messages` (OpenAI's)
        with the model's tokenizer (and chat template); `options`: max_tokens, temperature,
        top_k, top_p, seed, stop (token ids, or strings with a tokenizer), frequency_penalty,
        presence_penalty, logit_bias ({token id: bias}), ignore_eos (vLLM's: the answer does
        not end at the entry's eos tokens, `eos`), structured (cuvild/serve/structured.py);
        `tools`: a chat's (OpenAI's function tools), given to its template, and
        `chat_options` its render's (chat.options_of: vLLM's chat_template_kwargs...). One refused
        counts as a failed request (under model "" where no such model is served)."""
        try:
            gen = self._open(name, version, prompt, text, options, messages, tools,
                             chat_options)
        except Exception as e:
            if self.metrics is not None:
                known = self.models.get(name, version) is not None
                self.metrics.failed(name if known else "", version if known else "",
                                    status(e).name)
            raise
        gen.metrics = self.metrics
        return gen

    def _open(self, name: str, version: str, prompt: Any, text: str | None,
              options: Mapping[str, Any] | None, messages: Any,
              tools: Any = None, chat_options: Any = None) -> Generation:
        served = find(self.models, name, version)
        model = served.loaded
        assert model is not None
        if not generates(model):
            raise Refused("invalid", f"model {served.key} does not generate: generation needs "
                          "a causal language model exported with its cache, inputs "
                          f"{' and '.join(INPUTS)} (transformers' "
                          "TorchExportableModuleForDecoderOnlyLM); docs/GENERATION.md")
        tokenizer = self.tokenizer(served.record.name, served.record.version)
        options, stop_text = split_stops(options or {})
        eos = self.eos(served.record.name, served.record.version, tokenizer)
        options["stop"] = [*options.get("stop", ()), *([] if _flag(options, "ignore_eos")
                                                        else eos)]
        if stop_text and tokenizer is None:
            raise Refused("invalid", f"model {served.key} has no tokenizer: stop strings need "
                          "one (stop token ids do not)")
        special, thinks = True, None
        if messages is not None:
            text, thinks = self._chat(served, messages, tokenizer, tools, chat_options)
            special = False  # (the template writes them)
        if text is not None:
            if tokenizer is None:
                raise Refused("invalid", f"model {served.key} has no tokenizer ({TOKENIZER} "
                              "in its model repository entry): send token ids")
            if not isinstance(text, str):
                raise BadInput(f"the prompt text must be a string, got {type(text).__name__}")
            prompt = tokenizer.encode(text, add_special_tokens=special).ids
        if (not isinstance(prompt, (list, tuple)) or not prompt
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            raise BadInput("the prompt must be a non-empty list of token ids (integers), or "
                           "text for a model with a tokenizer")
        vocab = int(served.record.outputs[0]["shape"][-1])
        constraint = self._constraint(served, options.pop("structured", None), vocab, eos)
        chosen = _sampling_for(options, prompt, vocab,
                               model.state.context if messages is not None else None)
        if thinks and constraint is not None:
            thinks = False  # (a grammar holds the answer from its start: read as written)
        return Generation(self.runner, model, served.record.name, served.record.version,
                          list(prompt), chosen, tokenizer,
                          chunks_of(model, served.key, self.runner.max_dim), stop_text,
                          constraint=constraint, thinking=thinks)

    def _constraint(self, served: Any, structured: Any, vocab: int,
                    eos: list[int]) -> structured_output.Constrained | None:
        """The grammar a request's output is held to (`structured`: cuvild/serve/
        structured.py), by the entry's tokenizer; None where none is asked."""
        if structured is None:
            return None
        path = self.entry_file(served.record.name, served.record.version, TOKENIZER,
                                MAX_TOKENIZER_BYTES)
        if path is None:
            raise Refused("invalid", f"model {served.key} has no tokenizer ({TOKENIZER} in its "
                          "model repository entry): structured output needs one")
        return self._guides.constrained(path, structured, vocab, eos)

    def _chat(self, served: Any, messages: Any, tokenizer: Any, tools: Any = None,
              chat_options: Any = None) -> tuple[str, bool | None]:
        """A chat's prompt text, by the entry's chat template (its eos token ends the answer,
        as every generation's: `eos`), and for a reasoning model's whether it opened the
        thinking (None: not a reasoning model: cuvild/serve/reasoning.py)."""
        checked = chat.messages_of(messages)
        template = self.chat_template(served.record.name, served.record.version)
        if tokenizer is None or template is None:
            raise Refused("invalid", f"model {served.key} has no chat template "
                          f"({chat.TEMPLATE_FILE}, or chat_template in {chat.CONFIG_FILE}, "
                          f"beside {TOKENIZER} in its model repository entry): send a "
                          "prompt instead of messages (/v1/completions over HTTP, "
                          "`cuvilctl generate` without --chat)")
        text = template.render(checked, tools, **(chat_options or {}))
        return text, reasoning.opened(text) if template.thinks else None

    def eos(self, name: str, version: str, tokenizer: Any) -> list[int]:
        """The entry's end-of-sequence ids, which end a generation (vLLM stops at them too):
        `generation_config.json`'s eos_token_id (an id or a list) and, with a tokenizer,
        `tokenizer_config.json`'s eos_token; none where it has neither. Read again only when
        a file changes (not on every request)."""
        files = {f: self.entry_file(name, version, f, chat.MAX_TEMPLATE_BYTES)
                 for f in (GENERATION_CONFIG, chat.CONFIG_FILE)}
        key = (tuple((p, p.stat().st_mtime) if p else None for p in files.values()),
               id(tokenizer))
        with self._lock:
            kept = self._eos.get(key)
        if kept is None:
            kept = _eos_of(name, files, tokenizer)
            with self._lock:
                _remember(self._eos, key, kept)
        return kept

    def chat_template(self, name: str, version: str) -> chat.Chat | None:
        """The entry's chat template (read again when its files change), None without one."""
        files = [self.entry_file(name, version, f, chat.MAX_TEMPLATE_BYTES)
                 for f in (chat.TEMPLATE_FILE, chat.CONFIG_FILE)]
        if not any(files):
            return None
        key = tuple((f, f.stat().st_mtime) if f else None for f in files)
        with self._lock:
            kept = self._chats.get(key)
        if kept is None:
            try:
                kept = chat.load(*(f.read_text() if f else None for f in files))
            except Exception as e:  # noqa: BLE001 - a bad file is the request's error
                raise Refused("invalid", f"model {name}: its chat template does not read "
                              f"({str(e)[:200]})") from None
            with self._lock:
                _remember(self._chats, key, kept)
        return kept

    def entry_file(self, name: str, version: str, file: str, most: int) -> Path | None:
        """The entry's `file` (its version's folder first), resolved; None without one. A
        link out of the repository or a file over `most` bytes is refused."""
        if self.repository is None:
            return None
        for where in (self.repository / name / version / file, self.repository / name / file):
            if not where.is_file():
                continue
            real = where.resolve()
            if not real.is_relative_to(self.repository):
                raise Refused("invalid", f"{where}: a link out of the model repository")
            size = real.stat().st_size
            if size > most:
                raise Refused("invalid", f"{where}: {size} bytes, over {most}")
            return real
        return None

    def tokenizer(self, name: str, version: str) -> Any:
        """The entry's tokenizer (read again when its file changes), None without one."""
        real = self.entry_file(name, version, TOKENIZER, MAX_TOKENIZER_BYTES)
        if real is None:
            return None
        mtime = real.stat().st_mtime
        with self._lock:
            kept = self._tokenizers.get(real)
            if kept is None or kept[0] != mtime:
                from tokenizers import Tokenizer

                try:
                    kept = (mtime, Tokenizer.from_str(real.read_text()))
                except Exception as e:  # noqa: BLE001 - a bad file is the request's error
                    raise Refused("invalid", f"{real}: not a tokenizer the tokenizers "
                                  f"library reads ({str(e)[:200]})") from None
                self._tokenizers[real] = kept
        return kept[1]


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    """Keep `value` under `key`, the oldest out past REMEMBERED (a cache keyed by files'
    mtimes gains one each time a file changes)."""
    cache[key] = value
    while len(cache) > REMEMBERED:
        cache.pop(next(iter(cache)))



def generates(model: LoadedModel | None) -> bool:
    """Whether a loaded model generates: a causal LM exported with its cache (INPUTS)."""
    return (model is not None and model.state is not None
            and sorted(model.inputs) == sorted(INPUTS))


def chunks_of(model: LoadedModel, key: str, max_dim: int) -> tuple[int, ...]:
    """The step lengths a model takes (cuvild/load/buckets.py `step_lengths`), which must
    include 1 (a decode step takes one token)."""
    sizes = step_lengths(model, max_dim)
    if 1 not in sizes:
        raise Refused("invalid", f"model {key} cannot take one token a step ({INPUTS[0]} "
                      f"lengths {sizes or 'none of'} {CHUNKS}): export it with a length of 1, "
                      "or a dynamic one from 1")
    return sizes



def split_stops(options: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The options with `stop` as token ids, and the stop strings apart (OpenAI's `stop`: a
    string or a list of up to 4)."""
    out = dict(options)
    stop = out.get("stop", ())
    stop = [stop] if isinstance(stop, (str, int)) and not isinstance(stop, bool) else stop
    if not isinstance(stop, (list, tuple)):
        raise BadInput(f"stop must be token ids or strings, got {stop!r}")
    strings = tuple(s for s in stop if isinstance(s, str))
    if any(not s for s in strings) or len(strings) > 4:
        raise BadInput("stop strings: at most 4, none empty")
    out["stop"] = [s for s in stop if not isinstance(s, str)]
    return out, strings


def sampling(options: Mapping[str, Any]) -> Sampling:
    """The sampling options of a request (unknown ones refused, each checked)."""
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise BadInput(f"unknown generation options {sorted(unknown)}; known: {list(OPTIONS)}")
    stop = options.get("stop", ())
    if isinstance(stop, int) and not isinstance(stop, bool):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise BadInput(f"stop must be token ids, got {stop!r}")
    return Sampling(max_tokens=options.get("max_tokens", 16),
                    temperature=options.get("temperature", 0.0),
                    top_k=options.get("top_k", 0), top_p=options.get("top_p", 1.0),
                    seed=options.get("seed"), stop=tuple(stop),
                    frequency_penalty=options.get("frequency_penalty", 0.0),
                    presence_penalty=options.get("presence_penalty", 0.0),
                    logit_bias=_bias(options.get("logit_bias")),
                    repetition_penalty=options.get("repetition_penalty", 1.0),
                    min_p=options.get("min_p", 0.0),
                    min_tokens=options.get("min_tokens", 0)).check()


def _flag(options: dict[str, Any], name: str) -> bool:
    """A true-or-false option taken out of `options` (False where not given)."""
    value = options.pop(name, False)
    if not isinstance(value, bool):
        raise BadInput(f"{name} must be true or false, got {value!r}")
    return value


def _eos_of(name: str, files: dict[str, Path | None], tokenizer: Any) -> list[int]:
    """`Generator.eos` read from the entry's files (file name -> its path, None: none)."""
    ids: list[int] = []
    for file, found in files.items():
        try:
            doc = json.loads(found.read_text()) if found else {}
        except (OSError, ValueError) as e:
            raise Refused("invalid", f"model {name}: its {file} does not read "
                          f"({str(e)[:200]})") from None
        given = doc.get("eos_token_id" if file == GENERATION_CONFIG else "eos_token") \
            if isinstance(doc, dict) else None
        if isinstance(given, dict):  # (an AddedToken)
            given = given.get("content")
        if isinstance(given, str):
            given = tokenizer.token_to_id(given) if tokenizer is not None else None
        ids += [i for i in (given if isinstance(given, list) else [given])
                if isinstance(i, int) and not isinstance(i, bool)]
    return sorted(set(ids))


def _sampling_for(options: dict[str, Any], prompt: list[int], vocab: int,
                  chat_context: int | None) -> Sampling:
    """`sampling(options)` for `prompt`, its ids and the bias's within `vocab`; a chat's
    (`chat_context`: its model's context) answer unbounded by its caller runs to its end or
    the context's, as OpenAI's and vLLM's do (a completion's default is 16, as theirs)."""
    if any(not 0 <= t < vocab for t in prompt):
        raise BadInput(f"a prompt token id is outside the vocabulary [0, {vocab})")
    if chat_context is not None and options.get("max_tokens") is None:
        options["max_tokens"] = max(chat_context - len(prompt), 1)
    chosen = sampling(options)
    if any(t >= vocab for t in chosen.logit_bias):
        raise BadInput(f"a logit_bias token id is outside the vocabulary [0, {vocab})")
    return chosen


def _bias(given: Any) -> dict[int, float]:
    """OpenAI's logit_bias: {token id: bias}, its ids JSON's strings ("50256") or integers;
    a JSON object's text too (Triton's stream parameters hold no maps)."""
    if given is None:
        return {}
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except ValueError:
            given = None
    if not isinstance(given, dict):
        raise BadInput("logit_bias must be a map of token ids to numbers in [-100, 100], e.g. "
                       "{\"50256\": -100}")
    out = {}
    for key, bias in given.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        out[token] = bias
    return out
