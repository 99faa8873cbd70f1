"""OpenAI's /v1/embeddings (cuvild/serve/embeddings.py) on test_generation.py's daemon
(tests/serve/conftest.py `lm_daemon`; its repository's "embed" entry: a tiny BERT with the
byte-level tokenizer and sentence-transformers' pooling files), as OpenAI's own SDK calls it;
one worker runs it with the generation tests (tests/conftest.py SAME_WORKER)."""

from __future__ import annotations

import json
import threading
import urllib.request

import numpy as np
import torch
from generation_helpers import all_ready, byte_tokenizer_json, post

from cuvild.client import Client


def eager_cls(bert, text: str, size: int | None = None) -> np.ndarray:  # noqa: ANN001
    """The normalized CLS state of `text` on torch eager (cut to `size` before it is
    normalized, as a Matryoshka model's vector is)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_str(byte_tokenizer_json()).encode(text).ids
    with torch.no_grad():
        cls = bert(input_ids=torch.tensor([ids]),
                   attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0][0, 0]
    cls = cls[:size] if size else cls
    return (cls / cls.norm()).numpy()


def test_an_encoder_embeds_texts_as_sentence_transformers_would(lm_daemon, lm_served) -> None:  # noqa: ANN001
    """The entry's pooling (CLS) and normalization, on the model's own hidden states: equal
    to torch eager's within fp32; OpenAI's SDK (base64 by default) and floats alike; token
    ids too; usage counts the tokens; /tokenize gives its ids and the length it takes; what
    cannot be embedded is refused, naming why."""
    import openai
    from tokenizers import Tokenizer

    all_ready(lm_daemon.target, ("embed",))
    bert = lm_served["hf"]["embed"]
    tokenizer = Tokenizer.from_str(byte_tokenizer_json())
    texts = ["The weather in Oslo", "is cold!", "and windy, very windy"]  # (19 and 21: one run)

    want = [eager_cls(bert, t) for t in texts]
    client = openai.OpenAI(base_url=f"http://{lm_daemon.http}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    said = client.embeddings.create(model="embed", input=texts)  # (base64, decoded by the SDK)
    assert [d.index for d in said.data] == [0, 1, 2]
    for got, ref in zip(said.data, want, strict=True):
        assert np.allclose(got.embedding, ref, atol=1e-5) and abs(np.linalg.norm(
            got.embedding) - 1) < 1e-5
    assert said.usage.prompt_tokens == sum(len(tokenizer.encode(t).ids) for t in texts)
    with Client(lm_daemon.target) as control:  # 19 and 21 tokens padded to 24 ran together
        shapes = [b["shapes"][0] for b in control.plan("embed")["plan"]["buckets"]]
    assert [2, 24] in shapes and [1, 8] in shapes, shapes
    code, body = post(lm_daemon.http, "/v1/embeddings", {
        "model": "embed", "input": tokenizer.encode(texts[1]).ids, "encoding_format": "float"})
    assert code == 200 and np.allclose(json.loads(body)["data"][0]["embedding"], want[1],
                                       atol=1e-5), body
    code, body = post(lm_daemon.http, "/tokenize", {"model": "embed", "prompt": texts[0]})
    assert code == 200 and json.loads(body) == {  # (vLLM's /tokenize takes any model)
        "count": len(tokenizer.encode(texts[0]).ids), "max_model_len": 63,
        "tokens": tokenizer.encode(texts[0]).ids, "token_strs": None}, body
    with urllib.request.urlopen(f"http://{lm_daemon.http}/metrics", timeout=10) as r:
        counted = [line for line in r.read().decode().splitlines() if line.startswith(
            "cuvil_inference_request_success_total") and 'model="embed"' in line]
    assert counted and float(counted[0].rpartition(" ")[2]) >= 2, counted
    for doc, words in (({"model": "llama", "input": "a"}, "does not embed"),
                       ({"model": "embed", "input": "x" * 80}, "80 tokens, over the 63"),
                       ({"model": "embed", "input": []}, "a list of up to"),
                       ({"model": "embed", "input": "a", "dimensions": 8},
                        "does not support Matryoshka"),
                       ({"model": "embed", "input": "a", "encoding_format": "hex"}, "float")):
        code, body = post(lm_daemon.http, "/v1/embeddings", doc)
        assert code == 400 and words in json.loads(body)["error"]["message"], (doc, body)


def test_a_matryoshka_model_cuts_its_vectors_where_its_config_says(lm_daemon, lm_served) -> None:  # noqa: ANN001
    """`dimensions` as vLLM takes it: a model whose config.json lists matryoshka_dimensions
    gives one of them, cut before it is normalized; `is_matryoshka` any size up to its own;
    anything else refused naming why (a model without either: test above)."""
    all_ready(lm_daemon.target, ("embed",))
    config = lm_served["root"] / "embed" / "config.json"
    bert = lm_served["hf"]["embed"]
    try:
        config.write_text(json.dumps({"model_type": "bert", "matryoshka_dimensions": [16, 32]}))
        code, body = post(lm_daemon.http, "/v1/embeddings", {
            "model": "embed", "input": ["is cold!"], "dimensions": 16,
            "encoding_format": "float"})
        got = json.loads(body)["data"][0]["embedding"] if code == 200 else body
        assert len(got) == 16 and np.allclose(got, eager_cls(bert, "is cold!", 16),
                                              atol=1e-5), got
        for size, words in ((8, "only supports Matryoshka dimensions [16, 32], got 8"),
                            (0, "positive integer"), (True, "positive integer")):
            code, body = post(lm_daemon.http, "/v1/embeddings",
                              {"model": "embed", "input": "a", "dimensions": size})
            assert code == 400 and words in json.loads(body)["error"]["message"], body
        config.write_text(json.dumps({"model_type": "bert", "is_matryoshka": True}))
        code, body = post(lm_daemon.http, "/v1/embeddings",
                          {"model": "embed", "input": "a", "dimensions": 20})
        assert code == 200 and len(json.loads(body)["data"][0]["embedding"]) == 20, body
        code, body = post(lm_daemon.http, "/v1/embeddings",
                          {"model": "embed", "input": "a", "dimensions": 33})
        assert code == 400 and "33 is over the model's 32" in body.decode(), body
    finally:
        config.unlink(missing_ok=True)


def test_concurrent_requests_share_runs_and_the_encoder_is_listed(lm_daemon,  # noqa: ANN001
                                                                    lm_served) -> None:
    """Clients sending one text each at once (RAG indexing, a search front end): their
    inputs of one padded length run together through the model's batcher, each answered
    its own vector; /v1/models lists the encoder with the most tokens it takes."""
    import openai

    all_ready(lm_daemon.target, ("embed",))
    client = openai.OpenAI(base_url=f"http://{lm_daemon.http}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    listed = {m.id: m.model_extra["max_model_len"] for m in client.models.list()}
    assert listed["embed"] == listed["embed:1"] == 63, listed
    texts = [f"query number {i:02d} ok" for i in range(12)]  # (18 tokens each: one bucket)
    got: dict[int, list[float]] = {}
    start = threading.Barrier(len(texts))

    def ask(i: int) -> None:
        start.wait()
        got[i] = client.embeddings.create(model="embed", input=texts[i]).data[0].embedding

    askers = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
    for t in askers:
        t.start()
    for t in askers:
        t.join(120)
    bert = lm_served["hf"]["embed"]
    assert sorted(got) == list(range(len(texts)))
    for i, text in enumerate(texts):
        assert np.allclose(got[i], eager_cls(bert, text), atol=1e-5), i
    with Client(lm_daemon.target) as control:
        batching = next(m for m in control.models() if m["name"] == "embed")["batching"]
    assert any(int(rows) > 1 for rows in batching["sizes"]), batching


def test_a_cross_encoder_reranks_documents_as_sentence_transformers_would(lm_daemon,  # noqa: ANN001
                                                                          lm_served) -> None:
    """vLLM's rerank (Jina's /rerank and /v1/rerank, Cohere's /v2/rerank): each (query,
    document) pair as the tokenizer writes a pair, scored by the sigmoid of the model's one
    logit (sentence-transformers' CrossEncoder): equal to torch eager's within fp32, most
    relevant first, top_n of them, documents returned or not; the model listed; what cannot
    rerank refused naming why."""
    from tokenizers import Tokenizer

    all_ready(lm_daemon.target, ("rerank", "embed"))
    model = lm_served["hf"]["rerank"]
    tokenizer = Tokenizer.from_str(
        (lm_served["root"] / "rerank" / "tokenizer.json").read_text())
    query = "where is it cold?"
    documents = ["Oslo is cold in winter", "Cairo is hot", "the sea is wide and deep",
                 "cold, cold, cold!"]
    pairs = [tokenizer.encode(query, d) for d in documents]
    with torch.no_grad():
        want = [torch.sigmoid(model(input_ids=torch.tensor([p.ids]),
                                    attention_mask=torch.ones(1, len(p.ids), dtype=torch.long),
                                    token_type_ids=torch.tensor([p.type_ids])).logits[0, 0]
                              ).item() for p in pairs]
    assert pairs[0].type_ids[-1] == 1 and pairs[0].ids[0] == 0  # (the pair as BERT's)
    order = sorted(range(len(documents)), key=lambda i: -want[i])
    code, body = post(lm_daemon.http, "/v1/rerank", {"model": "rerank", "query": query,
                                                      "documents": documents, "top_n": 3})
    said = json.loads(body)
    assert code == 200 and [r["index"] for r in said["results"]] == order[:3], body
    for r in said["results"]:
        assert abs(r["relevance_score"] - want[r["index"]]) < 1e-5, (r, want)
        assert r["document"] == {"text": documents[r["index"]]}
    assert said["usage"]["total_tokens"] == sum(len(p.ids) for p in pairs)
    for path, given in (("/rerank", documents), ("/v2/rerank", [{"text": d} for d in documents])):
        code, body = post(lm_daemon.http, path, {"model": "rerank", "query": query,
                                                 "documents": given,
                                                 "return_documents": False})
        results = json.loads(body)["results"]
        assert code == 200 and [r["index"] for r in results] == order, body
        assert all("document" not in r for r in results)
    with urllib.request.urlopen(f"http://{lm_daemon.http}/v1/models", timeout=10) as r:
        listed = {m["id"]: m["max_model_len"] for m in json.loads(r.read())["data"]}
    assert listed["rerank"] == 127 and listed["embed"] == 63, listed
    for doc, words in (({"model": "llama", "query": "a", "documents": ["b"]},
                        "does not rerank: its inputs"),
                       ({"model": "rerank", "query": "a", "documents": []}, "documents must"),
                       ({"model": "rerank", "query": "", "documents": ["b"]}, "query must"),
                       ({"model": "rerank", "query": "a", "documents": ["b"], "top_n": 0},
                        "top_n must"),
                       ({"model": "rerank", "query": "a", "documents": ["b"], "rank": 1},
                        "unsupported fields")):
        code, body = post(lm_daemon.http, "/v1/rerank", doc)
        assert code == 400 and words in json.loads(body)["error"]["message"], (doc, body)


def test_score_pairs_texts_as_vllm_does_on_a_cross_encoder_and_an_embedding_model(  # noqa: ANN001
        lm_daemon, lm_served) -> None:
    """vLLM's /score: text_1 with each of text_2 (or one to one), a cross-encoder's sigmoid
    of its logit, an embedding model's cosine of the two texts' embeddings (rerank too);
    texts that do not pair refused."""
    from tokenizers import Tokenizer

    all_ready(lm_daemon.target, ("rerank", "embed"))
    model = lm_served["hf"]["rerank"]
    tokenizer = Tokenizer.from_str(
        (lm_served["root"] / "rerank" / "tokenizer.json").read_text())
    firsts, seconds = ["is it cold?", "is it hot?"], ["Oslo is cold", "Cairo is hot"]

    def cross(a: str, b: str) -> float:
        pair = tokenizer.encode(a, b)
        with torch.no_grad():
            return torch.sigmoid(model(input_ids=torch.tensor([pair.ids]),
                                       token_type_ids=torch.tensor([pair.type_ids])
                                       ).logits[0, 0]).item()

    for given, pairs in (({"text_1": firsts[0], "text_2": seconds}, [(0, 0), (0, 1)]),
                         ({"text_1": firsts, "text_2": seconds}, [(0, 0), (1, 1)]),
                         ({"text_1": firsts[1], "text_2": seconds[0]}, [(1, 0)])):
        code, body = post(lm_daemon.http, "/score", {"model": "rerank", **given})
        said = json.loads(body)
        assert code == 200 and [d["index"] for d in said["data"]] == list(range(len(pairs)))
        for d, (i, j) in zip(said["data"], pairs, strict=True):
            assert abs(d["score"] - cross(firsts[i], seconds[j])) < 1e-5, (given, said)
    bert = lm_served["hf"]["embed"]
    code, body = post(lm_daemon.http, "/openai/v1/score", {"model": "embed",  # (KServe's)
                                                           "text_1": firsts[0],
                                                    "text_2": seconds})
    cosines = [float(eager_cls(bert, firsts[0]) @ eager_cls(bert, s)) for s in seconds]
    assert code == 200 and np.allclose([d["score"] for d in json.loads(body)["data"]],
                                       cosines, atol=1e-5), (body, cosines)
    code, body = post(lm_daemon.http, "/rerank", {"model": "embed", "query": firsts[0],
                                                  "documents": seconds})
    assert code == 200 and np.allclose(
        [r["relevance_score"] for r in sorted(json.loads(body)["results"],
                                              key=lambda r: r["index"])], cosines, atol=1e-5)
    for doc, words in (({"text_1": firsts, "text_2": seconds + ["x"]}, "one with many"),
                       ({"text_1": [], "text_2": "a"}, "text_1 must"),
                       ({"text_1": "a", "text_2": ["b", 3]}, "text_2 must")):
        code, body = post(lm_daemon.http, "/score", {"model": "rerank", **doc})
        assert code == 400 and words in json.loads(body)["error"]["message"], (doc, body)


def test_truncate_prompt_tokens_cuts_inputs_as_transformers_tokenizers_do(lm_daemon,  # noqa: ANN001
                                                                          lm_served) -> None:
    """vLLM's truncate_prompt_tokens: a text (or a pair, its longer text first) cut before
    its special tokens are added, as transformers' tokenizer cuts it with truncation=True;
    -1 to the most the model takes; without it an input too long is refused."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    all_ready(lm_daemon.target, ("rerank", "embed"))
    bert, model = lm_served["hf"]["embed"], lm_served["hf"]["rerank"]
    for text, most, cut in (("The weather in Oslo", 10, "The weathe"), ("x" * 80, -1, "x" * 63)):
        code, body = post(lm_daemon.http, "/v1/embeddings", {
            "model": "embed", "input": text, "truncate_prompt_tokens": most,
            "encoding_format": "float"})
        assert code == 200 and np.allclose(json.loads(body)["data"][0]["embedding"],
                                           eager_cls(bert, cut), atol=1e-5), body
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(
        (lm_served["root"] / "rerank" / "tokenizer.json").read_text()))
    query, document = "where is it cold?", "Oslo is cold in winter, very cold"
    pair = hf(query, document, truncation=True, max_length=12, return_tensors="pt",
              return_token_type_ids=True)
    with torch.no_grad():
        want = torch.sigmoid(model(**pair).logits[0, 0]).item()
    code, body = post(lm_daemon.http, "/score", {"model": "rerank", "text_1": query,
                                                 "text_2": document,
                                                 "truncate_prompt_tokens": 12})
    said = json.loads(body)
    assert code == 200 and abs(said["data"][0]["score"] - want) < 1e-5, (said, want)
    assert said["usage"]["total_tokens"] == 12
    for doc, words in (({"input": "x" * 80}, "truncate_prompt_tokens: -1 cuts"),
                       ({"input": "a", "truncate_prompt_tokens": 64}, "over the 63"),
                       ({"input": "a", "truncate_prompt_tokens": 0}, "must be -1")):
        code, body = post(lm_daemon.http, "/v1/embeddings", {"model": "embed", **doc})
        assert code == 400 and words in json.loads(body)["error"]["message"], (doc, body)


