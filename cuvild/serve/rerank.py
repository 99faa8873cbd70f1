"""vLLM's rerank and score APIs for a served cross-encoder (a BERT-like model with one
relevance logit: sentence-transformers' CrossEncoder models, BGE's and ms-marco's
rerankers) or embedding model (an encoder /v1/embeddings serves):

    POST /rerank, /v1/rerank, /v2/rerank {"model", "query", "documents": [texts, or
                                          {"text": ...} objects], "top_n", "return_documents"}
    -> {"id", "model", "usage": {"total_tokens"},
        "results": [{"index", "relevance_score", "document": {"text"}}]}
    POST /score, /v1/score {"model", "text_1": text or [texts], "text_2": text or [texts]}
    -> {"id", "object": "list", "model", "data": [{"index", "object": "score", "score"}],
        "usage"}

A cross-encoder scores each pair as one input, tokenized by the entry's `tokenizer.json` (its
post-processor writes the pair: BERT's `[CLS] query [SEP] document [SEP]`, the document's
token type 1): the sigmoid of the model's one logit (`logits` [batch, 1]: what sentence-
transformers' CrossEncoder and vLLM give a one-label model). An embedding model scores a
pair by the cosine of its two texts' embeddings (as vLLM scores with one). Either runs as
/v1/embeddings runs its inputs (cuvild/serve/embeddings.py: one run for a request's inputs of
one padded length, concurrent requests merged by the batcher). Rerank's results go most
relevant first, `top_n` of them (all by default), each with its document unless
`return_documents` is false; score's pair `text_1` with `text_2` as vLLM does (one with
many, or one to one). `truncate_prompt_tokens` cuts each input as /v1/embeddings does (a
pair's longer text first). A request counts in the model's metrics as an inference request,
its pairs its batch.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from cuvild.core.layout import BadInput
from cuvild.serve import embeddings
from cuvild.serve.classify import probabilities
from cuvild.serve.errors import Refused, find
from cuvild.serve.generation import Generator
from cuvild.serve.openai_request import named

# (and under OpenAI's prefixes, /v1 and KServe's /openai/v1: cuvild/serve/generate_http.py)
ROUTES = ("/rerank", "/v2/rerank")
SCORE_ROUTES = ("/score",)
FIELDS = {"model", "query", "documents", "top_n", "return_documents", "user",
          "truncate_prompt_tokens"}
SCORE_FIELDS = {"model", "text_1", "text_2", "user", "truncate_prompt_tokens"}
MAX_PAIRS = 1000  # Cohere's bound on a request's documents


def rerank(generator: Generator, doc: Any) -> dict[str, Any]:
    """The answer to a rerank request `doc` (on a pool thread: it runs the model)."""
    name, version = named(doc, FIELDS)
    served = find(generator.models, name, version)
    query, documents, top_n = _asked(doc)
    most = embeddings.truncation(generator, served, doc)
    scores, used = embeddings.counted(generator, served, lambda: scored(
        generator, served, [(query, d) for d in documents], most))
    results = sorted(({"index": i, "relevance_score": s} for i, s in enumerate(scores)),
                     key=lambda r: -r["relevance_score"])
    if doc.get("return_documents", True) is not False:
        for r in results:
            r["document"] = {"text": documents[r["index"]]}
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": doc["model"],
            "usage": {"total_tokens": used}, "results": results[:top_n]}


def score(generator: Generator, doc: Any) -> dict[str, Any]:
    """The answer to a score request `doc`: text_1 paired with text_2 as vLLM pairs them."""
    name, version = named(doc, SCORE_FIELDS)
    served = find(generator.models, name, version)
    first, second = _texts(doc, "text_1"), _texts(doc, "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second) or len(second) > MAX_PAIRS:
        raise BadInput(f"text_1 ({len(first)} texts) pairs with text_2 ({len(second)}) as one "
                       f"with many, or one to one, up to {MAX_PAIRS} pairs")
    most = embeddings.truncation(generator, served, doc)
    scores, used = embeddings.counted(generator, served, lambda: scored(
        generator, served, list(zip(first, second, strict=True)), most))
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": doc["model"],
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": used, "total_tokens": used}}


def _texts(doc: dict[str, Any], field: str) -> list[str]:
    given = doc.get(field)
    given = [given] if isinstance(given, str) else given
    if not isinstance(given, list) or not given or not all(isinstance(t, str) and t
                                                           for t in given):
        raise BadInput(f"{field} must be a non-empty text or a list of them")
    return given


def _asked(doc: dict[str, Any]) -> tuple[str, list[str], int]:
    """The rerank request's query, documents and how many results it wants."""
    query, documents = doc.get("query"), doc.get("documents")
    if not isinstance(query, str) or not query:
        raise BadInput("query must be a non-empty text")
    if isinstance(documents, list):  # (Jina's and Cohere's v1 objects: {"text": ...})
        documents = [d.get("text") if isinstance(d, dict) and set(d) == {"text"} else d
                     for d in documents]
    if (not isinstance(documents, list) or not documents or len(documents) > MAX_PAIRS
            or not all(isinstance(d, str) and d for d in documents)):
        raise BadInput(f"documents must be a list of 1 to {MAX_PAIRS} non-empty texts "
                       "(or {\"text\": ...} objects)")
    if doc.get("return_documents", True) not in (True, False):
        raise BadInput("return_documents must be true or false")
    top_n = doc.get("top_n")
    if top_n is None:
        return query, documents, len(documents)
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise BadInput(f"top_n must be a positive integer, got {top_n!r}")
    return query, documents, top_n


def scored(generator: Generator, served: Any, pairs: list[tuple[str, str]],
           most: int | None = None) -> tuple[list[float], int]:
    """Each pair's score (a cross-encoder's sigmoid of its logit, an embedding model's
    cosine of the two texts' embeddings), and the tokens they took; each input cut to
    `most` tokens where given (truncate_prompt_tokens)."""
    names, length = embeddings.inputs_of(served, "rerank")
    tokenizer = generator.tokenizer(served.record.name, served.record.version)
    if tokenizer is None:
        raise BadInput("the model has no tokenizer (tokenizer.json in its model repository "
                       "entry): queries and documents are texts")
    if any(len(s["shape"]) == 3 for s in served.record.outputs):  # an embedding model
        texts = sorted({t for pair in pairs for t in pair})
        found, used = embeddings.vectors(generator, served,
                                         [embeddings.encoded(tokenizer, t, most=most).ids
                                          for t in texts])
        by_text = {t: v / max(float(np.linalg.norm(v)), 1e-12) for t, v in
                   zip(texts, found, strict=True)}
        return [float(by_text[a] @ by_text[b]) for a, b in pairs], used
    logits = embeddings.output_of(served, 2, "rerank")
    labels = served.record.outputs[logits]["shape"][-1]
    if labels != 1:
        raise Refused("invalid", f"model {served.key} does not rerank: its logits have "
                      f"{labels} labels, a cross-encoder's one")
    encoded = [embeddings.encoded(tokenizer, a, b, most) for a, b in pairs]
    outputs = embeddings.rows(generator, served, names,
                              [(e.ids, e.type_ids) for e in encoded], length)
    return ([float(probabilities(o[logits])[0]) for o in outputs],
            sum(len(e.ids) for e in encoded))
