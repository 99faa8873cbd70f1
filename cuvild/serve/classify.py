"""vLLM's classify API for a served text classifier (transformers' `...ForSequenceClassification`
exported with its labels: sentiment, NLI, intent, toxicity models):

    POST /classify, /v1/classify {"model", "input": text | [texts] | [ids] | [[ids]],
                                  "truncate_prompt_tokens"}
    -> {"id", "object": "list", "created", "model",
        "data": [{"index", "label", "probs", "num_classes"}], "usage"}

Each input runs as /v1/embeddings runs its inputs (cuvild/serve/embeddings.py: tokenized by
the entry's tokenizer.json, padded, a request's inputs together, concurrent requests merged
by the batcher); its `probs` the softmax of the model's logits (the sigmoid of one logit:
vLLM's activations), its `label` the likeliest's name in the entry's `config.json` (`id2label`,
as transformers saves it; `LABEL_<i>` without one). A request counts in the model's metrics
as an inference request, its inputs its batch.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from cuvild.serve import embeddings
from cuvild.serve.errors import find
from cuvild.serve.generation import Generator
from cuvild.serve.openai_request import named

ROUTES = ("/classify",)  # (and under OpenAI's prefixes: cuvild/serve/generate_http.py)
FIELDS = {"model", "input", "user", "truncate_prompt_tokens", "use_activation"}


def classify(generator: Generator, doc: Any) -> dict[str, Any]:
    """The answer to a classify request `doc` (on a pool thread: it runs the model)."""
    name, version = named(doc, FIELDS)
    served = find(generator.models, name, version)
    data, used = embeddings.counted(generator, served,
                                    lambda: classified(generator, served, doc))
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list",
            "created": int(time.time()), "model": doc["model"], "data": data,
            "usage": {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0}}


def classified(generator: Generator, served: Any,
               doc: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    names, length = embeddings.inputs_of(served, "classify")
    logits = embeddings.output_of(served, 2, "classify")
    tokenizer = generator.tokenizer(served.record.name, served.record.version)
    given = embeddings.token_ids(doc.get("input"), tokenizer,
                                 embeddings.truncation(generator, served, doc))
    outputs = embeddings.rows(generator, served, names, [(ids, []) for ids in given], length)
    config = embeddings.json_file(generator, served, embeddings.CONFIG_FILE)
    labels = config.get("id2label") if isinstance(config, dict) else None
    labels = labels if isinstance(labels, dict) else {}
    activate = embeddings.switch(doc, ("use_activation",)) is not False
    data = []
    for i, out in enumerate(outputs):  # (vLLM's use_activation false: the logits as they are)
        probs = probabilities(out[logits]) if activate else np.asarray(out[logits], np.float64)
        top = int(np.argmax(probs))
        data.append({"index": i, "label": str(labels.get(str(top), f"LABEL_{top}")),
                     "probs": [float(p) for p in probs], "num_classes": len(probs)})
    return data, sum(len(ids) for ids in given)


def probabilities(logits: np.ndarray) -> np.ndarray:
    """A classifier's logits as vLLM's activations make them probabilities: the softmax,
    or the sigmoid of one logit (a cross-encoder's relevance: cuvild/serve/rerank.py)."""
    row = np.asarray(logits, dtype=np.float64)
    if len(row) == 1:
        return 1.0 / (1.0 + np.exp(-np.clip(row, -500, 500)))
    probs = np.exp(row - row.max())
    return probs / probs.sum()