def test_a_classifier_classifies_texts_with_its_labels(lm_daemon, lm_served) -> None:  # noqa: ANN001
    """vLLM's /classify: each text's probabilities (the softmax of the classifier's logits,
    equal to torch eager's) and its likeliest label by the entry's config.json; listed in
    /v1/models; what does not classify refused."""
    from tokenizers import Tokenizer

    all_ready(lm_daemon.target, ("classify", "embed"))
    model = lm_served["hf"]["classify"]
    tokenizer = Tokenizer.from_str(
        (lm_served["root"] / "classify" / "tokenizer.json").read_text())
    texts = ["what a lovely day", "meh", "this is the worst film I have seen in years"]
    code, body = post(lm_daemon.http, "/v1/classify", {"model": "classify", "input": texts})
    said = json.loads(body)
    assert code == 200 and said["usage"]["prompt_tokens"] == sum(
        len(tokenizer.encode(t).ids) for t in texts), body
    names = ["negative", "neutral", "positive"]
    for i, text in enumerate(texts):
        with torch.no_grad():
            want = torch.softmax(model(input_ids=torch.tensor([tokenizer.encode(text).ids])
                                       ).logits[0], -1)
        got = said["data"][i]
        assert got["index"] == i and got["num_classes"] == 3
        assert np.allclose(got["probs"], want.numpy(), atol=1e-5), (got, want)
        assert got["label"] == names[int(want.argmax())]
    code, body = post(lm_daemon.http, "/classify", {"model": "classify", "input": texts[1]})
    assert code == 200 and len(json.loads(body)["data"]) == 1
    with urllib.request.urlopen(f"http://{lm_daemon.http}/v1/models/classify", timeout=10) as r:
        assert json.loads(r.read())["max_model_len"] == 127
    for doc, words in (({"model": "embed", "input": "a"}, "does not classify: no [batch, "
                                                           "labels]"),
                       ({"model": "llama", "input": "a"}, "does not classify: its inputs"),
                       ({"model": "classify", "input": []}, "input must be")):
        code, body = post(lm_daemon.http, "/v1/classify", doc)
        assert code == 400 and words in json.loads(body)["error"]["message"], (doc, body)


