"""A generation's text as it comes (cuvild/serve/generation.py): each token's text decoded
behind the prompt's last tokens, as vLLM's detokenizer does, and what may go out of it now
that stop strings may end it."""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 5  # the prompt's last tokens a generation's text is decoded behind (vLLM's)


def continued(tokenizer: Any, before: list[int], ids: list[int]) -> str:
    """The text `ids` add after `before`: decoded behind its last CONTEXT_TOKENS, as the text
    continues it (a SentencePiece tokenizer drops a leading word's space from tokens decoded
    alone: "Paris" where the prompt goes on " Paris"), as vLLM's detokenizer does; alone
    where `before`'s text does not begin the whole's."""
    before = before[-CONTEXT_TOKENS:]
    head = tokenizer.decode(before, skip_special_tokens=True)
    whole = tokenizer.decode([*before, *ids], skip_special_tokens=True)
    if whole.startswith(head):
        return whole[len(head):]
    return tokenizer.decode(ids, skip_special_tokens=True)


def release(text: str, sent: int, stops: tuple[str, ...]) -> tuple[str, int, bool]:
    """(the text after `sent` that can go out now, how much has gone then, whether a stop
    string ends it there): all of it but a tail that could begin a stop string; up to the
    first stop string found."""
    at = min((i for i in (text.find(s, max(0, sent - len(s) + 1)) for s in stops) if i >= 0),
             default=-1)
    if at >= 0:
        return text[sent:at], max(sent, at), True
    tail = max((k for s in stops for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])),
               default=0)
    end = max(sent, len(text) - tail)
    return text[sent:end], end, False
