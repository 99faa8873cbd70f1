"""Tool calling without a daemon (cuvild/serve/tools.py, cuvild/serve/chat.py): a chat's
tools and earlier calls rendered by its template as transformers' `apply_chat_template`
renders them; an answer's calls read as OpenAI's `tool_calls`; what each tool_choice holds
the answer to; a request's tools checked, naming what is wrong."""

from __future__ import annotations

import json

import pytest
from generation_helpers import TOOLS_TEMPLATE, byte_tokenizer_json

from cuvild.core.layout import BadInput
from cuvild.serve import chat, tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather <now>, by city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


def test_tools_and_earlier_calls_render_as_transformers_renders_them() -> None:
    """The tools and an assistant's earlier call (its arguments JSON's text, given to the
    template as an object, as vLLM gives them) and the tool's answer: the same prompt text
    as transformers' apply_chat_template, whose `tojson` neither escapes HTML nor sorts keys
    (jinja's own would write "\\u003cnow\\u003e" and reorder the keys)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"unit": "c", "city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3, snow"}]
    ours = chat.load(None, json.dumps({"bos_token": "<s>", "chat_template": TOOLS_TEMPLATE}))
    assert ours is not None
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(byte_tokenizer_json()),
                                 bos_token="<s>", eos_token="</s>")
    hf.chat_template = TOOLS_TEMPLATE
    as_objects = [dict(m) for m in messages]
    as_objects[1]["tool_calls"] = [{**messages[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"unit": "c", "city": "Oslo"}}}]
    want = hf.apply_chat_template(as_objects, tools=[WEATHER, TIME], tokenize=False,
                                  add_generation_prompt=True)
    got = ours.render(chat.messages_of(messages), [WEATHER, TIME])
    assert got == want and "<now>" in got and '{"unit": "c", "city": "Oslo"}' in got, got
    with pytest.raises(BadInput, match="arguments not JSON"):
        chat.messages_of([{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}])


# a training template's marks (what TRL's assistant_only_loss asks of a template): the
# assistant's text in a generation block
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}"
    "{% endgeneration %}</a>\n{% else %}<{{ m.role }}>{{ m.content }}\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<a>{% endif %}")


def test_a_template_with_generation_blocks_renders_as_transformers_renders_it() -> None:
    """transformers' `{% generation %}` tag (assistant masks for training) renders its body;
    a template with it did not load."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "And?"}]
    ours = chat.load(GENERATION_TEMPLATE, None)
    assert ours is not None
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(byte_tokenizer_json()))
    hf.chat_template = GENERATION_TEMPLATE
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render(chat.messages_of(messages)) == want == (
        "<user>Hi\n<a>Hello</a>\n<user>And?\n<a>")


