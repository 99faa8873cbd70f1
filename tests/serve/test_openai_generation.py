"""OpenAI's routes for generation (cuvild/serve/generate_http.py), as its own SDK and
lm-evaluation-harness call them: model lists and errors, logprobs and penalties, `n` choices,
several prompts with `echo`, on test_generation.py's daemon (tests/serve/conftest.py
`lm_daemon`: the tiny Llama with a tokenizer, GPT-2 without one)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lm_models
import numpy as np
import pytest
import torch
from generation_helpers import (
    BYTES_CONTEXT,
    ENCODERS,
    PROMPT,
    WORDS,
    byte_tokenizer_json,
    events,
    post,
    transformers_greedy,
    transformers_loglikelihood,
)

from cuvild.client import Client
from cuvild.serve.structured import JSON_LAYOUT


def test_n_choices_a_prompt_each_its_own_sequence(lm_daemon, lm_served) -> None:  # noqa: ANN001
    """OpenAI's `n`: greedy, every choice transformers' tokens; sampled with a seed, choice j
    what n 1 with seed + j gives (vLLM's rule), so they differ, streamed too; several
    prompts' choices indexed prompt * n + j, the usage counting each prompt once; a chat's."""
    hf, other = lm_served["hf"]["llama"], [5, 17, 42]
    status, body = post(lm_daemon.http, "/v1/completions", {
        "model": "llama", "prompt": [PROMPT, other], "max_tokens": 6, "temperature": 0, "n": 3})
    assert status == 200, body
    doc = json.loads(body)
    assert [c["index"] for c in doc["choices"]] == list(range(6))
    assert [c["token_ids"] for c in doc["choices"]] == (
        [lm_models.reference(hf, PROMPT, 6)] * 3 + [lm_models.reference(hf, other, 6)] * 3)
    assert doc["usage"] == {"prompt_tokens": 7, "completion_tokens": 36, "total_tokens": 43,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    sampled = {"model": "llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0,
               "seed": 11}
    choices = [c["token_ids"] for c in json.loads(post(lm_daemon.http, "/v1/completions", {
        **sampled, "n": 4})[1])["choices"]]
    for j, got in enumerate(choices):
        alone = json.loads(post(lm_daemon.http, "/v1/completions", {**sampled, "seed": 11 + j})[1])
        assert alone["choices"][0]["token_ids"] == got, j
    assert len({tuple(c) for c in choices}) > 1, choices
    # (the prompt ran once, the others started from a copy of its state: their tokens are
    # those of requests that ran it each)
    assert "a prompt of 4 tokens ran once for 4 choices" in lm_daemon.log()
    chunks = events(post(lm_daemon.http, "/v1/completions", {  # streamed: interleaved by index
        **sampled, "n": 4, "stream": True, "stream_options": {"include_usage": True}})[1])
    streamed = [[t for c in chunks[:-2] for t in c["choices"][0]["token_ids"]
                 if c["choices"][0]["index"] == j] for j in range(4)]
    assert streamed == choices and chunks[-1] == "[DONE]"
    made = sum(map(len, choices))  # (8 each, but where one met the eos token: "stop")
    assert sum(c["choices"][0]["finish_reason"] in ("length", "stop") for c in chunks[:-2]) == 4
    assert chunks[-2]["usage"] == {"prompt_tokens": 4, "completion_tokens": made,
                                   "total_tokens": 4 + made,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    status, body = post(lm_daemon.http, "/v1/chat/completions", {
        "model": "llama", "messages": [{"role": "user", "content": "w5 w17"}], "n": 2,
        "max_tokens": 4, "temperature": 0})
    doc = json.loads(body)
    assert status == 200 and [c["index"] for c in doc["choices"]] == [0, 1], body
    assert doc["choices"][0]["message"] == doc["choices"][1]["message"]
    assert doc["usage"]["prompt_tokens"] == 5  # "w4 w1 w5 w17 w2", once
    status, body = post(lm_daemon.http, "/v1/completions", {  # the first fails: all answer
        "model": "llama", "prompt": list(range(lm_models.CONTEXT)), "n": 3, "stream": True})
    assert status == 400 and b"the model's context is 64" in body, body
    for bad, said in ((0, "n must be an integer from 1 to 128"), (129, "from 1 to 128"),
                      ("2", "got \"2\"")):
        status, body = post(lm_daemon.http, "/v1/completions",
                            {"model": "llama", "prompt": PROMPT, "n": bad})
        assert status == 400 and said in json.loads(body)["error"]["message"], body


def test_openais_own_client_lists_generates_and_reads_the_errors(lm_daemon, lm_served) -> None:  # noqa: ANN001
    """OpenAI's Python SDK, as a user of vLLM (or of KServe, /openai/v1) would point it at
    cuvild: the models that generate listed, a completion and a chat as transformers' tokens,
    a stream that ends with its usage (stream_options), fields that ask for nothing taken and
    the same fields asking for something refused; its errors (OpenAI's error object) read."""
    import openai

    client = openai.OpenAI(base_url=f"http://{lm_daemon.http}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    def lms(models: Any) -> dict[str, int]:  # (the encoders, listed once READY: test_embeddings)
        return {m.id: m.model_extra["max_model_len"] for m in models
                if m.id.partition(":")[0] not in ENCODERS}

    listed = lms(client.models.list())
    assert listed == {**{n: lm_models.CONTEXT for n in ("chunked", "chunked:1", "gpt2",
                                                        "gpt2:1", "llama", "llama:1")},
                      "bytes": BYTES_CONTEXT, "bytes:1": BYTES_CONTEXT}
    assert client.models.retrieve("llama:1").id == "llama:1"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope")
    assert missing.value.body["type"] == "invalid_request_error"
    assert "'nope'" in missing.value.body["message"]
    want = lm_models.reference(lm_served["hf"]["llama"], PROMPT, 6)
    words = " ".join(WORDS[t] for t in PROMPT)
    done = client.completions.create(model="llama", prompt=words, max_tokens=6, temperature=0,
                                     frequency_penalty=0, presence_penalty=0.0, echo=False)
    assert done.choices[0].text.split() == [WORDS[t] for t in want]
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (4, 6)
    chunks = list(client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": words}], max_tokens=3,
        stream=True, stream_options={"include_usage": True}, logprobs=False))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    said = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == len(said.split()) <= 3
    assert chunks[-1].usage.prompt_tokens == 7  # "w4 w1 <4 words> w2", the template's
    for asked, why in (({"frequency_penalty": 2.5}, "frequency_penalty must be a number in "
                                                    "[-2, 2]"),
                       ({"top_logprobs": 2}, "top_logprobs needs \"logprobs\": true"),
                       ({"logprobs": True, "top_logprobs": 21}, "from 0 to 20"),
                       ({"stream_options": {"include_usage": True}}, "only allowed with"),
                       ({"n": 0}, "n must be an integer from 1")):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": words}], **asked)
        assert why in bad.value.body["message"], asked
    with pytest.raises(openai.BadRequestError, match="unsupported fields \\['suffix'\\]"):
        client.completions.create(model="llama", prompt=words, suffix=" the end")
    with pytest.raises(openai.NotFoundError, match="unknown model 'nope'"):
        client.completions.create(model="nope", prompt=words)
    # where KServe's model server has them (its docs' base_url for an InferenceService)
    kserve = openai.OpenAI(base_url=f"http://{lm_daemon.http}/openai/v1", api_key="unused",
                           max_retries=0, timeout=120)
    assert lms(kserve.models.list()) == listed
    assert kserve.completions.create(model="llama", prompt=words, max_tokens=6,
                                     temperature=0).choices[0].text == done.choices[0].text


def test_a_chat_without_a_token_bound_answers_to_its_end(lm_daemon, lm_served) -> None:  # noqa: ANN001
    """OpenAI's chat (and vLLM's) bounds an answer by the context alone where its caller
    gives no max_tokens: until the eos token or the context's end, not a completion's 16."""
    import openai

    client = openai.OpenAI(base_url=f"http://{lm_daemon.http}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    prompt = [4, 1, *PROMPT, 2]  # the template's "w4 w1 <words> w2"
    full = lm_models.reference(lm_served["hf"]["llama"], prompt, lm_models.CONTEXT - len(prompt))
    want = full[:full.index(6) + 1] if 6 in full else full  # (6: its eos token)
    answer = client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": " ".join(WORDS[t] for t in PROMPT)}],
        temperature=0)
    assert answer.usage.completion_tokens == len(want) > 16, answer.usage
    assert answer.choices[0].finish_reason == ("stop" if 6 in full else "length")


def test_vllms_serving_benchmark_requests_are_served(lm_daemon, lm_served) -> None:  # noqa: ANN001
    """What vLLM's serving benchmark (`vllm bench serve`) sends, as it sends it: completions
    with `best_of` 1 and `ignore_eos`, streamed; a chat with `max_completion_tokens`,
    `include_usage` and `ignore_eos` (its answer past the eos token, where without it the
    eos token ends it, as a completion's); TensorRT-LLM's generate_stream with
    `accumulate_tokens` (each text_output the text so far). best_of other than n is
    refused."""
    hf = lm_served["hf"]["llama"]
    want = lm_models.reference(hf, PROMPT, 8)
    words = " ".join(WORDS[t] for t in PROMPT)
    status, body = post(lm_daemon.http, "/v1/completions", {
        "model": "llama", "prompt": words, "temperature": 0.0, "best_of": 1, "max_tokens": 8,
        "logprobs": None, "stream": True, "ignore_eos": False})
    assert status == 200, body
    assert [t for c in events(body)[:-1] for t in c["choices"][0]["token_ids"]] == want
    full = lm_models.reference(hf, [4, 1, 5, 2], 10)  # the chat of "w5": eos (6) 5th
    assert 6 in full[:5]
    for ignore in (True, False):
        status, body = post(lm_daemon.http, "/v1/chat/completions", {
            "model": "llama", "messages": [{"role": "user", "content": "w5"}],
            "temperature": 0.0, "max_completion_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore})
        chunks = events(body)
        said = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-2])
        made = full if ignore else full[:full.index(6) + 1]
        assert chunks[-2]["usage"]["completion_tokens"] == len(made), (ignore, chunks[-2])
        assert said.split() == [WORDS[t] for t in made], (ignore, said)
    status, body = post(lm_daemon.http, "/v2/models/llama/generate_stream", {
        "accumulate_tokens": True, "text_input": words, "temperature": 0.0, "top_p": 1.0,
        "ignore_eos": False, "stream": True, "max_tokens": 8})
    texts = [e["text_output"] for e in events(body)]
    assert texts[-1].split() == [WORDS[t] for t in want], texts
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False)), texts
    for ignore in (False, True):  # a completion ends at the entry's eos token too
        status, body = post(lm_daemon.http, "/v1/completions", {
            "model": "llama", "prompt": [4, 1, 5, 2], "temperature": 0.0, "max_tokens": 10,
            "ignore_eos": ignore})
        choice = json.loads(body)["choices"][0]
        assert choice["token_ids"] == (full if ignore else full[:full.index(6) + 1]), choice
        assert choice["finish_reason"] == ("length" if ignore else "stop")
        with Client(lm_daemon.target) as grpc_client:  # (and over gRPC, cuvilctl's path)
            assert [t["token_id"] for t in grpc_client.generate(
                "llama", [4, 1, 5, 2], max_tokens=10, ignore_eos=ignore)] == choice["token_ids"]
    status, body = post(lm_daemon.http, "/v1/completions",
                        {"model": "llama", "prompt": words, "best_of": 2})
    assert status == 400 and b"best_of must be n (1)" in body, body


