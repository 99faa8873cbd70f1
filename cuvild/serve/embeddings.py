"""OpenAI's `/v1/embeddings` for a served encoder (a BERT-like model: sentence-transformers'
models, BGE, E5, ...), as vLLM's and OpenAI's APIs answer it (first version):

    POST /v1/embeddings {"model", "input": text | [texts] | [ids] | [[ids]],
                         "encoding_format": "float" | "base64"}
    -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
        "usage": {"prompt_tokens", "total_tokens"}}

The model is any served one whose inputs are `input_ids` and any of `attention_mask` and
`token_type_ids` (its length dynamic, padded to the next of 8, 12, 16, 24, 32, 48, ... so
that inputs share built buckets, or fixed: padded to it, the padding masked; its batch
dynamic: a request's inputs of one padded length run together, or one), with a float output
of [batch, length,
hidden] (`last_hidden_state`, or the first such): exported as `transformers.AutoModel` is.
Texts are tokenized by the entry's `tokenizer.json` (special tokens added, as
sentence-transformers does). Pooled as
the entry's sentence-transformers files say (`1_Pooling/config.json`: the mean of the
attended tokens, the first (CLS) or the last; `modules.json`: a `Normalize` module, unit
length), and without them the mean of the attended tokens, normalized. An input longer than
the model takes (its export's bound, engine.max_dim) is refused naming it, unless vLLM's
`truncate_prompt_tokens` asks it cut (-1: to that bound; k: to k tokens; its end cut before the
special tokens are added, as transformers' tokenizers truncate). `dimensions` (a
shorter vector) as vLLM takes it: only for a Matryoshka model (the entry's `config.json` says
`is_matryoshka` or lists `matryoshka_dimensions`: one of them, else 1 to its size), the
pooled vector cut to it before it is normalized; any other model refuses it. vLLM's
`normalize` (or `use_activation`, its newer name) false sends the pooled vector as it is,
true normalizes it whatever the entry says. Concurrent
requests' inputs of one padded length share runs through the model's batcher (engine.batching,
on by default: cuvild/run/batching.py), a request's own inputs run together. A request counts
in the model's metrics as an inference request, its inputs its batch.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cuvild.core.layout import BadInput
from cuvild.serve.errors import Refused, find, status
from cuvild.serve.generation import Generator
from cuvild.serve.openai_request import named
from protos.orders import RawTensor

FIELDS = {"model", "input", "encoding_format", "user", "dimensions", "truncate_prompt_tokens",
          "normalize", "use_activation"}
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
MAX_INPUTS = 2048  # OpenAI's bound on a request's inputs
POOLING_FILE = "1_Pooling/config.json"
CONFIG_FILE = "config.json"  # transformers' config of the model: its Matryoshka sizes
MODULES_FILE = "modules.json"
MAX_FILE_BYTES = 1 << 20


def embed(generator: Generator, doc: Any) -> dict[str, Any]:
    """/v1/embeddings' answer to a request `doc` (on a pool thread: it runs the model); a
    request of the model's in its metrics, as an inference request (its inputs its batch)."""
    name, version = named(doc, FIELDS)
    served = find(generator.models, name, version)
    data, used = counted(generator, served, lambda: embedded(generator, served, doc))
    return {"object": "list", "data": data, "model": doc["model"],
            "usage": {"prompt_tokens": used, "total_tokens": used}}


def counted(generator: Generator, served: Any, answer: Callable[[], tuple[list[Any], int]]
            ) -> tuple[list[Any], int]:
    """`answer()` (a request's items and the tokens they took) counted in the model's
    metrics as an inference request, its items its batch, or as a failed one."""
    t0 = time.perf_counter()
    try:
        items, used = answer()
    except Exception as e:
        if generator.metrics is not None:
            generator.metrics.failed(served.record.name, served.record.version,
                                     status(e).name, time.perf_counter() - t0)
        raise
    if generator.metrics is not None:
        generator.metrics.succeeded(served.record.name, served.record.version,
                                    time.perf_counter() - t0, len(items))
    return items, used


