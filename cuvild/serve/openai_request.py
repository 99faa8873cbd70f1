"""What an OpenAI request asks (cuvild/serve/generate_http.py serves it): its fields
checked, its prompts, its logprobs, its usage option and its tools, put as a generation's
options (cuvild/serve/generation.py) where they are options."""

from __future__ import annotations

import json
from typing import Any

from cuvild.core.layout import BadInput
from cuvild.serve import chat, structured
from cuvild.serve import tools as tools_mod

# OpenAI's fields, top_k as vLLM takes it
# (and vLLM's ignore_eos, and best_of where it is n: vLLM's serving benchmark sends both)
OPENAI = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream",
          "stream_options", "n", "stop", "user", "frequency_penalty", "presence_penalty",
          "logit_bias", "logprobs", "echo", "ignore_eos", "best_of", "response_format",
          "structured_outputs", *structured.GUIDED, "repetition_penalty", "min_p", "min_tokens"}
CHAT = OPENAI - {"prompt", "echo"} | {"messages", "max_completion_tokens", "top_logprobs",
                                      "tools", "tool_choice", "parallel_tool_calls",
                                      *chat.OPTIONS}  # (vLLM's chat_template_kwargs, ...)
MAX_LOGPROBS = 20  # the likeliest tokens a token's logprobs may list (vLLM's default bound)
MAX_N = 128  # choices a prompt (OpenAI's own bound)


def tools_of(doc: dict[str, Any], options: dict[str, Any]) -> tools_mod.Tools | None:
    """A chat's tools (cuvild/serve/tools.py), the structured output their choice asks put
    in `options`."""
    calls = tools_mod.asked(doc)
    if calls is None or calls.choice == "none":
        return calls
    held = calls.structured()
    if held is not None and "structured" in options:
        raise BadInput(f"tool_choice {calls.choice!r} holds the answer to its calls: no "
                       "response_format beside it")
    if held is not None:
        options["structured"] = held
    return calls


def checked(doc: Any, chat: bool) -> tuple[int, bool, bool, bool, dict[str, Any]]:
    """An OpenAI request's fields checked: n, echo, stream, whether a stream ends with the
    usage, and the generation's options."""
    what = "messages" if chat else "prompt"
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), str):
        raise BadInput(f"expected a JSON object with \"model\" and \"{what}\"")
    known = CHAT if chat else OPENAI
    unknown = set(doc) - known
    if unknown:
        raise BadInput(f"unsupported fields {sorted(unknown)}; supported: {sorted(known)}")
    n = doc.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise BadInput(f"n must be an integer from 1 to {MAX_N}, got {json.dumps(n)[:50]}")
    echo = doc.get("echo") or False
    if not isinstance(echo, bool):
        raise BadInput(f"echo must be true or false, got {json.dumps(echo)[:50]}")
    stream, usage = bool(doc.get("stream")), include_usage(doc.get("stream_options"))
    if doc.get("stream_options") is not None and not stream:
        raise BadInput("stream_options is only allowed with \"stream\": true")
    if doc.get("best_of") not in (None, n):
        raise BadInput(f"best_of must be n ({n}): every choice made is returned, none ranked "
                       f"out, got {json.dumps(doc['best_of'])[:50]}")
    options = {k: doc[k] for k in ("max_tokens", "temperature", "top_k", "top_p", "seed",
                                   "stop", "frequency_penalty", "presence_penalty",
                                   "logit_bias", "ignore_eos", "repetition_penalty", "min_p",
                                   "min_tokens")
               if doc.get(k) is not None}
    if doc.get("max_completion_tokens") is not None:
        options["max_tokens"] = doc["max_completion_tokens"]
    asked = structured.from_openai(doc)
    if asked is not None:
        options["structured"] = asked
    return n, echo, stream, usage, options


def named(doc: Any, fields: set[str]) -> tuple[str, str]:
    """A request object's model name and version ("name:version"), its fields checked
    against `fields` (vLLM's /tokenize, /v1/embeddings)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), str):
        raise BadInput("expected a JSON object with \"model\": the served model's name")
    unknown = set(doc) - fields
    if unknown:
        raise BadInput(f"unsupported fields {sorted(unknown)}; supported: {sorted(fields)}")
    name, _, version = doc["model"].partition(":")
    return name, version


def prompts(prompt: Any) -> list[Any]:
    """A completion's prompts: OpenAI's `prompt` is a text, token ids, or a list of either."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return [prompt]


def top_logprobs(doc: dict[str, Any], chat: bool) -> int | None:
    """How many likeliest tokens each token's logprobs lists (0: its own alone), None where
    logprobs are not asked: a completion's `logprobs` (a count), a chat's `logprobs` (true
    or false) with its `top_logprobs` (a count)."""
    def count(key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not (
                0 <= value <= MAX_LOGPROBS):
            raise BadInput(f"{key} must be an integer from 0 to {MAX_LOGPROBS}, got "
                           f"{json.dumps(value)[:50]}")
        return value

    asked, top = doc.get("logprobs"), doc.get("top_logprobs")
    if not chat:
        return None if asked is None else count("logprobs", asked)
    if asked is not None and not isinstance(asked, bool):
        raise BadInput(f"logprobs must be true or false, got {json.dumps(asked)[:50]}")
    if not asked:
        if top is not None:
            raise BadInput("top_logprobs needs \"logprobs\": true")
        return None
    return 0 if top is None else count("top_logprobs", top)


def include_usage(given: Any) -> bool:
    if given is None:
        return False
    if (not isinstance(given, dict) or set(given) - {"include_usage"}
            or not isinstance(given.get("include_usage", False), bool)):
        raise BadInput("stream_options must be {\"include_usage\": true or false}, got "
                       f"{json.dumps(given)[:200]}")
    return given.get("include_usage", False)