def test_openai_logprobs_and_penalties_are_transformers_own(lm_daemon, lm_served) -> None:  # noqa: ANN001
    """`logprobs` through OpenAI's SDK: a completion's (tokens, token_logprobs, top_logprobs,
    text_offset), a chat's (each token's text, bytes, logprob and top_logprobs), streamed and
    not, each the log-softmax of transformers' logits at that step; frequency and presence
    penalties steer greedy tokens as OpenAI defines them, on every surface (OpenAI's and
    Triton's HTTP routes, the gRPC client, `cuvilctl generate`)."""
    import openai

    hf = lm_served["hf"]["llama"]
    client = openai.OpenAI(base_url=f"http://{lm_daemon.http}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    words = " ".join(WORDS[t] for t in PROMPT)
    want, scores = transformers_greedy(hf, PROMPT, 5)
    done = client.completions.create(model="llama", prompt=words, max_tokens=5, temperature=0,
                                     logprobs=3)
    got = done.choices[0].logprobs
    assert got.tokens == [WORDS[t] for t in want]
    for step, (token, logprob, top) in enumerate(zip(want, got.token_logprobs,
                                                     got.top_logprobs, strict=True)):
        assert logprob == pytest.approx(float(scores[step][token]), abs=1e-4)
        best = torch.topk(scores[step], 3)
        assert list(top) == [WORDS[int(i)] for i in best.indices]
        assert list(top.values()) == pytest.approx([float(v) for v in best.values], abs=1e-4)
    text = done.choices[0].text
    assert [text[at:].split()[0] for at in got.text_offset] == got.tokens
    # streamed: each chunk its own token's logprobs
    chunks = list(client.completions.create(model="llama", prompt=words, max_tokens=5,
                                            temperature=0, logprobs=0, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [lp.tokens[0] for lp in streamed] == got.tokens
    assert [lp.token_logprobs[0] for lp in streamed] == pytest.approx(got.token_logprobs,
                                                                       abs=1e-6)
    assert all(lp.top_logprobs == [{}] for lp in streamed)
    # a chat's, the template's prompt before it (transformers' log-softmax on that prompt)
    chat_prompt = [4, 1, *PROMPT, 2]  # "w4 w1 <words> w2"
    chat_want, chat_scores = transformers_greedy(hf, chat_prompt, 3)
    for stream in (False, True):
        answer = client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": words}], max_tokens=3,
            logprobs=True, top_logprobs=2, stream=stream)
        content = ([e for c in answer for e in (c.choices[0].logprobs.content
                                                if c.choices and c.choices[0].logprobs
                                                else [])]
                   if stream else answer.choices[0].logprobs.content)
        assert [e.token for e in content] == [WORDS[t] for t in chat_want[:len(content)]]
        assert content and content[0].bytes == list(WORDS[chat_want[0]].encode())
        for step, e in enumerate(content):
            assert e.logprob == pytest.approx(float(chat_scores[step][chat_want[step]]),
                                              abs=1e-4)
            assert [t.token for t in e.top_logprobs] == [
                WORDS[int(i)] for i in torch.topk(chat_scores[step], 2).indices]
    # penalties: greedy less them, as transformers' logits give it
    for frequency, presence in ((1.5, 0.0), (0.0, 2.0), (-1.0, 0.5)):
        penalised, _ = transformers_greedy(hf, PROMPT, 8, frequency, presence)
        done = client.completions.create(model="llama", prompt=PROMPT, max_tokens=8,
                                         temperature=0, frequency_penalty=frequency,
                                         presence_penalty=presence)
        assert done.choices[0].text.split() == [WORDS[t] for t in penalised], (frequency,
                                                                                 presence)
        status, body = post(lm_daemon.http, "/v2/models/llama/generate", {
            "input_ids": PROMPT, "max_tokens": 8, "frequency_penalty": frequency,
            "presence_penalty": presence})
        assert status == 200 and json.loads(body)["output_ids"] == penalised
        with Client(lm_daemon.target) as grpc_client:
            assert [t["token_id"] for t in grpc_client.generate(
                "llama", PROMPT, max_tokens=8, frequency_penalty=frequency,
                presence_penalty=presence)] == penalised
    done = subprocess.run([sys.executable, "-m", "cuvild.client.cli", "--target",
                           lm_daemon.target, "generate", "llama", "--ids",
                           ",".join(map(str, PROMPT)), "--max-tokens", "8",
                           "--frequency-penalty", "1.5", "--json"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["output_ids"] == transformers_greedy(hf, PROMPT, 8, 1.5)[0]
    assert transformers_greedy(hf, PROMPT, 8, 1.5)[0] != transformers_greedy(hf, PROMPT, 8)[0]
    # without a tokenizer a token is named by its id, as vLLM names it
    done = client.completions.create(model="gpt2", prompt=PROMPT, max_tokens=2,
                                     temperature=0, logprobs=1)
    gpt2 = lm_models.reference(lm_served["hf"]["gpt2"], PROMPT, 2)
    assert done.choices[0].logprobs.tokens == [f"token_id:{t}" for t in gpt2]


def test_logit_bias_steers_every_surface_as_openai_defines_it(lm_daemon, lm_served) -> None:  # noqa: ANN001
    """OpenAI's logit_bias ({token id: bias in [-100, 100]}, added to the logits before the
    pick, greedy too): -100 bans transformers' own greedy tokens, +bias favours another, the
    tokens those of a transformers loop applying the same rule, on OpenAI's and Triton's
    HTTP routes, the gRPC client and `cuvilctl generate`; bad biases refused naming them."""
    import openai

    hf = lm_served["hf"]["llama"]
    plain = transformers_greedy(hf, PROMPT, 6)[0]
    bias = {plain[0]: -100.0, plain[1]: -100.0, 7: 3.5}
    want = transformers_greedy(hf, PROMPT, 6, bias=bias)[0]
    assert want != plain and plain[0] not in want and plain[1] not in want
    client = openai.OpenAI(base_url=f"http://{lm_daemon.http}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    done = client.completions.create(model="llama", prompt=PROMPT, max_tokens=6, temperature=0,
                                     logit_bias={str(t): b for t, b in bias.items()})
    assert done.choices[0].text.split() == [WORDS[t] for t in want]
    status, body = post(lm_daemon.http, "/v2/models/llama/generate", {
        "input_ids": PROMPT, "max_tokens": 6, "logit_bias": {str(t): b for t, b in bias.items()}})
    assert status == 200 and json.loads(body)["output_ids"] == want, body
    with Client(lm_daemon.target) as grpc_client:
        assert [t["token_id"] for t in grpc_client.generate(
            "llama", PROMPT, max_tokens=6, logit_bias=bias)] == want
    done = subprocess.run([sys.executable, "-m", "cuvild.client.cli", "--target",
                           lm_daemon.target, "generate", "llama", "--ids",
                           ",".join(map(str, PROMPT)), "--max-tokens", "6", "--logit-bias",
                           ",".join(f"{t}:{b}" for t, b in bias.items()), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout)["output_ids"] == want, done.stderr
    for bad, said in (({"5": 101}, "numbers in [-100, 100], got 101"),
                      ({"x": 1}, "keys must be token ids, got 'x'"),
                      ({str(lm_models.VOCAB): 1}, "outside the vocabulary"),
                      ([5], "must be a map of token ids")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="llama", prompt=PROMPT, logit_bias=bad)
        assert said in refused.value.body["message"], bad


def test_lm_eval_harness_loglikelihood_requests_score_the_prompt(lm_daemon, lm_served) -> None:  # noqa: ANN001
    """What lm-evaluation-harness's `local-completions` model sends for a loglikelihood
    (multiple-choice) task: several prompts, each context + continuation as token ids, with
    `echo` and `logprobs` and one token to generate; read as it reads it (each choice's
    `token_logprobs[ctxlen:-1]` summed, greedy where each is its position's largest): the
    continuation's log-likelihood as transformers' logits give it, on a model exported for
    one token a step and on one whose prompt goes in chunks (every position's logits)."""
    hf = lm_served["hf"]["llama"]
    requests = [(PROMPT, [7, 19, 23]), ([3, 8], [13, 21, 34, 55, 89])]
    want = [transformers_loglikelihood(hf, c, k) for c, k in requests]
    for model in ("llama", "chunked"):
        status, body = post(lm_daemon.http, "/v1/completions", {
            "model": model, "prompt": [c + k for c, k in requests], "temperature": 0,
            "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
        assert status == 200, body
        answer = json.loads(body)
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        assert [c["index"] for c in choices] == [0, 1]
        got = []
        for choice, (context, continuation) in zip(choices, requests, strict=True):
            logprobs = choice["logprobs"]
            assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
            assert len(logprobs["tokens"]) == len(context) + len(continuation) + 1
            mine = logprobs["token_logprobs"][len(context):-1]
            tops = logprobs["top_logprobs"][len(context):-1]
            got.append((sum(mine), all(lp == max(top.values())
                                       for lp, top in zip(mine, tops, strict=True))))
            if model == "llama":  # (the entry with a tokenizer) the prompt echoed first
                assert choice["text"].split()[:len(context) + len(continuation)] == [
                    WORDS[t] for t in context + continuation]
                offsets, text = logprobs["text_offset"], choice["text"]
                assert [text[a:].split()[0] for a in offsets] == logprobs["tokens"]
        for (lp, greedy), (want_lp, want_greedy) in zip(got, want, strict=True):
            assert lp == pytest.approx(want_lp, abs=1e-3) and greedy == want_greedy, model
        assert answer["usage"]["prompt_tokens"] == sum(len(c + k) for c, k in requests)
    status, body = post(lm_daemon.http, "/v1/completions", {
        "model": "llama", "prompt": PROMPT, "echo": True, "stream": True})
    assert status == 400 and b"a stream takes one prompt, without echo" in body


def test_a_prompt_that_begins_as_an_earlier_one_runs_only_the_rest(lm_daemon, lm_served) -> None:  # noqa: ANN001
    """The prefix cache (cuvild/run/prefixes.py): a conversation's next turn takes its last
    turn's kept sequence, another question after the same first 18 tokens a copy cut back
    to them; each answers transformers' tokens on its whole prompt, token by token and in
    chunks, and the usage says how many prompt tokens were held; a chat's next turn too."""
    hf, first = lm_served["hf"]["llama"], list(range(40, 60))  # (20 tokens, this test's own)

    def completion(model: str, prompt: list[int]) -> tuple[list[int], int]:
        status, body = post(lm_daemon.http, "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": 4, "ignore_eos": True})
        assert status == 200, body
        doc = json.loads(body)
        return doc["choices"][0]["token_ids"], doc["usage"]["prompt_tokens_details"][
            "cached_tokens"]

    for model in ("llama", "chunked"):
        said, cached = completion(model, first)
        assert said == lm_models.reference(hf, first, 4) and cached == 0
        turn = first + said + [7, 8]
        assert completion(model, turn) == (lm_models.reference(hf, turn, 4), 23)
        other = first[:18] + [90, 91]
        assert completion(model, other) == (lm_models.reference(hf, other, 4), 18)
    question = {"role": "user", "content": " ".join(WORDS[40:60])}
    status, body = post(lm_daemon.http, "/v1/chat/completions", {
        "model": "llama", "messages": [question], "max_tokens": 4, "temperature": 0})
    answer = json.loads(body)["choices"][0]["message"]
    assert status == 200 and answer["role"] == "assistant", body
    status, body = post(lm_daemon.http, "/v1/chat/completions", {
        "model": "llama", "max_tokens": 4, "temperature": 0, "messages": [
            question, answer, {"role": "user", "content": "w61 w62"}]})
    usage = json.loads(body)["usage"]  # "w4 w1" and the 20 words held: "w3", not "w2", next
    assert status == 200 and usage["prompt_tokens_details"] == {"cached_tokens": 22}, body


def transformers_constrained(hf: Any, prompt: list[int], grammar: str, new: int) -> list[int]:
    """transformers' model run whole on the tokens so far, greedy among the tokens
    llguidance allows next (the test entry's byte-level tokenizer), until the grammar ends."""
    import llguidance

    tokenizer = llguidance.LLTokenizer(byte_tokenizer_json(), n_vocab=lm_models.VOCAB,
                                       eos_token=[1])
    matcher, ids, made = llguidance.LLMatcher(tokenizer, grammar), list(prompt), []
    with torch.no_grad():
        while len(made) < new and not matcher.is_stopped():
            bits = np.frombuffer(matcher.compute_bitmask(), np.uint8)
            allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:lm_models.VOCAB])
            logits = hf(torch.tensor([ids])).logits[0, -1]
            token = int(torch.argmax(logits.masked_fill(allowed == 0, -torch.inf)))
            assert matcher.consume_token(token), matcher.get_error()
            ids.append(token)
            made.append(token)
    return made


def test_structured_output_holds_the_answer_to_a_schema_a_regex_or_choices(
        lm_daemon, lm_served, tmp_path: Path) -> None:  # noqa: ANN001
    """OpenAI's response_format and vLLM's structured_outputs / guided_* (cuvild/serve/
    structured.py, llguidance): the answer is valid for its schema, regex or choices and
    ends where they do, greedy the tokens of transformers' model picking among the tokens
    llguidance allows, over HTTP, gRPC and cuvilctl; a schema that does not compile, a
    model without a tokenizer, two ways at once and an unknown format are refused, naming
    why."""
    import llguidance

    hf = lm_served["hf"]["llama"]
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "n": {"type": "integer", "maximum": 9}},
              "required": ["answer", "n"], "additionalProperties": False}
    asks = [({"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "a", "schema": schema}}},
             llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)),
            ({"structured_outputs": {"regex": "[a-f]{3}-[0-9]"}},
             llguidance.grammar_from("regex", "[a-f]{3}-[0-9]")),
            ({"guided_choice": ["red", "green", "blue"]},
             llguidance.grammar_from("choice", ["red", "green", "blue"]))]
    prompt = [40, 41, 66, 3]
    for ask, grammar in asks:
        status, body = post(lm_daemon.http, "/v1/completions", {
            "model": "bytes", "prompt": prompt, "max_tokens": 40, **ask})
        assert status == 200, body
        choice = json.loads(body)["choices"][0]
        assert choice["token_ids"] == transformers_constrained(hf, prompt, grammar, 40), ask
        assert choice["finish_reason"] == "stop", choice
        text = choice["text"]
        if "response_format" in ask:
            answer = json.loads(text)  # (laid out as json.dumps lays it out)
            assert answer["answer"] in ("yes", "no") and 0 <= answer["n"] <= 9, text
            assert text == json.dumps(answer), text
        else:
            assert re.fullmatch("[a-f]{3}-[0-9]|red|green|blue", text), text
    # over gRPC (Client.generate(structured=...)) and `cuvilctl generate --json-schema`
    with Client(lm_daemon.target) as client:
        got = [t["token_id"] for t in client.generate(
            "bytes", prompt, max_tokens=40, structured={"choice": ["red", "green", "blue"]})]
    assert got == transformers_constrained(hf, prompt, asks[2][1], 40)
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    done = subprocess.run([sys.executable, "-m", "cuvild.client.cli", "--target",
                           lm_daemon.target, "generate", "bytes", "--ids", "40,41,66,3",
                           "--max-tokens", "40", "--json-schema", str(tmp_path / "schema.json"),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["output_ids"] == transformers_constrained(
        hf, prompt, asks[0][1], 40)
    for ask, said in (
            ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "a", "schema": {"type": "nonsense"}}}}, "nonsense"),
            ({"model": "gpt2", "response_format": {"type": "json_object"}}, "has no tokenizer"),
            ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
             "one way of structuring"),
            ({"response_format": {"type": "yaml"}}, "response_format must be")):
        status, body = post(lm_daemon.http, "/v1/completions",
                            {"model": "bytes", "prompt": prompt, **ask})
        assert status == 400 and said in json.loads(body)["error"]["message"], body


