"""vLLM's Pooling API for a served encoder or text classifier (what a client of vLLM's pooling
runner posts to one model of either kind):

    POST /pooling {"model", "input": text | [texts] | [ids] | [[ids]], "task": "embed" |
                   "classify", "encoding_format": "float" | "base64", "dimensions",
                   "truncate_prompt_tokens"}
    -> {"id", "object": "list", "created", "model",
        "data": [{"index", "object": "pooling", "data": [floats] | base64}], "usage"}

Each input's pooled output: for `embed`, its embedding as /v1/embeddings gives it (pooled and
normalized as the entry says: cuvild/serve/embeddings.py); for `classify`, its class
probabilities as /classify gives them (cuvild/serve/classify.py). Without `task`, a model
with hidden states ([batch, length, hidden]) embeds and one with only logits ([batch,
labels]) classifies; `normalize` / `use_activation` as those routes take them (false: the
pooled vector unnormalized, the logits without softmax). vLLM's per-token tasks
(`token_embed`, `token_classify`) and its `messages` (chat-formed input) are refused, naming
what is served; base64 is the vector's float32 bytes, as /v1/embeddings sends it.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import numpy as np

from cuvild.core.layout import BadInput
from cuvild.serve import classify, embeddings
from cuvild.serve.errors import Refused, find
from cuvild.serve.generation import Generator
from cuvild.serve.openai_request import named

ROUTES = ("/pooling",)
FIELDS = {"model", "input", "task", "encoding_format", "dimensions", "truncate_prompt_tokens",
          "user", "normalize", "use_activation"}
TASKS = ("embed", "classify")


def pool(generator: Generator, doc: Any) -> dict[str, Any]:
    """The answer to a pooling request `doc` (on a pool thread: it runs the model); a request
    of the model's in its metrics, as an inference request (its inputs its batch)."""
    if isinstance(doc, dict) and "messages" in doc:
        raise BadInput("messages: cuvild's /pooling takes input (texts or token ids), not a "
                       "chat")
    name, version = named(doc, FIELDS)
    served = find(generator.models, name, version)
    task = _task(served, doc.get("task"))
    data, used = embeddings.counted(generator, served, lambda: _pooled(generator, served, doc,
                                                                       task))
    return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": doc["model"], "data": data,
            "usage": {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0}}


def _task(served: Any, asked: Any) -> str:
    """The request's task, or the model's own: embed where it gives hidden states."""
    if asked is not None:
        if asked not in TASKS:
            raise BadInput(f"task must be one of {list(TASKS)} here (per-token pooling is not "
                           f"served), got {asked!r}")
        return str(asked)
    try:
        embeddings.output_of(served, 3, "embed")
    except Refused:
        return "classify"
    return "embed"


def _pooled(generator: Generator, served: Any, doc: dict[str, Any],
            task: str) -> tuple[list[dict[str, Any]], int]:
    form = doc.get("encoding_format") or "float"
    if task == "embed":
        items, used = embeddings.embedded(generator, served, doc)
        return [{"index": e["index"], "object": "pooling", "data": e["embedding"]}
                for e in items], used
    if form not in ("float", "base64"):
        raise BadInput(f"encoding_format must be \"float\" or \"base64\", got {form!r}")
    for field, what in (("dimensions", "a Matryoshka model's shorter vector"),
                        ("normalize", "use_activation for a classifier's probabilities")):
        if doc.get(field) is not None:
            raise BadInput(f"{field} is for task embed ({what})")
    items, used = classify.classified(generator, served, doc)
    return [{"index": c["index"], "object": "pooling", "data": c["probs"] if form == "float"
             else base64.b64encode(np.asarray(c["probs"], np.float32).tobytes()).decode()}
            for c in items], used
