"""A reasoning model's answer split into `reasoning` and content (cuvild/serve/reasoning.py),
as vLLM's qwen3 and deepseek_r1 reasoning parsers split it: whole and streamed alike, before
its tool calls are read; an earlier answer's reasoning given to the template by every name
transformers gives it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from generation_helpers import TOOLS_TEMPLATE, byte_tokenizer_json, post

from cuvild.serve import chat, reasoning, tools
from cuvild.serve.generate_http import _Answer

ANSWERS = [  # (the answer, whether the prompt opened the thinking) -> (reasoning, content)
    ("<think>\nhmm, the weather\n</think>\n\nIt is cold.", False, ("hmm, the weather\n",
                                                                   "It is cold.")),
    ("hmm</think>\n\nAnswer", True, ("hmm", "Answer")),  # (DeepSeek-R1's prompt opens it)
    ("Plain answer", False, (None, "Plain answer")),  # (thinking off)
    ("  <b>bold</b>", False, (None, "  <b>bold</b>")),  # (as written: no block)
    ("<think>cut short", False, ("cut short", "")),  # (max_tokens inside the thinking)
    ("still thinking", True, ("still thinking", "")),
    ("<think></think>\n\nA <think> inside", False, (None, "A <think> inside")),
    ("<thi", False, (None, "<thi")),
]


@pytest.mark.parametrize("answer,begun,want", ANSWERS)
def test_an_answer_splits_whole_and_streamed_alike(answer, begun, want) -> None:
    assert reasoning.split(answer, begun) == want
    for step in (1, 3):
        reader = reasoning.Reader(begun)
        parts = [reader.feed(answer[i:i + step]) for i in range(0, len(answer), step)]
        parts.append(reader.end())
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == (
            want[0] or "", want[1])


def test_a_reasoning_models_chat_answers_its_reasoning_apart_from_its_calls() -> None:
    """generate_http's answers of a reasoning model's chat: `reasoning` beside the message's
    content and calls, streamed as it comes (never as content), the calls read after it."""
    answer = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>{"name": '
              '"get_time", "arguments": {}}</tool_call>')
    gen = SimpleNamespace(name="m", stopped=True, top_logprobs=None, tokenizer=None,
                          thinking=False)
    asked = tools.asked({"tools": [{"type": "function", "function": {"name": "get_time"}}]})
    whole = _Answer(gen, chat=True)  # type: ignore[arg-type]
    whole.tools = asked
    (one,) = whole.choice(answer, [], "stop", streamed=False)["choices"]
    assert one["message"]["reasoning"] == "The user wants the weather.\n"
    assert one["message"]["content"] is None and one["finish_reason"] == "tool_calls"
    assert one["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    streamed = _Answer(gen, chat=True)  # type: ignore[arg-type]
    streamed.tools = asked
    deltas = [streamed.choice(answer[i:i + 4], [], None, first=i == 0)["choices"][0]["delta"]
              for i in range(0, len(answer), 4)]
    deltas += [c["choices"][0]["delta"] for c in streamed.ending()[:-1]]
    assert "".join(d.get("reasoning", "") for d in deltas) == one["message"]["reasoning"]
    assert not "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_time" and streamed.ending()[-1][
        "choices"][0]["finish_reason"] == "tool_calls"
    plain = _Answer(SimpleNamespace(**{**vars(gen), "thinking": None}), chat=True)  # type: ignore[arg-type]
    (one,) = plain.choice(answer, [], "stop", streamed=False)["choices"]
    assert "reasoning" not in one["message"] and one["message"]["content"] == answer


def test_an_earlier_answers_reasoning_reaches_the_template_by_every_name() -> None:
    """As transformers aliases it: reasoning_content, thinking or reasoning, read by a
    template as reasoning_content and thinking; a template writing </think> is a reasoning
    model's."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    template = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}<think>"
                "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}\n{% endfor %}")
    ours = chat.load(template, None)
    assert ours is not None and ours.thinks and not chat.load("{{ x }}", None).thinks
    assert chat.load(TOOLS_TEMPLATE, None).thinks
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(byte_tokenizer_json()))
    hf.chat_template = template
    for name in chat.REASONING:
        messages = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello", name: "greet back"}]
        want = hf.apply_chat_template(messages, tokenize=False)
        assert ours.render(chat.messages_of(messages), generation_prompt=False) == want
        assert "<think>greet back</think>Hello" in want


def test_the_daemon_answers_a_reasoning_models_thinking_as_reasoning(lm_daemon) -> None:  # noqa: ANN001
    """The byte-level entry's template drops earlier thinking as Qwen3's does (a reasoning
    model's); its answer, held by a regex to a thinking block and an answer, comes back as
    `reasoning` and content, whole and streamed."""
    doc = {"model": "bytes", "messages": [{"role": "user", "content": "Weather?"}],
           "max_tokens": 40, "temperature": 0,
           "structured_outputs": {"regex": "<think>[a-z]{4}</think>\\n\\n[a-z]{3}"}}
    code, body = post(lm_daemon.http, "/v1/chat/completions", doc)
    assert code == 200, body
    message = json.loads(body)["choices"][0]["message"]
    assert len(message["reasoning"]) == 4 and len(message["content"]) == 3, message
    code, body = post(lm_daemon.http, "/v1/chat/completions", {**doc, "stream": True})
    chunks = [json.loads(line[6:]) for line in body.decode().splitlines()
              if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]


def test_a_prompt_that_opens_the_thinking_makes_the_answer_reasoning(lm_daemon) -> None:  # noqa: ANN001
    """DeepSeek-R1's generation prompt opens a <think> (here a continued assistant message
    does): the answer up to </think> is reasoning, cut short by max_tokens all of it; under
    a grammar (structured output holds the answer from its start) it is read as written."""
    doc = {"model": "bytes", "max_tokens": 3, "temperature": 0,
           "messages": [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": "<think>"}],
           "continue_final_message": True, "add_generation_prompt": False}
    code, body = post(lm_daemon.http, "/v1/chat/completions", doc)
    message = json.loads(body)["choices"][0]["message"]
    assert code == 200 and len(message["reasoning"]) == 3 and message["content"] == "", body
    code, body = post(lm_daemon.http, "/v1/chat/completions", {
        **doc, "structured_outputs": {"regex": "[a-z]{3}"}})
    message = json.loads(body)["choices"][0]["message"]
    assert code == 200 and "reasoning" not in message and len(message["content"]) == 3, body
