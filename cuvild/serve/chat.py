"""Chat: a conversation rendered into a prompt by the model's own chat template, as
transformers' `apply_chat_template` renders it, for OpenAI's `/v1/chat/completions`.

The template is the model repository entry's: `chat_template.jinja` (as transformers 4.43+
saves it) or the `chat_template` of its `tokenizer_config.json` (a string, or named templates:
"default" is used), beside its `tokenizer.json`. It is Jinja, rendered in jinja2's immutable
sandbox (no attribute of a Python object outside the template's own values is reachable, no
value is changed), with what transformers gives it: `messages`, `tools` (OpenAI's function
tools, or None: cuvild/serve/tools.py), `add_generation_prompt` (true: the prompt ends where
the assistant's answer begins), the special tokens of the config (`bos_token`,
`eos_token`, ...), `raise_exception`, `strftime_now` and transformers' `tojson` (jinja's
own escapes HTML and sorts keys), and its `{% generation %}...{% endgeneration %}` tag
(which marks the assistant's text for training masks: its body rendered as written). The rendered
text is tokenized without adding special tokens again (the template writes them), and the
config's `eos_token` ends the answer (a stop token, not sent as text).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cuvild.core.layout import BadInput
from cuvild.serve import reasoning

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
MAX_TEMPLATE_BYTES = 1 << 20
MAX_MESSAGES = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
SHAPE = '{"id", "type": "function", "function": {"name", "arguments": JSON\'s text}}'
CONTINUED = "CONTINUE_FINAL_MESSAGE_TAG "  # (where a continued last message's text ends)
OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
REASONING = ("reasoning_content", "thinking", "reasoning")  # an earlier answer's, by any name


@dataclass
class Chat:
    template: Any  # a compiled jinja2 Template
    special: dict[str, str]  # bos_token, eos_token, ... as the config names them
    thinks: bool = False  # a reasoning model's (cuvild/serve/reasoning.py)

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
               generation_prompt: bool = True, extra: Mapping[str, Any] | None = None,
               continue_final: bool = False) -> str:
        """The prompt text for `messages`, ending where the assistant's answer begins
        (`generation_prompt` false: where the last message ends; `continue_final`: inside
        the last message, an assistant's, where its text ends, so that the answer goes on
        with it, as transformers' continue_final_message cuts it); `tools` (OpenAI's function
        tools) given to the template as transformers gives them; `extra`: more of the
        template's variables (vLLM's chat_template_kwargs: enable_thinking, ...)."""
        from jinja2 import TemplateError

        if continue_final:
            if generation_prompt:
                raise BadInput("continue_final_message continues the last message: with "
                               "\"add_generation_prompt\": false")
            if messages[-1]["role"] != "assistant":
                raise BadInput("continue_final_message continues an assistant's message: "
                               f"the last is a {messages[-1]['role']}'s")
            messages = [*messages[:-1], {**messages[-1],
                                         "content": messages[-1]["content"] + CONTINUED}]
        try:
            text = str(self.template.render(**(extra or {}), messages=messages, tools=tools,
                                            add_generation_prompt=generation_prompt,
                                            **self.special))
        except TemplateError as e:  # (the template's own raise_exception too)
            raise BadInput(f"the model's chat template refused the messages: {e}") from None
        if not continue_final:
            return text
        at = text.rfind(CONTINUED.strip())
        if at < 0:
            raise BadInput("continue_final_message: the chat template does not write the last "
                           "message's text as given")
        return text[:at] if text[at:at + len(CONTINUED)] == CONTINUED else text[:at].rstrip()


def options_of(doc: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's chat request extras checked, as `Chat.render`'s keywords: add_generation_prompt
    (true), continue_final_message (false), chat_template_kwargs (more template variables,
    none of those the template is given already)."""
    out: dict[str, Any] = {}
    for key, name, default in (("add_generation_prompt", "generation_prompt", True),
                               ("continue_final_message", "continue_final", False)):
        value = doc.get(key, default)
        if not isinstance(value, bool):
            raise BadInput(f"{key} must be true or false, got {json.dumps(value)[:50]}")
        out[name] = value
    extra = doc.get("chat_template_kwargs") or {}
    if not isinstance(extra, Mapping):
        raise BadInput("chat_template_kwargs must be an object of the template's variables, "
                       f"got {json.dumps(extra)[:100]}")
    taken = sorted(set(extra) & {"messages", "tools", "add_generation_prompt", *SPECIAL})
    if taken:
        raise BadInput(f"chat_template_kwargs: {taken} are given to the template already")
    out["extra"] = dict(extra)
    return out