def embedded(generator: Generator, served: Any,
             doc: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """Each input's embedding object, and the tokens they took."""
    form = doc.get("encoding_format") or "float"
    if form not in ("float", "base64"):
        raise BadInput(f"encoding_format must be \"float\" or \"base64\", got {form!r}")
    inputs_of(served)  # (a model that is not an encoder is refused first, naming why)
    size = _dimensions(generator, served, doc.get("dimensions"))
    tokenizer = generator.tokenizer(served.record.name, served.record.version)
    most = truncation(generator, served, doc)
    found, used = vectors(generator, served, token_ids(doc.get("input"), tokenizer, most),
                          size, switch(doc, ("normalize", "use_activation")))
    return [{"object": "embedding", "index": i, "embedding": (
        v.tolist() if form == "float" else base64.b64encode(v.tobytes()).decode())}
        for i, v in enumerate(found)], used


def vectors(generator: Generator, served: Any, given: list[list[int]],
            size: int | None = None, normalize: bool | None = None,
            ) -> tuple[list[np.ndarray], int]:
    """Each input's embedding (pooled and normalized as the entry says, or as `normalize`
    says where given; cut to `size` first where given), and the tokens they took."""
    names, length = inputs_of(served)
    pooling, entry_normalizes = _pooling(generator, served)
    normalize = entry_normalizes if normalize is None else normalize
    hidden = output_of(served, 3, "embed")
    outputs = rows(generator, served, names, [(ids, []) for ids in given], length)
    found = []
    for i, ids in enumerate(given):
        vector = _pooled(outputs[i][hidden][:len(ids)], pooling)
        if size is not None:
            if size > len(vector):
                raise BadInput(f"dimensions: {size} is over the model's {len(vector)}")
            vector = vector[:size]
        if normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        found.append(vector.astype(np.float32))
    return found, sum(len(ids) for ids in given)


def switch(doc: dict[str, Any], names: tuple[str, ...]) -> bool | None:
    """A request's on/off option, under any of vLLM's `names` for it (`normalize` and the
    `use_activation` that replaces it); None where none is given."""
    given = {n: doc[n] for n in names if doc.get(n) is not None}
    for name, value in given.items():
        if not isinstance(value, bool):
            raise BadInput(f"{name} must be true or false, got {value!r}")
    if len(set(given.values())) > 1:
        raise BadInput(f"{' and '.join(given)} disagree")
    return next(iter(given.values()), None)


def _dimensions(generator: Generator, served: Any, wanted: Any) -> int | None:
    """The size a request's `dimensions` asks for (None: the model's own), where the model
    is a Matryoshka one (its config.json: `matryoshka_dimensions`, one of which it must be,
    or `is_matryoshka`), as vLLM checks it: other models refuse it (a vector cut short by a
    model not trained for it searches badly)."""
    if wanted is None:
        return None
    if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
        raise BadInput(f"dimensions must be a positive integer, got {wanted!r}")
    config = json_file(generator, served, CONFIG_FILE)
    config = config if isinstance(config, dict) else {}
    sizes = config.get("matryoshka_dimensions")
    if not sizes and config.get("is_matryoshka") is not True:
        raise BadInput(f"model {served.key} does not support Matryoshka embeddings (no "
                       f"is_matryoshka or matryoshka_dimensions in its {CONFIG_FILE}): "
                       f"dimensions must be left out (got {wanted})")
    if isinstance(sizes, list) and sizes and wanted not in sizes:
        raise BadInput(f"model {served.key} only supports Matryoshka dimensions {sizes}, "
                       f"got {wanted}")
    return wanted


def embeds(generator: Generator, served: Any) -> int | None:
    """The most tokens a served model takes where it embeds, reranks or classifies (an
    encoder's inputs and a [batch, length, hidden] or [batch, labels] float output):
    /v1/models' `max_model_len`; None where not."""
    specs = served.record.outputs or []
    if not any(len(s["shape"]) in (2, 3) and "float" in s["dtype"] for s in specs):
        return None
    try:
        names, length = inputs_of(served)
    except Refused:
        return None
    return bounds(generator, served, names, length)[1]


def inputs_of(served: Any, verb: str = "embed") -> tuple[list[str], int | None]:
    """The model's input names (token inputs only) and its fixed length (None: dynamic);
    a model that is not an encoder is refused as one that does not `verb`."""
    specs = served.record.inputs
    names = [s["name"] for s in specs]
    if "input_ids" not in names or set(names) - set(TOKEN_INPUTS):
        raise Refused("invalid", f"model {served.key} does not {verb}: its inputs are {names}; "
                      f"an encoder's are input_ids and any of {list(TOKEN_INPUTS[1:])}")
    shape = specs[names.index("input_ids")]["shape"]
    if len(shape) != 2 or shape[0] not in (1, -1):
        raise Refused("invalid", f"model {served.key}: input_ids is {shape}, not [1 or a "
                      "dynamic batch, length]")
    return names, (shape[1] if shape[1] > 0 else None)


def truncation(generator: Generator, served: Any, doc: dict[str, Any]) -> int | None:
    """The most tokens a request's `truncate_prompt_tokens` (vLLM's) cuts each input to: -1
    the most the model takes, k at most k; None where not given (an input over the model's
    bound is refused)."""
    asked = doc.get("truncate_prompt_tokens")
    if asked is None:
        return None
    high = bounds(generator, served)[1]
    if isinstance(asked, bool) or not isinstance(asked, int) or asked == 0 or asked < -1:
        raise BadInput(f"truncate_prompt_tokens must be -1 (the model's {high}) or a "
                       f"positive integer, got {asked!r}")
    if asked > high:
        raise BadInput(f"truncate_prompt_tokens {asked} is over the {high} tokens the model "
                       "takes")
    return high if asked == -1 else asked


def encoded(tokenizer: Any, text: str, pair: str | None = None, most: int | None = None) -> Any:
    """`text` (and `pair`) tokenized as the model takes it, special tokens added; with
    `most`, cut to at most `most` tokens as transformers' tokenizers truncate (the end of the
    longer of a pair first), before the special tokens are added."""
    if most is None:
        return tokenizer.encode(text, pair)
    first = tokenizer.encode(text, add_special_tokens=False)
    second = tokenizer.encode(pair, add_special_tokens=False) if pair is not None else None
    room = most - tokenizer.num_special_tokens_to_add(pair is not None)
    if room < 1 + (pair is not None):
        raise BadInput(f"truncate_prompt_tokens {most} leaves no room for the text beside "
                       "the special tokens")
    if second is None:
        first.truncate(room)
    elif len(first.ids) + len(second.ids) > room:
        # (the tokenizers library's longest_first, which transformers' fast tokenizers run:
        # the shorter kept whole where it leaves the longer as much, else both halved)
        short, long_ = sorted((len(first.ids), len(second.ids)))
        long_ = min(long_, short if short > room else max(short, room - short))
        if short + long_ > room:
            short, long_ = room // 2, room // 2 + room % 2
        a, b = (short, long_) if len(first.ids) <= len(second.ids) else (long_, short)
        first.truncate(a)
        second.truncate(b)
    return tokenizer.post_process(first, second, True)


def token_ids(given: Any, tokenizer: Any, most: int | None = None) -> list[list[int]]:
    """The request's inputs as token id lists (texts tokenized, special tokens added; cut to
    `most` where given, token ids too)."""
    if isinstance(given, str) or (isinstance(given, list) and given
                                  and all(isinstance(t, int) for t in given)):
        given = [given]
    if not isinstance(given, list) or not given or len(given) > MAX_INPUTS:
        raise BadInput(f"input must be a text, token ids, or a list of up to {MAX_INPUTS} of "
                       "either")
    out = []
    for one in given:
        if isinstance(one, str):
            if tokenizer is None:
                raise BadInput("the model has no tokenizer (tokenizer.json in its model "
                               "repository entry): send token ids")
            one = encoded(tokenizer, one, most=most).ids
        if (not isinstance(one, list) or not one
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in one)):
            raise BadInput("each input must be a non-empty text or list of token ids")
        out.append(list(one)[:most])
    return out


