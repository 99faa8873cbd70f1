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
from typing import Any

import lm_models
import pytest
import torch
from daemons import DaemonProcess
from generation_helpers import (
    PROMPT,
    WORDS,
    events,
    post,
)

from cuvild.client import Client
from cuvild.client.errors import CuvildError


@pytest.fixture
def served(lm_served: dict[str, Any]) -> dict[str, Any]:
    return lm_served


@pytest.fixture
def daemon(lm_daemon: DaemonProcess) -> DaemonProcess:
    """The session's language-model daemon (tests/serve/conftest.py `lm_daemon`), shared
    with test_openai_generation.py: each test starts its own sequences, none changes what
    is served."""
    return lm_daemon


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
    assert doc["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12,
                            "prompt_tokens_details": {"cached_tokens": 0}}
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


def test_a_mixture_of_experts_exported_as_transformers_does_generates_as_transformers(
        daemon, tmp_path) -> None:  # noqa: ANN001
    """Mixtral exported with transformers' defaults holds transformers' own op for its
    experts: the daemon (which never imports transformers) defines it as transformers does
    (cuvild/intake/foreign_ops.py) and serves the model; unloaded after (shared daemon)."""
    hf = lm_models.lm("mixtral")
    archive = tmp_path / "mixtral.pt2"
    torch.export.save(lm_models.export(hf, dynamic=True), archive)
    with Client(daemon.target) as client:
        client.load_file("mixtral", archive)
        try:
            got = [t["token_id"] for t in client.generate("mixtral", PROMPT, max_tokens=6)]
        finally:
            client.unload("mixtral")
    assert got == lm_models.reference(hf, PROMPT, 6)


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
    # the model; and how its sequences' steps shared runs, where other tests' did); a
    # prompt's chunk none
    decode = steps[((1, 1), (1,))]
    assert any(s and s.startswith(off) for s in decode), steps
    assert all(s is None or s.startswith(off) for s in decode), steps
    assert all(set(s) == {None} for shapes, s in steps.items() if shapes[0] != (1, 1)), steps
    assert any((m.get("step") or "").startswith(off) for m in static["measured"].values()), \
        static["measured"]
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
        code, body = post(daemon.http, "/v1/completions", {  # n choices: one request
            "model": "llama", "prompt": PROMPT, "max_tokens": 2, "n": 3})
        assert code == 200 and len(json.loads(body)["choices"]) == 3, body
        deadline = time.monotonic() + 30  # (the daemon sees the caller gone at its next token)
        while of(after := scrape(), "cuvil_inference_request_failure_total", code="CANCELLED",
                 **llama) == of(before, "cuvil_inference_request_failure_total",
                                code="CANCELLED", **llama):
            assert time.monotonic() < deadline, "the cancelled generation was not counted"
            time.sleep(0.1)
        stats = client.stats(0.1)["models"]["llama:1"]

    def grew(name: str, **labels: str) -> float:
        return of(after, name, **labels) - of(before, name, **labels)

    assert grew("cuvil_inference_request_success_total", **llama) == 2
    assert grew("cuvil_inference_request_failure_total", model="", code="NOT_FOUND") == 1
    assert grew("cuvil_generation_prompt_tokens_total", **llama) == 3 * len(PROMPT)
    assert grew("cuvil_generation_time_to_first_token_seconds_count", **llama) == 5
    made = grew("cuvil_generation_tokens_total", **llama)
    assert 12 <= made < lm_models.CONTEXT  # 5, n's 3 x 2, the left one's 1 and more
    assert grew("cuvil_generation_inter_token_latency_seconds_count", **llama) == made - 5
    assert grew("cuvil_inference_request_duration_seconds_count", **llama) == 2
    assert stats["tokens"] >= made and stats["first_token_ms"]["p50"] > 0
    assert stats["inter_token_ms"]["n"] >= made - 5


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
