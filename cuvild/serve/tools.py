"""Tool calling on /v1/chat/completions, as OpenAI's API and vLLM's server have it.

- `tools`: [{"type": "function", "function": {"name", "description", "parameters"}}], given
  to the entry's chat template as `tools` (as transformers' `apply_chat_template` gives
  them), so that the model sees them;
- `tool_choice`: "none" (a text answer), "auto" (the default with tools: the answer is read
  for calls in the Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  which Qwen2.5, Qwen3 and the Hermes models write, the text around them the content; or,
  an answer that is nothing but calls as JSON naming the tools, Llama 3's `{"name": ...,
  "parameters": {...}}` and Mistral's `[TOOL_CALLS] [{"name": ..., "arguments": ...}]`, or
  as a Python list of calls, Llama 3.2's and 4's `[get_weather(city="Oslo")]`),
  "required" (one call or more: the answer held by structured output to a JSON list of
  {"name", "parameters"} of the given tools, as vLLM holds it) or {"type": "function",
  "function": {"name": N}} (one call of N: the answer held to its parameters' schema);
- earlier turns: an assistant's `tool_calls` (their `arguments`, JSON's text, given to the
  template as an object, as vLLM gives them) and `tool` messages with their `tool_call_id`
  (cuvild/serve/chat.py).
The answer's calls are the message's `tool_calls`, each with an id of its own, and its
finish reason is "tool_calls".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from cuvild.core.layout import BadInput

MAX_TOOLS = 128
MARK = "<tool_call>"  # where a call begins (the Hermes format)
# before calls as JSON (Llama 3's, Mistral's), or as Python (Llama 4's)
PREFIXES = ("<|python_tag|>", "[TOOL_CALLS]", "<|python_start|>")
SUFFIX = "<|python_end|>"  # (after Llama 4's)
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class Tools:
    tools: list[dict[str, Any]]  # as given, checked
    choice: str  # "none", "auto", "required" or "named"
    name: str = ""  # the named function's
    parallel: bool = True  # OpenAI's parallel_tool_calls: false, one call at most

    def structured(self) -> dict[str, Any] | None:
        """The generation's `structured` option (cuvild/serve/structured.py) where the
        choice holds the answer to calls; None where it is free."""
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
                  for t in self.tools}
        if self.choice == "named":
            return {"json": params[self.name]}
        if self.choice != "required":
            return None
        one = [{"type": "object", "properties": {"name": {"const": name}, "parameters": p},
                "required": ["name", "parameters"], "additionalProperties": False}
               for name, p in params.items()]
        return {"json": {"type": "array", "minItems": 1, "items": {"anyOf": one},
                         **({} if self.parallel else {"maxItems": 1})}}

    def message(self, text: str) -> dict[str, Any]:
        """OpenAI's assistant message of an answer `text`: its calls as `tool_calls`."""
        calls: list[tuple[str, str]] = []  # (name, arguments' JSON text)
        content: str | None = text
        if self.choice == "named":
            calls, content = [(self.name, text)], None
        elif self.choice == "required":
            try:
                calls = [(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
                content = None
            except (ValueError, TypeError, KeyError):  # (cut by max_tokens: said as text)
                calls = []
        elif self.choice == "auto":
            calls, content = _hermes(text)
            if not calls:
                calls, content = self._whole(text), None
            calls = calls if self.parallel else calls[:1]
        if not calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": content, "tool_calls": [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": arguments}} for name, arguments in calls]}


    def _whole(self, text: str) -> list[tuple[str, str]]:
        """The calls of an answer that is nothing but calls as JSON: Llama 3's
        ({"name": ..., "parameters": {...}}, after "<|python_tag|>" or not) and Mistral's
        ("[TOOL_CALLS]" and a list of {"name", "arguments"}), each naming one of the tools;
        none where anything else is said."""
        body = text.strip()
        for prefix in PREFIXES:
            body = body.removeprefix(prefix).strip()
        body = body.removesuffix(SUFFIX).strip()
        names = {t["function"]["name"] for t in self.tools}
        try:
            given = json.loads(body)
        except ValueError:
            return _pythonic(body, names)
        out = []
        for call in given if isinstance(given, list) else [given]:
            arguments = call.get("parameters", call.get("arguments")) if isinstance(
                call, dict) else None
            if not isinstance(arguments, (dict, str)) or call.get("name") not in names:
                return []
            out.append((call["name"], arguments if isinstance(arguments, str)
                        else json.dumps(arguments)))
        return out