def rows(generator: Generator, served: Any, names: list[str],
         given: list[tuple[list[int], list[int]]], length: int | None) -> list[list[np.ndarray]]:
    """Each input's row of every output of the model (token ids and their type ids, [] for
    zeros): inputs padded to one length run together where the model's batch is dynamic (as
    many as it takes a run), else one at a time; concurrent requests' too, through the
    model's batcher."""
    widths = [_width(generator, served, names, len(ids), length) for ids, _ in given]
    most = _most_rows(generator, served, names)
    out: list[list[np.ndarray]] = [[]] * len(given)
    for width in sorted(set(widths)):
        same = [i for i, w in enumerate(widths) if w == width]
        for k in range(0, len(same), most):
            taken = same[k:k + most]
            outputs = _run(generator, served, names, [given[i] for i in taken], width)
            for j, i in enumerate(taken):
                out[i] = [o[j] for o in outputs]
    return out


def _most_rows(generator: Generator, served: Any, names: list[str]) -> int:
    """How many inputs a run takes: 1 where the batch is fixed, else its export's bound
    within engine.max_dim."""
    at = names.index("input_ids")
    if served.record.inputs[at]["shape"][0] != -1:
        return 1
    return max(1, min([generator.runner.max_dim, *(
        hi for i, d, _, hi in served.loaded.dynamic if i == at and d == 0)]))


