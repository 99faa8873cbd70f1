"""Structured output: a generation held to a JSON schema, any JSON object, a regular
expression, a list of choices or a grammar, as OpenAI's `response_format` and vLLM's
`structured_outputs` (and its older `guided_*` fields) ask.

llguidance, the library behind vLLM's "guidance" backend, llama.cpp's and TensorRT-LLM's,
does the work: it compiles the request's schema, regex or grammar against the model's
tokenizer (`tokenizer.json` of its repository entry) and, before each token is picked,
gives the tokens that can continue a valid output; the others' logits are set to -inf
(`Constrained.mask`, in cuvild/run/generate.py's loop). The output ends where the grammar
does (a closed JSON object, a full match), or at an end-of-sequence token where the grammar
may end. JSON is laid out as json.dumps lays it out (JSON_LAYOUT; a schema's
"x-guidance" may free its whitespace, as vLLM's default does). A schema, regex or grammar
that does not compile is the request's error, with llguidance's words.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cuvild.core.layout import BadInput

KEPT = 16  # llguidance tokenizers kept (`Guides`)
KINDS = ("json", "json_object", "regex", "choice", "grammar")  # the option `structured`'s
# JSON laid out as Python's json.dumps writes it ({"a": 1, "b": [2, 3]}), the layout models
# see most; a schema's "x-guidance" may say otherwise ({"whitespace_flexible": true}: any
# whitespace between items, vLLM's default, where a model may emit spaces until max_tokens)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}  # vLLM's older fields


def from_openai(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The generation option `structured` ({kind: value}, one of KINDS) an OpenAI request
    asks by `response_format` ({"type": "text" | "json_object" | "json_schema"}), vLLM's
    `structured_outputs` or its `guided_json` / `guided_regex` / `guided_choice` /
    `guided_grammar`; None where none asks one."""
    asked = [k for k in ("response_format", "structured_outputs", *GUIDED)
             if doc.get(k) is not None]
    if len(asked) > 1:
        raise BadInput(f"{' and '.join(asked)}: one way of structuring the output at most")
    if not asked:
        return None
    key, given = asked[0], doc[asked[0]]
    if key in GUIDED:
        return {GUIDED[key]: given}
    if key == "structured_outputs":
        if not isinstance(given, dict) or len(given) != 1 or next(iter(given)) not in KINDS:
            raise BadInput(f"structured_outputs must be one of {{{', '.join(KINDS)}: ...}}, "
                           f"got {json.dumps(given)[:200]}")
        return dict(given)
    kind = given.get("type") if isinstance(given, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    schema = given.get("json_schema") if isinstance(given, dict) else None
    if kind == "json_schema" and isinstance(schema, dict) and "schema" in schema:
        return {"json": schema["schema"]}
    raise BadInput("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} "
                   "or {\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., "
                   f"\"schema\": {{...}}}}}}, got {json.dumps(given)[:200]}")


def grammar_of(structured: Any) -> str:
    """llguidance's grammar for the option `structured` (checked: BadInput where it is not
    one kind of KINDS with a value of that kind)."""
    import llguidance

    if isinstance(structured, str):  # (JSON's text: where parameters hold no maps)
        try:
            structured = json.loads(structured)
        except ValueError:
            pass
    if not isinstance(structured, dict) or len(structured) != 1:
        raise BadInput(f"structured must be one of {{{', '.join(KINDS)}: ...}}, got "
                       f"{json.dumps(structured)[:200]}")
    (kind, value), = structured.items()
    if kind == "json_object":
        kind, value = "json", {"type": "object"}
    wanted = {"json": (dict, str), "regex": (str,), "choice": (list,), "grammar": (str,)}
    if kind not in wanted or not isinstance(value, wanted[kind]) or (
            kind == "choice" and not all(isinstance(c, str) for c in value)):
        raise BadInput(f"structured {kind!r}: a JSON schema (json), a regular expression "
                       "(regex), a list of strings (choice) or a Lark or GBNF grammar "
                       f"(grammar), got {json.dumps(value)[:200]}")
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise BadInput(f"structured json: the schema is not JSON ({e})") from None
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_LAYOUT)
        return llguidance.grammar_from(kind, value)
    except (ValueError, TypeError) as e:
        raise BadInput(f"structured {kind}: {str(e)[:300]}") from None


class Guides:
    """llguidance's tokenizers, one per `tokenizer.json` (made again when it changes: ~2 ms
    for a vocabulary of 100 tokens, more for a real one's), for the requests' grammars."""

    def __init__(self) -> None:
        self._kept: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def constrained(self, path: Path, structured: Any, vocab: int,
                    eos: Sequence[int]) -> Constrained:
        """A generation's `Constrained` for the option `structured`, by the tokenizer at
        `path` for a model of `vocab` logits (tokens the file has not: never allowed),
        ending at `eos` (llguidance's own guess where empty)."""
        import llguidance

        grammar = grammar_of(structured)
        key = (path, path.stat().st_mtime, vocab, tuple(eos))
        with self._lock:
            kept = self._kept.get(key)
        if kept is None:
            try:
                kept = llguidance.LLTokenizer(str(path), n_vocab=vocab,
                                              eos_token=list(eos) or None)
            except (ValueError, RuntimeError) as e:
                raise BadInput(f"structured output: llguidance does not read {path.name} "
                               f"({str(e)[:200]})") from None
            with self._lock:
                self._kept[key] = kept
                while len(self._kept) > KEPT:  # (one more each time a tokenizer changes)
                    self._kept.pop(next(iter(self._kept)))
        return Constrained(kept, grammar)


class Constrained:
    """One generation's grammar: the tokens that may come next (`mask`), each picked one
    taken in (`accept`), and whether the output is complete (`done`)."""

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        import llguidance

        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise BadInput(f"structured output: {self.matcher.get_error()[:300]}")
        self.vocab = tokenizer.vocab_size
        self._bits = np.zeros((self.vocab + 31) // 32, np.int32)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` with every token that cannot continue a valid output at -inf."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:logits.size]
        out = np.array(logits, dtype=np.float64)
        out[:allowed.size][allowed == 0] = -np.inf
        out[allowed.size:] = -np.inf
        return out

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)
        self._check()

    def done(self) -> bool:
        return bool(self.matcher.is_stopped())

    def _check(self) -> None:
        if self.matcher.is_error():
            raise RuntimeError(f"structured output: {self.matcher.get_error()[:300]}")
