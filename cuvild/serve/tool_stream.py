"""A streamed chat answer read for tool calls as it is written (cuvild/serve/tools.py): each
call goes out as OpenAI and vLLM stream one, its id, type and name in its first delta and its
arguments' JSON text in the deltas after it, as the model writes them.

- a named tool_choice: the whole answer is the call's arguments;
- "required": the answer is a JSON list of {"name", "parameters"} (held so by structured
  output), each item a call;
- "auto": text goes out as content up to a `<tool_call>` (held from a character that may
  begin one); the JSON object after it is read as a call ({"name", "arguments"}), and after
  its `</tool_call>` the text goes on. A block that is not a call (no name) goes out as the
  text it was. An answer that may be nothing but calls as JSON (Llama 3's, Mistral's:
  `tools.may_be_calls`) is held whole to its end, where `Tools.message` reads it.
A call's arguments go out before its end is known: an answer cut short (max_tokens) leaves
its last call's arguments unfinished, as vLLM's streams do.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from cuvild.serve.detokenize import release
from cuvild.serve.tools import MARK, Tools, may_be_calls

END = "</tool_call>"
ARGUMENTS = ("arguments", "parameters")


@dataclass
class _Call:
    name: str | None = None
    args_from: int = -1  # where its arguments' value begins in the text (-1: not yet)
    args_to: int = -1  # where it ends (-1: not yet)
    args_string: bool = False  # given as a JSON string (its text the string's content)
    done: bool = False  # its object closed


class CallText:
    """JSON read as it is written, for the call objects at `base` depth (0: the text is one
    object; 1: a list of them): each call's name once whole, where its arguments are."""

    def __init__(self, base: int) -> None:
        self.base, self.text, self.calls = base, "", []
        self.depth, self.in_string, self.escaped = 0, False, False
        self.string_from = 0  # where the string being read began
        self.key: str | None = None  # the call's key whose value is read (None: a key next)
        self.value_from = -1  # where that value began (-1: not yet)

    def feed(self, more: str) -> None:
        start = len(self.text)
        self.text += more
        for i in range(start, len(self.text)):
            self._char(i, self.text[i])

    def _char(self, i: int, c: str) -> None:  # noqa: C901 - one character of JSON's grammar
        if self.base == 0 and self.calls and self.calls[0].done:
            return  # (one object: what follows it is not read)
        top = self.depth == self.base + 1 and self.calls and not self.calls[-1].done
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if top:
                    self._string_ends(i)
            return
        if c.isspace() or c == ":":
            return
        if top and self.key is not None and self.value_from < 0:
            self.value_from = i  # (a value begins: any character but space)
        if c == '"':
            self.in_string, self.string_from = True, i
        elif c in "{[":
            if self.depth == self.base and c == "{":
                self.calls.append(_Call())
                self.key, self.value_from = None, -1
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if top and c == "}":  # (the call's object closes: a value before it ends)
                self._value_ends(i)
                self.calls[-1].done = True
            elif self.depth == self.base + 1 and self.calls and not self.calls[-1].done:
                self._value_ends(i + 1)  # (an object or list value closes)
        elif top and c == ",":
            self._value_ends(i)
            self.key = None

    def _string_ends(self, i: int) -> None:
        call = self.calls[-1]
        if self.key is None:  # (a key: its value follows its colon)
            self.key, self.value_from = _read(self.text[self.string_from:i + 1]), -1
        elif self.value_from == self.string_from:
            self._value_ends(i + 1)
            if self.key == "name" and call.name is None:
                name = _read(self.text[self.string_from:i + 1])
                call.name = name if isinstance(name, str) else None
            elif self.key in ARGUMENTS:
                call.args_string = True

    def _value_ends(self, at: int) -> None:
        call = self.calls[-1]
        if self.key in ARGUMENTS and self.value_from >= 0 and call.args_from < 0:
            call.args_from, call.args_to = self.value_from, at

    def arguments(self, call: _Call) -> str:
        """A call's arguments' JSON text so far (an object or list as it is written; a
        string, its content, once whole)."""
        if call.args_from < 0:
            if (self.key in ARGUMENTS and self.value_from >= 0 and self.calls[-1] is call
                    and self.text[self.value_from] in "{["):  # (an object being written)
                return self.text[self.value_from:]
            return ""
        text = self.text[call.args_from:call.args_to].strip()
        given = _read(text) if call.args_string else None
        return given if isinstance(given, str) else text