def test_pooling_answers_as_vllm_does_for_an_encoder_and_a_classifier(lm_daemon, lm_served) -> None:  # noqa: ANN001
    """vLLM's /pooling: an encoder's embeddings (as /v1/embeddings gives them, equal to torch
    eager's) and a classifier's probabilities (as /classify gives them), each model's task
    found from its outputs unless the request names one; base64 as float32 bytes; per-token
    tasks, chats and what does not pool refused, naming why."""
    import base64

    from tokenizers import Tokenizer

    all_ready(lm_daemon.target, ("classify", "embed"))
    texts = ["The weather in Oslo", "is cold!"]
    code, body = post(lm_daemon.http, "/pooling", {"model": "embed", "input": texts})
    said = json.loads(body)
    assert code == 200 and said["object"] == "list" and said["id"].startswith("pool-"), body
    assert [(d["index"], d["object"]) for d in said["data"]] == [(0, "pooling"), (1, "pooling")]
    for got, text in zip(said["data"], texts, strict=True):
        assert np.allclose(got["data"], eager_cls(lm_served["hf"]["embed"], text), atol=1e-5)
    _, embedded = post(lm_daemon.http, "/v1/embeddings", {
        "model": "embed", "input": texts, "encoding_format": "float"})
    assert [d["embedding"] for d in json.loads(embedded)["data"]] == [
        d["data"] for d in said["data"]]
    assert said["usage"] == json.loads(embedded)["usage"] | {"completion_tokens": 0}

    code, body = post(lm_daemon.http, "/pooling", {"model": "classify", "input": texts,
                                                   "encoding_format": "base64"})
    pooled = json.loads(body)["data"]
    _, classified = post(lm_daemon.http, "/classify", {"model": "classify", "input": texts})
    for got, want in zip(pooled, json.loads(classified)["data"], strict=True):
        probs = np.frombuffer(base64.b64decode(got["data"]), np.float32)
        assert code == 200 and np.allclose(probs, want["probs"], atol=1e-6), (got, want)
    # vLLM's normalize (use_activation, its newer name): the pooled CLS state as it is; and
    # a classifier's use_activation false: its logits, no softmax
    bert, cls = lm_served["hf"]["embed"], lm_served["hf"]["classify"]
    tokenizer = Tokenizer.from_str(byte_tokenizer_json())
    ids = tokenizer.encode(texts[0]).ids
    with torch.no_grad():
        raw = bert(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                            dtype=torch.long))
    for doc in ({"normalize": False}, {"use_activation": False}):
        code, body = post(lm_daemon.http, "/pooling", {"model": "embed", "input": texts[0], **doc})
        (got,) = json.loads(body)["data"]
        assert code == 200 and np.allclose(got["data"], raw[0][0, 0].numpy(), atol=1e-5), doc
    cls_tokenizer = Tokenizer.from_str(
        (lm_served["root"] / "classify" / "tokenizer.json").read_text())
    with torch.no_grad():
        logits = cls(input_ids=torch.tensor([cls_tokenizer.encode(texts[0]).ids])).logits[0]
    code, body = post(lm_daemon.http, "/classify", {"model": "classify", "input": texts[0],
                                                    "use_activation": False})
    assert code == 200 and np.allclose(json.loads(body)["data"][0]["probs"], logits.numpy(),
                                       atol=1e-5), body
    for doc, words in (({"model": "embed", "input": "a", "task": "token_embed"},
                        "task must be one of ['embed', 'classify']"),
                       ({"model": "embed", "input": "a", "normalize": 1},
                        "normalize must be true or false"),
                       ({"model": "embed", "input": "a", "normalize": True,
                         "use_activation": False}, "normalize and use_activation disagree"),
                       ({"model": "classify", "input": "a", "normalize": False},
                        "normalize is for task embed"),
                       ({"model": "embed", "input": "a", "task": "classify"},
                        "does not classify: no [batch, labels]"),
                       ({"model": "classify", "input": "a", "dimensions": 4},
                        "dimensions is for task embed"),
                       ({"model": "embed", "messages": [{"role": "user", "content": "a"}]},
                        "takes input (texts or token ids), not a chat"),
                       ({"model": "llama", "input": "a"}, "does not embed: its inputs")):
        code, body = post(lm_daemon.http, "/pooling", doc)
        assert code == 400 and words in json.loads(body)["error"]["message"], (doc, body)