def _run(generator: Generator, served: Any, names: list[str],
         given: list[tuple[list[int], list[int]]], width: int) -> list[np.ndarray]:
    """The model's outputs for inputs padded to `width` (the padding masked), as bytes in and
    out as the OIP listeners run them: no torch in the daemon for it (a daemon restored from
    its load records serves an encoder without importing torch)."""
    columns = {"input_ids": [ids + [0] * (width - len(ids)) for ids, _ in given],
               "attention_mask": [[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in given],
               "token_type_ids": [(types or [0] * len(ids)) + [0] * (width - len(ids))
                                  for ids, types in given]}
    dtypes = {s["name"]: s["dtype"] for s in served.record.inputs}
    shape = (len(given), width)
    model = generator.runner.resolve(served.loaded, [(dtypes[n], shape) for n in names])
    inputs = [RawTensor(np.asarray(columns[n], dtype=np.dtype(dtypes[n])).tobytes(), dtypes[n],
                        shape) for n in names]
    raw = generator.runner.run_raw(model, inputs)
    return [_array(data, model.slots[name]) for data, name in zip(raw, model.outputs,
                                                                  strict=True)]


def _array(data: bytes | None, slot: Any) -> np.ndarray:
    """An output's bytes as a float32 array of its slot's shape (bfloat16 widened)."""
    if slot.dtype == "bfloat16":  # (numpy has none: its bits are a float32's top half)
        wide = np.frombuffer(data or b"", dtype=np.uint16).astype(np.uint32) << 16
        return wide.view(np.float32).reshape(slot.shape)
    return np.frombuffer(data or b"", dtype=np.dtype(slot.dtype)).reshape(
        slot.shape).astype(np.float32)


def output_of(served: Any, dims: int, verb: str) -> int:
    """Which output is the encoder's: `last_hidden_state` (dims 3) or `logits` (dims 2),
    else the first float output of `dims` dimensions; a model without one does not
    `verb`."""
    specs = served.record.outputs
    wanted = "last_hidden_state" if dims == 3 else "logits"
    picked = [i for i, s in enumerate(specs) if s["name"] == wanted] or [
        i for i, s in enumerate(specs) if len(s["shape"]) == dims and "float" in s["dtype"]]
    if dims == 2 and any(len(s["shape"]) == 3 and "float" in s["dtype"] for s in specs):
        picked = []  # (an embedding model's pooler_output is no classifier's logits)
    if not picked:
        shape = "[batch, length, hidden]" if dims == 3 else "[batch, labels]"
        raise Refused("invalid", f"model {served.key} does not {verb}: no {shape} float "
                      f"output among {[s['name'] for s in specs]}")
    return picked[0]


def _width(generator: Generator, served: Any, names: list[str], n: int,
           length: int | None) -> int:
    """The length `n` tokens run at: the model's own where fixed, else the next of 8, 12, 16,
    24, 32, 48, ... (powers of two and 1.5 times them) within the export's bounds and
    engine.max_dim, so that inputs of many lengths share a few built buckets, a third of a
    run padding at most (the padding masked, and left out of the pooling)."""
    low, high = bounds(generator, served, names, length)
    if n > high:
        raise BadInput(f"{n} tokens, over the {high} the model takes (truncate_prompt_tokens: "
                       "-1 cuts each input to them)")
    power = 1 << max(3, (n - 1).bit_length())
    step = power * 3 // 4 if power >= 16 and n <= power * 3 // 4 else power
    return length or min(high, max(low, step))


def bounds(generator: Generator, served: Any, names: list[str] | None = None,
           length: int | None = None) -> tuple[int, int]:
    """The fewest and the most tokens an encoder takes: its fixed length, or its export's
    bounds on input_ids' length within engine.max_dim."""
    if names is None:
        names, length = inputs_of(served)
    if length is not None:
        return length, length
    low, high, at = 1, generator.runner.max_dim, names.index("input_ids")
    for i, d, lo, hi in served.loaded.dynamic:
        if i == at and d == 1:
            low, high = lo, min(hi, high)
    return low, high


def _pooled(hidden: np.ndarray, pooling: str) -> np.ndarray:
    if pooling == "cls":
        return hidden[0]
    if pooling == "last":
        return hidden[-1]
    return hidden.mean(axis=0)


def _pooling(generator: Generator, served: Any) -> tuple[str, bool]:
    """How the entry pools ("mean", "cls" or "last") and whether it normalizes, by its
    sentence-transformers files; the mean, normalized, without them."""
    config, modules = (json_file(generator, served, POOLING_FILE),
                       json_file(generator, served, MODULES_FILE))
    pooling = "mean"
    if isinstance(config, dict):
        pooling = next((mode for key, mode in (
            ("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last"),
            ("pooling_mode_mean_tokens", "mean")) if config.get(key) is True), "mean")
    normalize = modules is None or (isinstance(modules, list) and any(
        isinstance(m, dict) and str(m.get("type", "")).endswith("Normalize") for m in modules))
    return pooling, normalize


def json_file(generator: Generator, served: Any, file: str) -> Any:
    """A JSON file of the model's repository entry (its version's, else the entry's); None
    where it has none."""
    path = generator.entry_file(served.record.name, served.record.version, file, MAX_FILE_BYTES)
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise Refused("invalid", f"{path}: not JSON ({e})") from None