def test_a_chat_calls_the_tools_its_choice_holds_it_to(lm_daemon) -> None:  # noqa: ANN001
    """tool_choice naming a function, or "required" (cuvild/serve/tools.py): the answer is
    held to the calls' schemas by structured output and comes back as OpenAI's `tool_calls`
    (finish reason "tool_calls"), as the OpenAI SDK reads them; the tools are in the prompt
    (the template renders them: more prompt tokens), an earlier call and its answer too;
    streamed, a named or required call's arguments come as they are written."""
    import openai

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}},
        "required": ["unit", "days"], "additionalProperties": False}}}
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}
    client = openai.OpenAI(base_url=f"http://{lm_daemon.http}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What is the weather?"}]
    named = client.chat.completions.create(
        model="bytes", messages=question, tools=[weather, clock], max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["unit"] in ("c", "f")
    assert 1 <= arguments["days"] <= 7 and call.id.startswith("call_")
    required = client.chat.completions.create(
        model="bytes", messages=question, tools=[weather, clock], max_tokens=200,
        tool_choice="required", parallel_tool_calls=False)
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time"), call
    assert set(json.loads(call.function.arguments)) <= {"unit", "days", "zone"}
    plain = client.chat.completions.create(model="bytes", messages=question, max_tokens=2)
    told = client.chat.completions.create(model="bytes", messages=question, max_tokens=2,
                                          tools=[weather], tool_choice="none")
    assert told.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert told.choices[0].message.tool_calls is None
    later = [*question, {"role": "assistant", "content": None, "tool_calls": [
        call.model_dump(include={"id", "type", "function"})]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    after = client.chat.completions.create(model="bytes", messages=later, max_tokens=2)
    assert after.usage.prompt_tokens > plain.usage.prompt_tokens + len(call.function.arguments)
    chunks = list(client.chat.completions.create(  # streamed: the arguments as they come
        model="bytes", messages=question, tools=[weather, clock], max_tokens=60, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [c.choices[0].delta for c in chunks]
    assert not "".join(d.content or "" for d in deltas)
    parts = [t for d in deltas for t in d.tool_calls or []]
    assert len(parts) > 3 and {t.index for t in parts} == {0}
    assert parts[0].function.name == "get_weather" and parts[0].id.startswith("call_")
    assert all(t.id is None and t.function.name is None for t in parts[1:])
    assert "".join(t.function.arguments for t in parts) == (
        named.choices[0].message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(  # "required" too: each call as it comes
        model="bytes", messages=question, tools=[weather, clock], max_tokens=200, stream=True,
        tool_choice="required", parallel_tool_calls=False))
    parts = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert len(parts) > 3 and parts[0].function.name == call.function.name
    assert "".join(t.function.arguments for t in parts) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_vllms_repetition_penalty_min_tokens_and_min_p(lm_daemon, lm_served) -> None:  # noqa: ANN001
    """vLLM's sampling fields: repetition_penalty gives transformers' generate(
    repetition_penalty=...) tokens (the prompt's and the output's logits divided or
    multiplied); min_tokens holds the eos token off that long (here pushed by a bias: it
    comes at once after); values out of range are refused naming them."""
    hf = lm_served["hf"]["llama"]
    prompt = [5, 17, 42, 99, 5, 17]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                           do_sample=False, repetition_penalty=1.8, pad_token_id=0)
    status, body = post(lm_daemon.http, "/v1/completions", {
        "model": "llama", "prompt": prompt, "max_tokens": 12, "repetition_penalty": 1.8,
        "ignore_eos": True})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["token_ids"] == want[0, len(prompt):].tolist()
    eos = 6  # (the entry's tokenizer_config.json: "w6")
    for least, made in ((0, 1), (3, 4)):
        status, body = post(lm_daemon.http, "/v1/completions", {
            "model": "llama", "prompt": prompt, "max_tokens": 8, "min_tokens": least,
            "logit_bias": {str(eos): 100}, "min_p": 0.1})
        ids = json.loads(body)["choices"][0]["token_ids"]
        assert status == 200 and len(ids) == made and ids[-1] == eos, body
        assert ids[:-1] == transformers_greedy(hf, prompt, least, bias={eos: -100})[0]
    for bad, said in (({"repetition_penalty": 0}, "repetition_penalty must be"),
                      ({"min_p": 1.5}, "min_p must be"),
                      ({"min_tokens": 9, "max_tokens": 8}, "min_tokens must be")):
        status, body = post(lm_daemon.http, "/v1/completions",
                            {"model": "llama", "prompt": prompt, **bad})
        assert status == 400 and said in json.loads(body)["error"]["message"], body