def test_an_answers_calls_are_read_as_openais_tool_calls() -> None:
    """auto: the Hermes format's calls, the text around them the content (a call that does
    not read stays text; parallel_tool_calls false keeps the first), or an answer that is
    nothing but calls as JSON naming the tools (Llama 3's, Mistral's); named: the answer is
    the arguments; required: a list of {"name", "parameters"}."""
    auto = tools.asked({"tools": [WEATHER, TIME]})
    assert auto is not None and auto.choice == "auto" and auto.structured() is None
    text = ('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    message = auto.message(text)
    assert message["content"] == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", {"city": "Oslo"}),
                                                 ("get_time", {})]
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    assert auto.message("no call here") == {"role": "assistant", "content": "no call here"}
    broken = "<tool_call>{not json}</tool_call>"
    assert auto.message(broken) == {"role": "assistant", "content": broken}
    for whole in ('{"name": "get_time", "parameters": {"zone": "UTC"}}',  # Llama 3's
                  '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}',
                  '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}]'):
        (call,) = auto.message(whole)["tool_calls"]  # Mistral's last
        assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}, whole
    for said in ('{"name": "not_a_tool", "parameters": {}}', '{"name": "get_time"}',
                 '[1, 2] and more'):
        assert auto.message(said) == {"role": "assistant", "content": said}
    one = tools.asked({"tools": [WEATHER, TIME], "parallel_tool_calls": False})
    assert one is not None and len(one.message(text)["tool_calls"]) == 1
    named = tools.asked({"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    assert named is not None
    assert named.structured() == {"json": WEATHER["function"]["parameters"]}
    call = named.message('{"city": "Oslo"}')
    assert call["content"] is None and call["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    required = tools.asked({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert required is not None
    schema = required.structured()["json"]  # type: ignore[index]
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    calls = required.message('[{"name": "get_time", "parameters": {"zone": "UTC"}}]')
    assert calls["tool_calls"][0]["function"] == {"name": "get_time",
                                                   "arguments": '{"zone": "UTC"}'}
    assert required.message('[{"name": "get_ti')["content"] == '[{"name": "get_ti'  # cut


@pytest.mark.parametrize(("doc", "said"), [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [{"type": "function"}]}, r"tools\[0\] must be"),
    ({"tools": [WEATHER, WEATHER]}, "given twice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "not one of the tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls must be"),
])
def test_a_requests_tools_are_checked(doc: dict, said: str) -> None:
    with pytest.raises(BadInput, match=said):
        tools.asked(doc)


def test_a_stream_sends_each_call_as_it_is_written() -> None:
    """auto, streamed (generate_http's _Answer, cuvild/serve/tool_stream.py): the text before
    a "<tool_call>" goes out as it comes, held back from the first character that may begin
    one (white space until text follows it); a call's id and name go out once its name is
    written, its arguments as they are, the finish reason then "tool_calls"; a "<" that
    began no call goes out once it shows it; calls as JSON alone are held to the end."""
    from types import SimpleNamespace

    from cuvild.serve.generate_http import _Answer

    def streamed(pieces: list[str], **more: object) -> tuple[list[dict], list[dict]]:
        gen = SimpleNamespace(name="m", stopped=True, top_logprobs=None, tokenizer=None)
        answer = _Answer(gen, chat=True)  # type: ignore[arg-type]
        answer.tools = tools.asked({"tools": [WEATHER, TIME], **more})
        deltas = [answer.choice(p, [(0, p)], None, first=i == 0)["choices"][0]["delta"]
                  for i, p in enumerate(pieces)]
        return deltas, [c["choices"][0] for c in answer.ending()]

    deltas, end = streamed(["Let me ", "look <", "tool_call>", '{"name": "get_time", ',
                            '"arguments": {"zone": ', '"UTC"}}</tool_call>'])
    assert [d.get("content", "") for d in deltas] == ["Let me", " look", "", "", "", ""]
    assert [d.get("tool_calls") for d in deltas[:3]] == [None] * 3
    (first,), (more,), (last,) = (d["tool_calls"] for d in deltas[3:])
    assert first["id"].startswith("call_") and first["function"] == {
        "name": "get_time", "arguments": ""} and first["index"] == 0
    assert more == {"index": 0, "function": {"arguments": '{"zone": '}}
    assert last == {"index": 0, "function": {"arguments": '"UTC"}'}}
    assert len(end) == 1 and end[-1]["finish_reason"] == "tool_calls"
    deltas, end = streamed(["a <", "b"])
    assert [d.get("content") for d in deltas] == ["a", " <b"]
    assert end[-1]["finish_reason"] == "stop"
    deltas, _ = streamed(['[{"name": "get_time", "parameters": {"zone": ', '"CET"}}, {"name"',
                          ': "get_weather", "parameters": {}}]'], tool_choice="required")
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"].get("name"), c["function"]["arguments"])
            for c in calls] == [(0, "get_time", '{"zone": '), (0, None, '"CET"}'),
                                (1, "get_weather", "{}")]
    deltas, end = streamed(['{"name": ', '"get_time", "parameters": {}}'])  # Llama 3's: held
    assert deltas[1:] == [{}] and end[0]["delta"]["tool_calls"][0]["function"]["name"] == (
        "get_time")
    deltas, end = streamed(["[1, 2]", " and more"])  # held, then said as text at its end
    assert deltas[1:] == [{}] and end[0]["delta"] == {"content": "[1, 2] and more"}


NAMED = {"type": "function", "function": {"name": "get_weather"}}
ANSWERS = [  # (the request's tool_choice and parallel_tool_calls, an answer)
    ({"tool_choice": NAMED}, '{"city": "Oslo, \\"NO\\" {x}", "unit": "c"}'),
    ({"tool_choice": "required"}, '[{"name": "get_weather", "parameters": {"city": "[Oslo]"}},'
                                  ' {"name": "get_time", "parameters": {}}]'),
    ({"tool_choice": "required"}, '[{"parameters": {"city": "Oslo"}, "name": "get_weather"}]'),
    ({}, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}b"}}\n'
         '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
    ({}, '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"X\\"}"}</tool_call>'),
    ({}, 'I think <tool_call> is a tag. <b>bold</b>'),
    ({}, '<tool_call>oops</tool_call> no'),
    ({"parallel_tool_calls": False}, '<tool_call>{"name": "get_weather", "arguments": {}}'
                                     '</tool_call><tool_call>{"name": "get_time", '
                                     '"arguments": {}}</tool_call>'),
    ({}, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ({}, '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]'),
    ({}, '  \n{"name": "nope", "parameters": {}}'),
    ({}, "Hello there  "),
    ({}, '[get_weather(city="Oslo", unit="c"), get_time()]'),  # (Llama 3.2's, pythonic)
    ({}, '<|python_start|>[get_time(zone="UTC")]<|python_end|>'),  # (Llama 4's)
]


@pytest.mark.parametrize("given,answer", ANSWERS)
@pytest.mark.parametrize("step", [1, 5])
def test_a_streamed_answer_reads_as_the_whole_answer_reads(given, answer, step) -> None:
    """Streamed a piece at a time (cuvild/serve/tool_stream.py), an answer's content and calls
    (their arguments joined) are what the whole answer reads as (Tools.message), strings
    holding braces, quotes and marks included; arguments written before the name go out
    with it."""
    from cuvild.serve.tool_stream import ToolStream

    asked = tools.asked({"tools": [WEATHER, TIME], **given})
    assert asked is not None
    stream = ToolStream(asked)
    deltas = [stream.feed(answer[i:i + step]) for i in range(0, len(answer), step)]
    deltas.append(stream.end()[0])
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for c in (c for d in deltas for c in d.get("tool_calls", [])):
        if "id" in c:
            assert c["index"] not in calls and c["id"].startswith("call_")
            calls[c["index"]] = [c["function"]["name"], ""]
        calls[c["index"]][1] += c["function"]["arguments"]
    whole = asked.message(answer)
    assert [(n, json.loads(a)) for n, a in calls.values()] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in whole.get("tool_calls", [])]
    assert content == (whole["content"] or "")


# Qwen3's switch, written as its template writes it: thinking off, an empty think block
THINKING_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and "
    "enable_thinking is false %}<think></think>{% endif %}{% endif %}")


