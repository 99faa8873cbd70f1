"""vLLM's /tokenize and /detokenize (cuvild/serve/tokenize_http.py) on test_generation.py's
daemon (tests/serve/conftest.py `lm_daemon`; one worker runs them: tests/conftest.py
SAME_WORKER)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from generation_helpers import BYTES_CONTEXT, byte_tokenizer_json, post

from cuvild.client import Client
from cuvild.client.errors import CuvildError


def test_vllms_tokenize_and_detokenize_give_the_prompt_the_daemon_makes(  # noqa: ANN001
        lm_daemon, lm_served) -> None:
    """/tokenize (cuvild/serve/tokenize_http.py): a prompt's ids as transformers' tokenizer
    makes them, a chat's (tools too) as apply_chat_template makes them and as many as the
    chat completion's usage counts; /detokenize gives the ids' text back, special tokens kept;
    errors are OpenAI's error objects naming what is wrong."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(byte_tokenizer_json()),
                                 bos_token="<s>", eos_token="</s>")
    hf.chat_template = json.loads((lm_served["root"] / "bytes" / "tokenizer_config.json")
                                  .read_text())["chat_template"]
    http = lm_daemon.http

    def tokenize(**doc: Any) -> dict[str, Any]:
        code, body = post(http, "/tokenize", {"model": "bytes", **doc})
        assert code == 200, body
        return json.loads(body)

    said = tokenize(prompt="Hello, world", return_token_strs=True)
    assert said["tokens"] == hf("Hello, world")["input_ids"] and said["count"] == len(
        said["tokens"]) and said["max_model_len"] == BYTES_CONTEXT
    assert said["token_strs"] == hf.convert_ids_to_tokens(said["tokens"])
    assert tokenize(prompt="Hello", add_special_tokens=False)["tokens"] == hf(
        "Hello", add_special_tokens=False)["input_ids"]
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for generation_prompt in (True, False):
        chat = tokenize(messages=messages, tools=[weather],
                        add_generation_prompt=generation_prompt)
        assert chat["token_strs"] is None and chat["tokens"] == hf.apply_chat_template(
            messages, tools=[weather], add_generation_prompt=generation_prompt,
            tokenize=True, return_dict=True)["input_ids"]
    code, body = post(http, "/v1/chat/completions", {
        "model": "bytes", "messages": messages, "tools": [weather], "max_tokens": 1})
    assert code == 200 and json.loads(body)["usage"]["prompt_tokens"] == chat["count"] + len(
        hf("<assistant>", add_special_tokens=False)["input_ids"]), body
    code, body = post(http, "/detokenize", {"model": "bytes", "tokens": said["tokens"]})
    assert code == 200 and json.loads(body) == {"prompt": hf.decode(said["tokens"])}, body
    code, body = post(http, "/detokenize", {"model": "bytes", "tokens": chat["tokens"]})
    assert json.loads(body)["prompt"] == hf.decode(chat["tokens"]), body
    for path, doc, words in (
            ("/tokenize", {"model": "bytes"}, "either \"prompt\""),
            ("/tokenize", {"model": "bytes", "prompt": "a", "messages": messages}, "either"),
            ("/tokenize", {"model": "bytes", "prompt": "a", "add_special_tokens": 1}, "true"),
            ("/tokenize", {"model": "bytes", "prompt": "a", "nope": 1}, "unsupported fields"),
            ("/tokenize", {"model": "gpt2", "prompt": "a"}, "has no tokenizer"),
            ("/tokenize", {"model": "nope", "prompt": "a"}, "nope"),
            ("/detokenize", {"model": "bytes", "tokens": [1, 10 ** 9]}, "not in the tokenizer"),
            ("/detokenize", {"model": "bytes", "tokens": "1 2"}, "list of at most")):
        code, body = post(http, path, doc)
        error = json.loads(body)["error"]
        assert code in (400, 404) and words in error["message"], (path, doc, body)
        assert error["type"] == "invalid_request_error"


def test_vllms_chat_extras_are_taken_by_the_chat_and_tokenize_routes(  # noqa: ANN001
        lm_daemon) -> None:
    """chat_template_kwargs, add_generation_prompt and continue_final_message (vLLM's: a
    Qwen3 client's enable_thinking was refused as an unsupported field) reach the template on
    /v1/chat/completions and /tokenize alike: the prompt the chat ran is the one /tokenize
    gives."""
    http = lm_daemon.http
    begun = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": "It is"}]
    extras = {"continue_final_message": True, "add_generation_prompt": False,
              "chat_template_kwargs": {"enable_thinking": False}}
    code, body = post(http, "/tokenize", {"model": "bytes", "messages": begun, **extras})
    assert code == 200, body
    cut = json.loads(body)
    code, body = post(http, "/tokenize", {"model": "bytes", "messages": begun})
    whole = json.loads(body)
    assert cut["tokens"] == whole["tokens"][:cut["count"]] and cut["count"] < whole["count"]
    code, body = post(http, "/v1/chat/completions", {
        "model": "bytes", "messages": begun, "max_tokens": 1, **extras})
    assert code == 200 and json.loads(body)["usage"]["prompt_tokens"] == cut["count"], body
    code, body = post(http, "/v1/chat/completions", {
        "model": "bytes", "messages": begun, "continue_final_message": True})
    assert code == 400 and "add_generation_prompt" in json.loads(body)["error"]["message"]
    # gRPC (GenerateRequest.chat_options) and cuvilctl: the same prompt, the same answer
    code, body = post(http, "/v1/chat/completions", {
        "model": "bytes", "messages": begun, "max_tokens": 4, "temperature": 0, **extras})
    want = json.loads(body)["choices"][0]["message"]["content"]
    with Client(lm_daemon.target) as client:
        got = "".join(t["text"] for t in client.generate(
            "bytes", messages=begun, max_tokens=4, continue_final_message=True,
            chat_template_kwargs={"enable_thinking": False}))
        assert got == want
        with pytest.raises(CuvildError, match="given to the template already"):
            list(client.generate("bytes", messages=begun, chat_template_kwargs={"tools": 1}))
    said = subprocess.run(
        [sys.executable, "-m", "cuvild.client.cli", "--target", lm_daemon.target, "generate",
         "bytes", "Weather?", "--chat", "--template-kwargs", '{"enable_thinking": false}',
         "--max-tokens", "4", "--json"], capture_output=True, text=True, timeout=120)
    assert said.returncode == 0 and 1 <= len(json.loads(said.stdout)["output_ids"]) <= 4, (
        said.stderr)
