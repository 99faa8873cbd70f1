"""A reasoning model's answer split into its reasoning and its content, as vLLM's reasoning
parsers split it (its `qwen3` and `deepseek_r1`), into the message's `reasoning` field
(vLLM's, after OpenAI's guidance; `reasoning_content` before it).

A model is a reasoning model where its chat template writes `</think>` (Qwen3's, QwQ's,
DeepSeek-R1's templates do: they drop earlier turns' thinking by it). Its answer is read so:
- `<think>` ... `</think>` then the rest: the reasoning, then the content;
- the prompt ends inside a `<think>` the template opened (DeepSeek-R1's generation prompt
  opens it): the answer's text up to `</think>` is reasoning;
- neither (thinking off: Qwen3's `enable_thinking` false writes an empty block in the
  prompt): all of it is content.
An answer cut short inside its thinking is all reasoning. Streamed, each piece goes to the
field it belongs to as it comes, held back only where it may begin a tag.
"""

from __future__ import annotations

from cuvild.serve.detokenize import release

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str) -> bool:
    """Whether a chat template is a reasoning model's."""
    return CLOSE in template


def opened(prompt: str) -> bool:
    """Whether `prompt` ends inside a `<think>` block (the answer begins in its reasoning)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def split(text: str, begun: bool) -> tuple[str | None, str]:
    """(the reasoning, or None without any; the content) of a whole answer `text`; `begun`:
    the prompt opened the thinking."""
    reader = Reader(begun)
    reasoning, content = reader.feed(text)
    more_reasoning, more_content = reader.end()
    reasoning, content = reasoning + more_reasoning, content + more_content
    return (reasoning if reader.reasoned and reasoning else None), content


class Reader:
    """A streamed answer's pieces sorted into reasoning and content as they come; after a
    thinking block, the white space that begins either is left out (its "<think>\n",
    "</think>\n\n"); an answer without one goes as written."""

    def __init__(self, begun: bool) -> None:
        self.thinking = begun  # inside the thinking now
        self.started = begun  # whether how the answer begins is known
        self.reasoned = begun  # whether it had a thinking block
        self.lead = True  # the field being written has had no text yet
        self.said, self.sent = "", 0

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that go out now for the answer's next `text`."""
        self.said += text
        if not self.started:
            begun = self.said.lstrip()
            if not begun or (len(begun) < len(OPEN) and OPEN.startswith(begun)):
                return "", ""  # (may still begin the block)
            self.started = True
            if begun.startswith(OPEN):
                self.thinking = self.reasoned = True
                self.sent = len(self.said) - len(begun) + len(OPEN)
            else:
                self.lead = False  # (no thinking: the answer as written)
        reasoning = ""
        if self.thinking:
            piece, self.sent, closed = release(self.said, self.sent, (CLOSE,))
            reasoning = self._led(piece)
            if not closed:
                return reasoning, ""
            self.thinking, self.lead = False, True
            self.sent += len(CLOSE)
        content = self._led(self.said[self.sent:])
        self.sent = len(self.said)
        return reasoning, content

    def _led(self, piece: str) -> str:
        """`piece` without the white space that would begin its field."""
        if self.lead:
            piece = piece.lstrip()
            self.lead = not piece
        return piece

    def end(self) -> tuple[str, str]:
        """What was held back at the answer's end: reasoning where it was cut short inside
        its thinking, else content."""
        rest = self._led(self.said[self.sent:]) if self.started else self.said[self.sent:]
        self.sent = len(self.said)
        return (rest, "") if self.thinking else ("", rest)