def options_from(text: str) -> dict[str, Any]:
    """`options_of` a JSON object's text of vLLM's chat extras (gRPC's chat_options; "":
    their defaults)."""
    try:
        doc = json.loads(text) if text else {}
    except ValueError as e:
        raise BadInput(f"chat_options is not JSON ({e})") from None
    if not isinstance(doc, dict) or set(doc) - set(OPTIONS):
        raise BadInput(f"chat_options must be a JSON object of {list(OPTIONS)}, got "
                       f"{text[:200]}")
    return options_of(doc)


def load(template_text: str | None, config_text: str | None) -> Chat | None:
    """The chat of an entry from its chat_template.jinja and tokenizer_config.json texts
    (None for a file it does not have); None where neither gives a template. ValueError
    saying what is wrong with one that does not read."""
    config = json.loads(config_text) if config_text else {}
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FILE} is not a JSON object")
    source = template_text if template_text is not None else config.get("chat_template")
    if isinstance(source, list):  # named templates
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise ValueError("its chat_template is not a string")
    special = {}
    for key in SPECIAL:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value  # (AddedToken)
        if isinstance(value, str):
            special[key] = value
    return Chat(_environment().from_string(source), special, reasoning.thinks(source))


def _environment() -> Any:
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """transformers' `{% generation %}` block (its AssistantTracker, which also notes
        where the block's text falls: a training mask, of no use to a prompt): its body."""

        tags = {"generation"}  # noqa: RUF012 - jinja's own class attribute

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        from jinja2 import TemplateError

        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, Generation])
    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        """transformers' `tojson` (jinja's own escapes HTML and sorts keys: not the text the
        model was trained on)."""
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: time.strftime(fmt))
    env.filters["tojson"] = tojson
    return env


def messages_of(given: Any) -> list[dict[str, Any]]:
    """OpenAI's `messages` checked: a non-empty list of {"role", "content"} where content is
    text or a list of text parts ({"type": "text", "text": ...}); an assistant's may be
    null beside its `tool_calls` (their arguments, JSON's text, given to the template as
    objects, as vLLM gives them), a tool's names its `tool_call_id` (cuvild/serve/tools.py)."""
    if not isinstance(given, list) or not given:
        raise BadInput("messages must be a non-empty list of {\"role\", \"content\"}")
    if len(given) > MAX_MESSAGES:
        raise BadInput(f"{len(given)} messages, over {MAX_MESSAGES}")
    out = []
    for i, message in enumerate(given):
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            raise BadInput(f"messages[{i}]: expected {{\"role\": one of {list(ROLES)}, "
                           "\"content\": ...}")
        calls = _calls(i, message) if message["role"] == "assistant" else None
        content = _content(i, message.get("content"), bool(calls))
        one: dict[str, Any] = {"role": str(message["role"]), "content": content}
        if calls:
            one["tool_calls"] = calls
        for key in ("tool_call_id", "name", "reasoning"):
            if isinstance(message.get(key), str):
                one[key] = message[key]
        thought = next((message[k] for k in REASONING if isinstance(message.get(k), str)), None)
        if thought is not None:  # (every name a template may read it by, as transformers)
            one.update(thinking=thought, reasoning_content=thought)
        out.append(one)
    return out


def _content(i: int, content: Any, calls: bool) -> str:
    """A message's text: its content, or its text parts joined ("" beside tool calls)."""
    if content is None and calls:
        return ""
    if isinstance(content, list):
        if not all(isinstance(p, Mapping) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise BadInput(f"messages[{i}].content: only text parts "
                           "({\"type\": \"text\", \"text\": ...}) are read")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise BadInput(f"messages[{i}].content must be text")
    return content


def _calls(i: int, message: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """An assistant message's `tool_calls`, their arguments read as objects."""
    given = message.get("tool_calls")
    if given is None:
        return None
    out = []
    for call in given if isinstance(given, list) else [None]:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise BadInput(f"messages[{i}].tool_calls: each {SHAPE}")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise BadInput(f"messages[{i}].tool_calls: arguments not JSON ({SHAPE})") from None
        out.append({"id": call.get("id"), "type": "function",  # type: ignore[union-attr]
                    "function": {"name": function["name"], "arguments": arguments}})
    return out