def test_vllms_chat_extras_render_as_transformers_renders_them() -> None:
    """chat_template_kwargs (Qwen3's enable_thinking) reach the template;
    continue_final_message leaves the prompt inside the last (an assistant's) message, as
    transformers' continue_final_message cuts it; what cannot hold is refused, naming it."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    ours = chat.load(THINKING_TEMPLATE, None)
    assert ours is not None
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(byte_tokenizer_json()))
    hf.chat_template = THINKING_TEMPLATE
    asked = [{"role": "user", "content": "Hi"}]
    for doc in ({}, {"chat_template_kwargs": {"enable_thinking": False}},
                {"chat_template_kwargs": {"enable_thinking": True}}):
        want = hf.apply_chat_template(asked, tokenize=False, add_generation_prompt=True,
                                      **doc.get("chat_template_kwargs", {}))
        assert ours.render(chat.messages_of(asked), **chat.options_of(doc)) == want
    assert "<think></think>" in ours.render(chat.messages_of(asked), **chat.options_of(
        {"chat_template_kwargs": {"enable_thinking": False}}))
    begun = [*asked, {"role": "assistant", "content": "Hello, I am "}]
    doc = {"continue_final_message": True, "add_generation_prompt": False}
    got = ours.render(chat.messages_of(begun), **chat.options_of(doc))
    assert got == hf.apply_chat_template(begun, tokenize=False, continue_final_message=True)
    assert got.endswith("<assistant>Hello, I am ")  # (not closed: the answer goes on)
    for wrong, words in (({"continue_final_message": True}, "add_generation_prompt"),
                         ({"chat_template_kwargs": {"messages": []}}, "given to the template"),
                         ({"chat_template_kwargs": [1]}, "must be an object"),
                         ({"add_generation_prompt": "yes"}, "true or false")):
        with pytest.raises(BadInput, match=words):
            ours.render(chat.messages_of(begun), **chat.options_of(wrong))
    with pytest.raises(BadInput, match="an assistant's message"):
        ours.render(chat.messages_of(asked), **chat.options_of(doc))


def test_calls_written_as_python_are_read_never_run() -> None:
    """auto: an answer that is nothing but a Python list of calls with literal keyword
    arguments (Llama 3.2's and Llama 4's, vLLM's `pythonic` parser) names the tools it calls;
    read by Python's parser, never run: anything but literals, positional arguments or a
    name not among the tools leaves it text."""
    auto = tools.asked({"tools": [WEATHER, TIME]})
    assert auto is not None
    said = auto.message('[get_weather(city="Oslo", days=2, at={"hour": [9, None, True]}),'
                        ' get_time()]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in said["tool_calls"]] == [
        ("get_weather", {"city": "Oslo", "days": 2, "at": {"hour": [9, None, True]}}),
        ("get_time", {})] and said["content"] is None
    for text in ('[get_weather(city=open("/etc/passwd"))]', '[os.system("ls")]',
                 '[get_weather("Oslo")]', '[get_weather(**x)]', '[get_weather(a={1, 2})]',
                 '[print(1)]', "[1, 2]", "[get_weather(city='Oslo')"):
        assert auto.message(text) == {"role": "assistant", "content": text}, text
