"""OpenAI's /v1/embeddings (cuvild/serve/embeddings.py) on test_generation.py's daemon
(tests/serve/conftest.py `lm_daemon`; its repository's "embed" entry: a tiny BERT with the
byte-level tokenizer and sentence-transformers' pooling files), as OpenAI's own SDK calls it;
one worker runs it with the generation tests (tests/conftest.py SAME_WORKER)."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import torch
from generation_helpers import all_ready, byte_tokenizer_json, post

from cuvild.client import Client


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

    def eager(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            cls = bert(input_ids=torch.tensor([ids]),
                       attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0][0, 0]
        return (cls / cls.norm()).numpy()

    want = [eager(tokenizer.encode(t).ids) for t in texts]
    client = openai.OpenAI(base_url=f"http://{lm_daemon.http}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    said = client.embeddings.create(model="embed", input=texts)  # (base64, decoded by the SDK)
    assert [d.index for d in said.data] == [0, 1, 2]
    for got, ref in zip(said.data, want, strict=True):
        assert np.allclose(got.embedding, ref, atol=1e-5) and abs(np.linalg.norm(
            got.embedding) - 1) < 1e-5
    assert said.usage.prompt_tokens == sum(len(tokenizer.encode(t).ids) for t in texts)
    with Client(lm_daemon.target) as control:  # 19 and 21 tokens padded to 32 ran together
        shapes = [b["shapes"][0] for b in control.plan("embed")["plan"]["buckets"]]
    assert [2, 32] in shapes and [1, 8] in shapes, shapes
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
                       ({"model": "embed", "input": "x" * 80}, "80"),
                       ({"model": "embed", "input": []}, "a list of up to"),
                       ({"model": "embed", "input": "a", "dimensions": 8}, "dimensions"),
                       ({"model": "embed", "input": "a", "encoding_format": "hex"}, "float")):
        code, body = post(lm_daemon.http, "/v1/embeddings", doc)
        assert code == 400 and words in json.loads(body)["error"]["message"], (doc, body)