def _pythonic(body: str, names: set[str]) -> list[tuple[str, str]]:
    """The calls of an answer written as a Python list of calls with literal keyword
    arguments, `[get_weather(city="Oslo"), get_time()]` (Llama 3.2's and Llama 4's: vLLM's
    `pythonic` parser), each naming one of the tools; none where it is anything else. Read
    by Python's parser, never run: a value that is not a literal is no call."""
    import ast

    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    out = []
    for call in tree.elts:
        if (not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name)
                or call.func.id not in names or call.args
                or any(k.arg is None for k in call.keywords)):
            return []
        try:
            arguments = {str(k.arg): ast.literal_eval(k.value) for k in call.keywords}
            out.append((call.func.id, json.dumps(arguments)))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return []  # (a value that is not a literal, or not JSON's: no call)
    return out


def may_be_calls(text: str) -> bool:
    """Whether an answer beginning `text` may be calls as JSON alone (`Tools._whole`): a
    stream holds it back until it ends."""
    begun = text.lstrip()
    return any(begun.startswith(s) or s.startswith(begun) for s in ("{", "[", *PREFIXES))


def _hermes(text: str) -> tuple[list[tuple[str, str]], str | None]:
    """The calls written `<tool_call>{"name": ..., "arguments": ...}</tool_call>` in `text`,
    and the text around them (None where there is none); a call that does not read as one
    stays in the text."""
    calls: list[tuple[str, str]] = []

    def taken(found: re.Match[str]) -> str:
        try:
            call = json.loads(found.group(1))
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, TypeError, KeyError):
            return found.group(0)
        if not isinstance(name, str):
            return found.group(0)
        calls.append((name, arguments if isinstance(arguments, str) else json.dumps(arguments)))
        return ""

    rest = _CALL.sub(taken, text).strip()
    return calls, rest or None


def asked(doc: dict[str, Any]) -> Tools | None:
    """A chat request's `tools` and `tool_choice` checked; None where it gives no tools (a
    tool_choice without them is refused, as OpenAI refuses it)."""
    tools, choice = doc.get("tools"), doc.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise BadInput("tool_choice needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadInput(f"tools must be a list of at most {MAX_TOOLS} "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    names = [_name_of(i, t) for i, t in enumerate(tools)]
    if len(set(names)) < len(names):
        raise BadInput(f"tools: a function name given twice ({names})")
    parallel = doc.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadInput(f"parallel_tool_calls must be true or false, got {parallel!r}")
    if choice is None or choice in ("auto", "none", "required"):
        return Tools(tools, choice or "auto", parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if (not isinstance(choice, dict) or choice.get("type") != "function"
            or not isinstance(name, str)):
        raise BadInput("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": "
                       f"\"function\", \"function\": {{\"name\": ...}}}}, got "
                       f"{json.dumps(choice)[:200]}")
    if name not in names:
        raise BadInput(f"tool_choice names {name!r}, not one of the tools {names}")
    return Tools(tools, "named", name, parallel)


def _name_of(i: int, tool: Any) -> str:
    function = tool.get("function") if isinstance(tool, dict) else None
    if (not isinstance(tool, dict) or tool.get("type") != "function"
            or not isinstance(function, dict) or not isinstance(function.get("name"), str)
            or not isinstance(function.get("parameters", {}), dict)):
        raise BadInput(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": "
                       f"..., \"parameters\": {{...}}}}}}, got {json.dumps(tool)[:200]}")
    return str(function["name"])
