"""Generation served (cuvild/serve/generation.py, generate_http.py): a tiny random-weight
Llama from the model repository, with a tokenizer.json beside it, and a GPT-2 without one,
generate token for token as transformers' own `generate` through the Python client (gRPC
streaming), Triton's generate_stream (server-sent events), OpenAI's /v1/completions and
/v1/chat/completions (the entry's chat template) and `cuvilctl generate`; a model that does
not generate, a bad option and a prompt over the context are refused with clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lm_models
import pytest
import torch
from daemons import DaemonProcess, free_port, suite_config
from generation_helpers import (
    PROMPT,
    WORDS,
    all_ready,
    events,
    lm_repository,
    post,
    transformers_greedy,
    transformers_loglikelihood,
)

from cuvild.client import Client
from cuvild.client.errors import CuvildError


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lm-repo")
    return {"root": root, "hf": lm_repository(root)}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, state_root: Path, sock_dir: Path,
           shared_cache: Path, served: dict[str, Any]) -> Iterator[DaemonProcess]:
    """One daemon for the file's tests (each starts its own sequences; none changes what is
    served): its three models build once."""
    http = f"127.0.0.1:{free_port()}"
    torch_too = {"cpu": ["openvino", "torch"], "npu": ["openvino", "torch"]}
    workdir = tmp_path_factory.mktemp("generation")
    config = suite_config(workdir, workdir / "state", sock_dir, cache_dir=str(shared_cache),
                          model_repository=str(served["root"]), engine={"runtimes": torch_too},
                          listen={"http": http, "insecure_loopback": True})
    d = DaemonProcess(workdir, config, profiles=state_root).start()
    d.http = http
    try:
        all_ready(d.target, ("gpt2", "llama", "chunked"))
        yield d
    finally:
        d.close()


def test_every_surface_generates_as_transformers(daemon, served) -> None:  # noqa: ANN001
    want = {f: lm_models.reference(served["hf"][f], PROMPT, 8) for f in ("llama", "gpt2")}
    text = " ".join(WORDS[t] for t in PROMPT)
    with Client(daemon.target) as client:
        for family in ("llama", "gpt2"):  # the Python client: gRPC streaming
            got = [t["token_id"] for t in client.generate(family, PROMPT, max_tokens=8)]
            assert got == want[family], family
        out = list(client.generate("llama", text=text, max_tokens=8))
        assert [t["token_id"] for t in out] == want["llama"]
        assert "".join(t["text"] for t in out).split() == [WORDS[t] for t in want["llama"]]
        with pytest.raises(CuvildError, match="has no tokenizer"):
            list(client.generate("gpt2", text=text))
        long = [5, 17, 42, 99, 3, 8, 13, 21, 34, 55, 89]  # 8 + 1 + 1 + 1 in three buckets
        got = [t["token_id"] for t in client.generate("chunked", long, max_tokens=6)]
        assert got == lm_models.reference(served["hf"]["llama"], long, 6)
    status, body = post(daemon.http, "/v2/models/gpt2/generate_stream",
                        {"input_ids": PROMPT, "max_tokens": 8})
    assert status == 200
    assert [e["output_ids"][0] for e in events(body)] == want["gpt2"]
    status, body = post(daemon.http, "/v2/models/llama/generate",
                        {"text_input": text, "parameters": {"max_tokens": 8}})
    assert status == 200, body
    doc = json.loads(body)
    assert doc["output_ids"] == want["llama"] and doc["model_name"] == "llama"
    assert doc["text_output"].split() == [WORDS[t] for t in want["llama"]]
    status, body = post(daemon.http, "/v1/completions",
                        {"model": "llama", "prompt": text, "max_tokens": 8,
                         "temperature": 0})
    assert status == 200, body
    doc = json.loads(body)
    assert doc["choices"][0]["text"].split() == [WORDS[t] for t in want["llama"]]
    assert doc["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}
    status, body = post(daemon.http, "/v1/completions",
                        {"model": "llama", "prompt": text, "max_tokens": 8, "stream": True})
    streamed = events(body)
    assert streamed[-1] == "[DONE]" and streamed[-2]["choices"][0]["finish_reason"] == "length"
    assert [e["choices"][0]["token_ids"][0] for e in streamed[:-2]] == want["llama"]
    done = subprocess.run([sys.executable, "-m", "cuvild.client.cli", "--target",
                           daemon.target, "generate", "gpt2", "--ids", "5,17,42,99",
                           "--max-tokens", "8", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["output_ids"] == want["gpt2"]


def test_a_language_model_is_built_for_generation_before_it_is_ready(daemon) -> None:  # noqa: ANN001
    """engine.sequences.warm_up (on by default): a dynamic-length model's decode step
    and its twin's longest prompt chunk (16 tokens: the longest of 128, 64, 16, 4 within its
    63) are built while it loads, and its decode step run on a sequence of the load's own
    (compiled then, where steps are compiled: not in the suite), so its first generation
    builds nothing (cuvild/load/warmup.py)."""
    said = daemon.log_path.read_text()
    assert ("built its decode step; built its 16-token prompt chunk; decode step eager "
            "(engine.sequences.compile_steps is off)" in said), said[-3000:]
    ready = said.index("model chunked:1 ready in")
    assert said.index("building chunked:1@last for input shapes [[1, 16], [16]]") < ready
    assert said.index("building chunked:1 for input shapes [[1, 1], [1]]") < ready


def test_the_plan_says_how_each_decode_step_runs(daemon) -> None:  # noqa: ANN001
    """`cuvilctl partition` asks the part's worker how its decode step runs now (compiled by
    inductor or eager, and why: runtimes/compiled_step.py; the suite's daemons compile none),
    and gives the generation the plan was priced for."""
    off = "decode step eager (engine.sequences.compile_steps is off)"
    with Client(daemon.target) as client:
        list(client.generate("chunked", PROMPT, max_tokens=2))  # (its decode step has run)
        buckets = client.plan("chunked")["plan"]["buckets"]
        static = client.plan("llama")
    steps = {tuple(map(tuple, b["shapes"])): [p.get("step") for p in b["parts"]]
             for b in buckets}
    # one token a step: the decode step (of each part that keeps state, where the plan split
    # the model); a prompt's chunk none
    assert off in steps[((1, 1), (1,))] and set(steps[((1, 1), (1,))]) <= {off, None}, steps
    assert all(set(s) == {None} for shapes, s in steps.items() if shapes[0] != (1, 1)), steps
    assert off in [m.get("step") for m in static["measured"].values()], static["measured"]
    assert f": {off}" in static["explain"]
    done = subprocess.run([sys.executable, "-m", "cuvild.client.cli", "--target",
                           daemon.target, "partition", "chunked"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and f": {off}" in done.stdout, done.stdout + done.stderr
    # the plan was priced for a generation: a prompt in one run (the longest the program
    # takes), then decode steps (partitioner/phases.py)
    assert "priced for a 63-token prompt in one run, then 128 decode step(s)" in done.stdout
    assert "priced for a 128-token prompt token by token" in static["explain"]


def test_sampling_is_repeatable_with_a_seed(daemon) -> None:  # noqa: ANN001
    with Client(daemon.target) as client:
        runs = [[t["token_id"] for t in client.generate(
            "llama", PROMPT, max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=7)]
            for _ in range(2)]
        assert runs[0] == runs[1] and len(runs[0]) == 8
        stopped = [t["token_id"] for t in client.generate("llama", PROMPT, max_tokens=8,
                                                          stop=[runs[0][0]], temperature=0.9,
                                                          top_k=20, top_p=0.9, seed=7)]
        assert stopped == runs[0][:1]  # the stop token ends it (and is sent)


def test_n_choices_a_prompt_each_its_own_sequence(daemon, served) -> None:  # noqa: ANN001
    """OpenAI's `n`: greedy, every choice transformers' tokens; sampled with a seed, choice j
    what n 1 with seed + j gives (vLLM's rule), so they differ, streamed too; several
    prompts' choices indexed prompt * n + j, the usage counting each prompt once; a chat's."""
    hf, other = served["hf"]["llama"], [5, 17, 42]
    status, body = post(daemon.http, "/v1/completions", {
        "model": "llama", "prompt": [PROMPT, other], "max_tokens": 6, "temperature": 0, "n": 3})
    assert status == 200, body
    doc = json.loads(body)
    assert [c["index"] for c in doc["choices"]] == list(range(6))
    assert [c["token_ids"] for c in doc["choices"]] == (
        [lm_models.reference(hf, PROMPT, 6)] * 3 + [lm_models.reference(hf, other, 6)] * 3)
    assert doc["usage"] == {"prompt_tokens": 7, "completion_tokens": 36, "total_tokens": 43}
    sampled = {"model": "llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0,
               "seed": 11}
    choices = [c["token_ids"] for c in json.loads(post(daemon.http, "/v1/completions", {
        **sampled, "n": 4})[1])["choices"]]
    for j, got in enumerate(choices):
        alone = json.loads(post(daemon.http, "/v1/completions", {**sampled, "seed": 11 + j})[1])
        assert alone["choices"][0]["token_ids"] == got, j
    assert len({tuple(c) for c in choices}) > 1, choices
    chunks = events(post(daemon.http, "/v1/completions", {  # streamed: interleaved by index
        **sampled, "n": 4, "stream": True, "stream_options": {"include_usage": True}})[1])
    streamed = [[t for c in chunks[:-2] for t in c["choices"][0]["token_ids"]
                 if c["choices"][0]["index"] == j] for j in range(4)]
    assert streamed == choices and chunks[-1] == "[DONE]"
    assert sum(c["choices"][0]["finish_reason"] == "length" for c in chunks[:-2]) == 4
    assert chunks[-2]["usage"] == {"prompt_tokens": 4, "completion_tokens": 32,
                                   "total_tokens": 36}
    status, body = post(daemon.http, "/v1/chat/completions", {
        "model": "llama", "messages": [{"role": "user", "content": "w5 w17"}], "n": 2,
        "max_tokens": 4, "temperature": 0})
    doc = json.loads(body)
    assert status == 200 and [c["index"] for c in doc["choices"]] == [0, 1], body
    assert doc["choices"][0]["message"] == doc["choices"][1]["message"]
    assert doc["usage"]["prompt_tokens"] == 5  # "w4 w1 w5 w17 w2", once
    for bad, said in ((0, "n must be an integer from 1 to 128"), (129, "from 1 to 128"),
                      ("2", "got \"2\"")):
        status, body = post(daemon.http, "/v1/completions",
                            {"model": "llama", "prompt": PROMPT, "n": bad})
        assert status == 400 and said in json.loads(body)["error"]["message"], body


def test_bad_requests_are_refused_clearly(daemon, served) -> None:  # noqa: ANN001
    status, body = post(daemon.http, "/v2/models/llama/generate",
                        {"input_ids": PROMPT, "temprature": 1})
    assert status == 400 and b"unknown fields ['temprature']" in body
    status, body = post(daemon.http, "/v2/models/llama/generate",
                        {"input_ids": list(range(lm_models.CONTEXT))})
    assert status == 400 and b"the model's context is 64" in body
    status, body = post(daemon.http, "/v2/models/llama/generate",
                        {"input_ids": PROMPT, "top_p": 0})
    assert status == 400 and b"top_p must be in (0, 1]" in body
    status, body = post(daemon.http, "/v2/models/nope/generate", {"input_ids": PROMPT})
    assert status == 404
    with Client(daemon.target) as client:
        with pytest.raises(CuvildError, match="vocabulary"):
            list(client.generate("llama", [lm_models.VOCAB + 5]))
        with pytest.raises(CuvildError, match="checked per input shape") as refused:
            client.compare("chunked")  # (not a status to retry on: it never will have one)
        assert refused.value.code == "FAILED_PRECONDITION"
        assert any(n.startswith("stateful: ") for n in client.plan("llama")["plan"]["notes"])
        client.load("mlp", torch.nn.Linear(8, 8).eval(), (torch.randn(1, 8),),
                    precision="fp32", timeout=300)
        with pytest.raises(CuvildError, match="mlp:1 does not generate"):
            list(client.generate("mlp", PROMPT))


def test_generations_count_as_requests_with_their_tokens_and_times(daemon) -> None:  # noqa: ANN001
    """Every generation is a request in the metrics (success, or failure by status: a caller
    gone is CANCELLED, an unknown model counts under model ""), with vLLM's token figures:
    prompt and generated tokens, time to the first token and between the others; cuvilctl
    stats shows them."""
    import re

    def scrape() -> dict[str, float]:
        with urllib.request.urlopen(f"http://{daemon.http}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines()
                                            if line and not line.startswith("#"))}

    def of(samples: dict[str, float], name: str, **labels: str) -> float:
        return sum(v for k, v in samples.items() if k.partition("{")[0] == name and all(
            dict(re.findall(r'(\w+)="([^"]*)"', k)).get(n) == w for n, w in labels.items()))

    llama = {"model": "llama", "version": "1"}
    before = scrape()
    with Client(daemon.target) as client:
        assert len(list(client.generate("llama", PROMPT, max_tokens=5))) == 5
        tokens = client.generate("llama", PROMPT, max_tokens=lm_models.CONTEXT - len(PROMPT))
        next(tokens)
        tokens.close()  # the caller leaves after its first token
        with pytest.raises(CuvildError, match="unknown model"):
            list(client.generate("nope", PROMPT))
        deadline = time.monotonic() + 30  # (the daemon sees the caller gone at its next token)
        while of(after := scrape(), "cuvil_inference_request_failure_total", code="CANCELLED",
                 **llama) == of(before, "cuvil_inference_request_failure_total",
                                code="CANCELLED", **llama):
            assert time.monotonic() < deadline, "the cancelled generation was not counted"
            time.sleep(0.1)
        stats = client.stats(0.1)["models"]["llama:1"]

    def grew(name: str, **labels: str) -> float:
        return of(after, name, **labels) - of(before, name, **labels)

    assert grew("cuvil_inference_request_success_total", **llama) == 1
    assert grew("cuvil_inference_request_failure_total", model="", code="NOT_FOUND") == 1
    assert grew("cuvil_generation_prompt_tokens_total", **llama) == 2 * len(PROMPT)
    assert grew("cuvil_generation_time_to_first_token_seconds_count", **llama) == 2
    made = grew("cuvil_generation_tokens_total", **llama)
    assert 6 <= made < lm_models.CONTEXT  # 5, and the left one's 1 and those made meanwhile
    assert grew("cuvil_generation_inter_token_latency_seconds_count", **llama) == made - 2
    assert grew("cuvil_inference_request_duration_seconds_count", **llama) == 1
    assert stats["tokens"] >= made and stats["first_token_ms"]["p50"] > 0
    assert stats["inter_token_ms"]["n"] >= made - 2


def test_triton_sequence_parameters_step_the_model_on_its_state(daemon, served) -> None:  # noqa: ANN001
    """Raw steps over the protocol's infer, as a Triton client drives a stateful model:
    sequence_id / sequence_start / sequence_end; the argmax of each step's logits is the
    greedy token; a step after the end, an unknown id and a sequence on a stateless model
    are refused."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    want = lm_models.reference(served["hf"]["llama"], PROMPT, 3)
    names = {i["name"] for i in Client(daemon.target).metadata("llama")["inputs"]}
    assert names == {"input_ids", "cache_position"}

    def step(triton: Any, token: int, position: int, **seq: Any) -> int:
        ids = grpcclient.InferInput("input_ids", [1, 1], "INT64")
        ids.set_data_from_numpy(np.array([[token]], np.int64))
        pos = grpcclient.InferInput("cache_position", [1], "INT64")
        pos.set_data_from_numpy(np.array([position], np.int64))
        out = triton.infer("llama", [ids, pos], **seq).as_numpy("output0")
        return int(out.reshape(-1)[-out.shape[-1]:].argmax())

    with grpcclient.InferenceServerClient(url=daemon.target) as triton:
        got, token = [], None
        for position, token in enumerate(PROMPT):
            nxt = step(triton, token, position, sequence_id=42, sequence_start=position == 0)
        got.append(nxt)
        for position in range(len(PROMPT), len(PROMPT) + 2):
            last = position == len(PROMPT) + 1
            nxt = step(triton, got[-1], position, sequence_id=42, sequence_end=last)
            got.append(nxt)
        assert got == want
        with pytest.raises(Exception, match="sequence '42' of model llama:1: ended"):
            step(triton, 1, 0, sequence_id=42)
        with pytest.raises(Exception, match="unknown"):
            step(triton, 1, 0, sequence_id=7)


def test_chat_completions_render_the_entrys_template_and_stop_strings_end_text(
        daemon, served) -> None:  # noqa: ANN001
    """/v1/chat/completions: the prompt by the entry's chat template (its bos token, the
    turn markers), the answer until its eos token (and so over gRPC and `cuvilctl generate
    --chat`); stop strings end a completion's text
    before them; a model without a template, and bad messages, are refused."""
    hf = served["hf"]["llama"]
    words = " ".join(WORDS[t] for t in PROMPT)
    ids = [4, 1, *PROMPT, 2]  # "w4 w1 w5 w17 w42 w99 w2"
    want = lm_models.reference(hf, ids, 8)
    want = want[:want.index(6) + 1] if 6 in want else want  # the eos token ends it
    doc = {"model": "llama", "messages": [{"role": "user", "content": words}],
           "max_completion_tokens": 8}
    status, body = post(daemon.http, "/v1/chat/completions", doc)
    assert status == 200, body
    answer = json.loads(body)
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["choices"][0]["message"]["content"].split() == [WORDS[t] for t in want]
    assert answer["usage"]["prompt_tokens"] == len(ids)
    status, body = post(daemon.http, "/v1/chat/completions", {**doc, "stream": True})
    chunks = events(body)
    assert status == 200 and chunks[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text.split() == [WORDS[t] for t in want]
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    # the same chat over gRPC (Client.generate(messages=...)) and `cuvilctl generate --chat`
    with Client(daemon.target) as client:
        got = [t["token_id"] for t in client.generate("llama", messages=doc["messages"],
                                                      max_tokens=8)]
    assert got == want
    done = subprocess.run([sys.executable, "-m", "cuvild.client.cli", "--target",
                           daemon.target, "generate", "llama", words, "--chat",
                           "--max-tokens", "8", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["output_ids"] == want
    # a stop string: the text ends before it, finish_reason "stop"
    plain = lm_models.reference(hf, PROMPT, 8)
    cut = plain.index(plain[2])
    status, body = post(daemon.http, "/v1/completions", {
        "model": "llama", "prompt": words, "max_tokens": 8, "stop": [WORDS[plain[2]]]})
    assert status == 200, body
    answer = json.loads(body)["choices"][0]
    assert answer["text"].split() == [WORDS[t] for t in plain[:cut]]
    assert answer["finish_reason"] == "stop"
    # streamed, a stop string of two tokens: its first is held back, never sent
    first = plain.index(plain[1])
    status, body = post(daemon.http, "/v1/completions", {
        "model": "llama", "prompt": words, "max_tokens": 8, "stream": True,
        "stop": [f"{WORDS[plain[1]]} {WORDS[plain[2]]}"]})
    chunks = events(body)
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert status == 200 and text.split() == [WORDS[t] for t in plain[:first]], chunks
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    status, body = post(daemon.http, "/v1/chat/completions", {**doc, "model": "gpt2"})
    assert status == 400 and b"gpt2:1 has no chat template" in body
    status, body = post(daemon.http, "/v1/chat/completions", {**doc, "messages": []})
    assert status == 400 and b"messages must be a non-empty list" in body
    status, body = post(daemon.http, "/v1/chat/completions",
                        {**doc, "messages": [{"role": "wizard", "content": "w5"}]})
    assert status == 400 and b"messages[0]" in body
    status, body = post(daemon.http, "/v1/completions",
                        {"model": "gpt2", "prompt": PROMPT, "stop": ["w5"]})
    assert status == 400 and b"stop strings need one" in body


def test_openais_own_client_lists_generates_and_reads_the_errors(daemon, served) -> None:  # noqa: ANN001
    """OpenAI's Python SDK, as a user of vLLM (or of KServe, /openai/v1) would point it at
    cuvild: the models that generate listed, a completion and a chat as transformers' tokens,
    a stream that ends with its usage (stream_options), fields that ask for nothing taken and
    the same fields asking for something refused; its errors (OpenAI's error object) read."""
    import openai

    client = openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    listed = {m.id: m.model_extra["max_model_len"] for m in client.models.list()}
    assert listed == {n: lm_models.CONTEXT for n in ("chunked", "chunked:1", "gpt2",
                                                     "gpt2:1", "llama", "llama:1")}
    assert client.models.retrieve("llama:1").id == "llama:1"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope")
    assert missing.value.body["type"] == "invalid_request_error"
    assert "'nope'" in missing.value.body["message"]
    want = lm_models.reference(served["hf"]["llama"], PROMPT, 6)
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
    with pytest.raises(openai.BadRequestError, match="unsupported fields \\['best_of'\\]"):
        client.completions.create(model="llama", prompt=words, best_of=2)
    with pytest.raises(openai.NotFoundError, match="unknown model 'nope'"):
        client.completions.create(model="nope", prompt=words)
    # where KServe's model server has them (its docs' base_url for an InferenceService)
    kserve = openai.OpenAI(base_url=f"http://{daemon.http}/openai/v1", api_key="unused",
                           max_retries=0, timeout=120)
    assert {m.id for m in kserve.models.list()} == set(listed)
    assert kserve.completions.create(model="llama", prompt=words, max_tokens=6,
                                     temperature=0).choices[0].text == done.choices[0].text


def test_openai_logprobs_and_penalties_are_transformers_own(daemon, served) -> None:  # noqa: ANN001
    """`logprobs` through OpenAI's SDK: a completion's (tokens, token_logprobs, top_logprobs,
    text_offset), a chat's (each token's text, bytes, logprob and top_logprobs), streamed and
    not, each the log-softmax of transformers' logits at that step; frequency and presence
    penalties steer greedy tokens as OpenAI defines them, on every surface (OpenAI's and
    Triton's HTTP routes, the gRPC client, `cuvilctl generate`)."""
    import openai

    hf = served["hf"]["llama"]
    client = openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key="unused",
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
        status, body = post(daemon.http, "/v2/models/llama/generate", {
            "input_ids": PROMPT, "max_tokens": 8, "frequency_penalty": frequency,
            "presence_penalty": presence})
        assert status == 200 and json.loads(body)["output_ids"] == penalised
        with Client(daemon.target) as grpc_client:
            assert [t["token_id"] for t in grpc_client.generate(
                "llama", PROMPT, max_tokens=8, frequency_penalty=frequency,
                presence_penalty=presence)] == penalised
    done = subprocess.run([sys.executable, "-m", "cuvild.client.cli", "--target",
                           daemon.target, "generate", "llama", "--ids",
                           ",".join(map(str, PROMPT)), "--max-tokens", "8",
                           "--frequency-penalty", "1.5", "--json"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["output_ids"] == transformers_greedy(hf, PROMPT, 8, 1.5)[0]
    assert transformers_greedy(hf, PROMPT, 8, 1.5)[0] != transformers_greedy(hf, PROMPT, 8)[0]
    # without a tokenizer a token is named by its id, as vLLM names it
    done = client.completions.create(model="gpt2", prompt=PROMPT, max_tokens=2,
                                     temperature=0, logprobs=1)
    gpt2 = lm_models.reference(served["hf"]["gpt2"], PROMPT, 2)
    assert done.choices[0].logprobs.tokens == [f"token_id:{t}" for t in gpt2]


def test_lm_eval_harness_loglikelihood_requests_score_the_prompt(daemon, served) -> None:  # noqa: ANN001
    """What lm-evaluation-harness's `local-completions` model sends for a loglikelihood
    (multiple-choice) task: several prompts, each context + continuation as token ids, with
    `echo` and `logprobs` and one token to generate; read as it reads it (each choice's
    `token_logprobs[ctxlen:-1]` summed, greedy where each is its position's largest): the
    continuation's log-likelihood as transformers' logits give it, on a model exported for
    one token a step and on one whose prompt goes in chunks (every position's logits)."""
    hf = served["hf"]["llama"]
    requests = [(PROMPT, [7, 19, 23]), ([3, 8], [13, 21, 34, 55, 89])]
    want = [transformers_loglikelihood(hf, c, k) for c, k in requests]
    for model in ("llama", "chunked"):
        status, body = post(daemon.http, "/v1/completions", {
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
    status, body = post(daemon.http, "/v1/completions", {
        "model": "llama", "prompt": PROMPT, "echo": True, "stream": True})
    assert status == 400 and b"a stream takes one prompt, without echo" in body


def test_triton_stream_infer_streams_a_generations_tokens(daemon, served) -> None:  # noqa: ANN001
    """ModelStreamInfer, as tritonclient's start_stream / async_stream_infer and Triton's LLM
    backends use it: a prompt in, a response per token (the last final), transformers' tokens;
    a plain step on the same stream gets its one response; a bad request its error, and the
    stream goes on."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    want = lm_models.reference(served["hf"]["llama"], PROMPT, 6)
    got: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(url=daemon.target) as triton:
        triton.start_stream(callback=lambda result, error: got.put((result, error)))
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([" ".join(WORDS[t] for t in PROMPT).encode()],
                                          dtype=object))
        triton.async_stream_infer("llama", [text], request_id="gen",
                                  parameters={"max_tokens": 6},
                                  enable_empty_final_response=True)
        tokens, texts = [], []
        while True:
            result, error = got.get(timeout=120)
            assert error is None, error
            final = result.get_response().parameters["triton_final_response"].bool_param
            if result.as_numpy("output_ids") is not None:
                tokens.append(int(result.as_numpy("output_ids")[0]))
                texts.append(result.as_numpy("text_output")[0].decode())
            if final:
                break
        assert tokens == want and "".join(texts).split() == [WORDS[t] for t in want]
        ids = grpcclient.InferInput("input_ids", [1, 1], "INT64")
        ids.set_data_from_numpy(np.array([[PROMPT[0]]], np.int64))
        pos = grpcclient.InferInput("cache_position", [1], "INT64")
        pos.set_data_from_numpy(np.array([0], np.int64))
        triton.async_stream_infer("gpt2", [ids, pos], request_id="step")
        result, error = got.get(timeout=120)
        assert error is None and result.as_numpy("output0").shape[-1] == lm_models.VOCAB
        triton.async_stream_infer("nope", [ids, pos], request_id="bad")
        result, error = got.get(timeout=120)
        assert error is not None and "nope" in str(error)
        triton.stop_stream()