def _read(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class ToolStream:
    """One streamed answer's deltas: `feed` each piece of text, `end` at its end."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self.said, self.sent = "", 0  # the answer so far; how much of it went out as text
        self.calls: CallText | None = None  # the calls being read (named, required: all)
        self.block_from = -1  # (auto) where the `<tool_call>` being read begins
        self.whole = False  # (auto) the answer may be calls as JSON alone: held to its end
        self.decided = False  # (auto) whether how it begins is known
        self.ids: list[str] = []  # each call's id, once its name went out
        self.went: list[int] = []  # how much of each call's arguments went out
        self.called = 0  # calls out of earlier blocks (auto: each block one call)
        self.spaces = ""  # (auto) white space at the content's end: it goes out with text
        # after it, or at the end where no call was made (the content beside calls is stripped)
        if tools.choice == "named":
            self.calls = CallText(0)
            self.calls.feed('{"name": ' + json.dumps(tools.name) + ', "arguments": ')
        elif tools.choice == "required":
            self.calls = CallText(1)

    def feed(self, text: str) -> dict[str, Any]:
        """The delta's `content` and `tool_calls` for the answer's next `text`."""
        self.said += text
        if self.tools.choice == "none":
            self.sent = len(self.said)
            return {"content": text} if text else {}
        if self.tools.choice != "auto":
            self.calls.feed(text)  # type: ignore[union-attr]
            return self._calls_delta()
        return self._auto()

    def end(self) -> tuple[dict[str, Any], bool]:
        """What was held to the end (content, calls), and whether the answer made calls."""
        if self.whole:
            message = self.tools.message(self.said[self.sent:])
            delta = {k: v for k, v in message.items() if k in ("content", "tool_calls") and v}
            if delta.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **c}
                                       for i, c in enumerate(delta["tool_calls"])]
            return delta, bool(delta.get("tool_calls"))
        delta: dict[str, Any] = {}
        if self.tools.choice == "auto":
            rest = self.said[self.sent:] if self.block_from < 0 else self.said[self.block_from:]
            if self.block_from >= 0 and self.calls is not None and self._announced():
                rest = ""  # (a call cut short: its arguments went as they came)
            rest = rest if self.ids else self.spaces + rest
            if rest:
                delta["content"] = rest
        else:
            delta = self._calls_delta()
            if not self.ids and self.said:  # (required, cut before a name: its text)
                delta = {"content": self.said}
        return delta, bool(self.ids)

    def _auto(self) -> dict[str, Any]:
        if self.whole or not self._begun():
            return {}
        out: dict[str, Any] = {}
        content = ""
        while True:
            if self.block_from < 0:
                piece, self.sent, found = release(self.said, self.sent, (MARK,))
                content += piece
                if not found:
                    break
                self.block_from, self.calls = self.sent, CallText(0)
                self.calls.feed(self.said[self.sent + len(MARK):])
            else:
                assert self.calls is not None
                self.calls.feed(self.said[self.block_from + len(MARK) + len(self.calls.text):])
            calls = self._calls_delta()
            if calls.get("tool_calls"):
                out.setdefault("tool_calls", []).extend(calls["tool_calls"])
            closed = self._block_closed()
            if closed < 0:
                break
            if not self._announced() and not self._dropped():  # (no call: the text it was)
                content += self.said[self.block_from:closed]
            self.called = len(self.ids)
            self.block_from, self.sent, self.calls = -1, closed, None
        content = self.spaces + content
        self.spaces = content[len(content.rstrip()):]  # (waits for what follows it)
        if content.rstrip():
            out["content"] = content.rstrip()
        return out

    def _begun(self) -> bool:
        """Whether the answer goes out as it comes: how it begins is known (a `<tool_call>`
        or text), and it is not calls as JSON alone (`whole`: held to its end)."""
        if not self.decided:
            begun = self.said.lstrip()
            if not begun or (len(begun) < len(MARK) and MARK.startswith(begun)):
                return False
            self.decided = True
            self.whole = not begun.startswith(MARK) and may_be_calls(begun)
        return not self.whole

    def _block_closed(self) -> int:
        """Where the `<tool_call>` block being read ends, after its `</tool_call>` (-1: not
        yet), or where its text shows it is no call."""
        assert self.calls is not None
        text = self.calls.text
        at = text.find(END)
        if at < 0:
            if self.calls.calls or not text.strip() or text.lstrip()[0] == "{":
                return -1
            return self.block_from + len(MARK)  # (no object after the mark: text)
        return self.block_from + len(MARK) + at + len(END)

    def _announced(self) -> bool:
        return len(self.ids) > self.called

    def _dropped(self) -> bool:
        """Whether the block read is a call past the one parallel_tool_calls false allows."""
        assert self.calls is not None
        return (not self.tools.parallel and self.called > 0 and bool(self.calls.calls)
                and self.calls.calls[0].name is not None)

    def _calls_delta(self) -> dict[str, Any]:
        """The calls' deltas since the last: a call's id, type and name once its name is
        read (with its arguments so far), then its arguments as they grow."""
        assert self.calls is not None
        out = []
        for k, call in enumerate(self.calls.calls):
            index = self.called + k
            if not self.tools.parallel and index > 0:
                break
            if call.name is None:
                continue
            args = self.calls.arguments(call)
            if index == len(self.ids):
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self.went.append(len(args))
                out.append({"index": index, "id": self.ids[index], "type": "function",
                            "function": {"name": call.name, "arguments": args}})
            elif len(args) > self.went[index]:
                out.append({"index": index, "function": {"arguments": args[self.went[index]:]}})
                self.went[index] = len(args)
        return {"tool_calls": out} if out else {}
