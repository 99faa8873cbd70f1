"""vLLM's rerank API (Jina's and Cohere's shape) for a served cross-encoder (a BERT-like
model with one relevance logit: sentence-transformers' CrossEncoder models, BGE's and
ms-marco's rerankers):

    POST /rerank, /v1/rerank, /v2/rerank {"model", "query", "documents": [texts, or
                                          {"text": ...} objects], "top_n", "return_documents"}
    -> {"id", "model", "usage": {"total_tokens"},
        "results": [{"index", "relevance_score", "document": {"text"}}]}

Each (query, document) pair is tokenized as one input by the entry's `tokenizer.json` (its
post-processor writes the pair: BERT's `[CLS] query [SEP] document [SEP]`, the document's
token type 1), padded and run as /v1/embeddings runs its inputs (cuvild/serve/embeddings.py:
one run for a request's pairs of one padded length, concurrent requests merged by the
batcher), and scored by the sigmoid of the model's one logit (`logits` [batch, 1]: what
sentence-transformers' CrossEncoder and vLLM give a one-label model). Results go most
relevant first, `top_n` of them (all by default), each with its document where
`return_documents` (the default) asks. A request counts in the model's metrics as an
inference request, its documents its batch.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from cuvild.core.layout import BadInput
from cuvild.serve import embeddings
from cuvild.serve.errors import Refused, find
from cuvild.serve.generation import Generator
from cuvild.serve.openai_request import named

ROUTES = ("/rerank", "/v1/rerank", "/v2/rerank")
FIELDS = {"model", "query", "documents", "top_n", "return_documents", "user"}
MAX_DOCUMENTS = 1000  # Cohere's bound on a request's documents


def rerank(generator: Generator, doc: Any) -> dict[str, Any]:
    """The answer to a rerank request `doc` (on a pool thread: it runs the model)."""
    name, version = named(doc, FIELDS)
    served = find(generator.models, name, version)
    query, documents, top_n = _asked(doc)
    results, used = embeddings.counted(
        generator, served, lambda: _scored(generator, served, query, documents))
    results.sort(key=lambda r: -r["relevance_score"])
    if doc.get("return_documents", True) is not False:
        for r in results:
            r["document"] = {"text": documents[r["index"]]}
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": doc["model"],
            "usage": {"total_tokens": used}, "results": results[:top_n]}


def _asked(doc: dict[str, Any]) -> tuple[str, list[str], int]:
    """The request's query, documents and how many results it wants."""
    query, documents = doc.get("query"), doc.get("documents")
    if not isinstance(query, str) or not query:
        raise BadInput("query must be a non-empty text")
    if isinstance(documents, list):  # (Jina's and Cohere's v1 objects: {"text": ...})
        documents = [d.get("text") if isinstance(d, dict) and set(d) == {"text"} else d
                     for d in documents]
    if (not isinstance(documents, list) or not documents or len(documents) > MAX_DOCUMENTS
            or not all(isinstance(d, str) and d for d in documents)):
        raise BadInput(f"documents must be a list of 1 to {MAX_DOCUMENTS} non-empty texts "
                       "(or {\"text\": ...} objects)")
    if doc.get("return_documents", True) not in (True, False):
        raise BadInput("return_documents must be true or false")
    top_n = doc.get("top_n")
    if top_n is None:
        return query, documents, len(documents)
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise BadInput(f"top_n must be a positive integer, got {top_n!r}")
    return query, documents, top_n


def _scored(generator: Generator, served: Any, query: str,
            documents: list[str]) -> tuple[list[dict[str, Any]], int]:
    """Each document's relevance to the query (its index and score), and the tokens the
    pairs took."""
    names, length = embeddings.inputs_of(served, "rerank")
    logits = embeddings.output_of(served, 2, "rerank")
    labels = served.record.outputs[logits]["shape"][-1]
    if labels != 1:
        raise Refused("invalid", f"model {served.key} does not rerank: its logits have "
                      f"{labels} labels, a cross-encoder's one")
    tokenizer = generator.tokenizer(served.record.name, served.record.version)
    if tokenizer is None:
        raise BadInput("the model has no tokenizer (tokenizer.json in its model repository "
                       "entry): a query and documents are texts")
    pairs = [tokenizer.encode(query, d) for d in documents]
    outputs = embeddings.rows(generator, served, names,
                              [(p.ids, p.type_ids) for p in pairs], length)
    results = [{"index": i, "relevance_score": _sigmoid(float(o[logits][0]))}
               for i, o in enumerate(outputs)]
    return results, sum(len(p.ids) for p in pairs)


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    return math.exp(x) / (1.0 + math.exp(x))  # (no overflow for a large negative logit)
