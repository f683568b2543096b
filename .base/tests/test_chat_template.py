"""The plain-Python Qwen3.5 chat renderer must equal the official Jinja template.

Oracle: transformers' own `render_jinja_template` (sandboxed Jinja with trim_blocks /
lstrip_blocks, its json.dumps `tojson` and `raise_exception`), run on QWEN35_CHAT_TEMPLATE.
"""

import itertools
import json

import jinja2
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from qwen35.chat_template import QWEN35_CHAT_TEMPLATE, render_chat

UNSET = object()  # enable_thinking not passed at all (the template's `is defined` branch)

SYS = {"role": "system", "content": "You are a helpful assistant."}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle d'une ville",  # non-ASCII: tojson must not escape it
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}
CALL2 = {"name": "lookup", "arguments": {"q": ["a", "ü"], "opts": {"deep": True}, "n": None}}


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def tool_msg(text):
    return {"role": "tool", "content": text, "tool_call_id": "call_0", "name": "get_weather"}


CONVERSATIONS = {
    "user_only": [user("What is 2+2?")],
    "system_user": [SYS, user("What is 2+2?")],
    "trim": [{"role": "system", "content": "  \n sys \t"}, user("\n\n  hi  \n")],
    "empty_system": [{"role": "system", "content": ""}, user("hi")],
    "parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "  Hello"}, {"text": " there "}], "name": "bob"},
    ],
    "none_content": [user("hi"), assistant(None, tool_calls=[CALL]), tool_msg("sunny"), user("thanks")],
    "multi_turn_reasoning_before_last_query": [
        SYS, user("Q1"), assistant("A1", reasoning_content="thinking 1\n"), user("Q2"),
    ],
    "reasoning_after_last_query": [
        user("Q1"), assistant("A1", reasoning_content="r1"), user("Q2"), assistant("A2", reasoning_content="  r2 "),
    ],
    "inline_think": [
        user("Q1"), assistant("<think>\nold thoughts\n</think>\n\nA1"), user("Q2"),
        assistant("<think>\nnew\n</think>\n\n  A2"),
    ],
    "reasoning_none_with_inline": [user("Q"), assistant("x</think>\n\ny", reasoning_content=None)],
    "reasoning_string_wins": [user("Q"), assistant("<think>a</think>b", reasoning_content="explicit")],
    "tool_round_trip": [
        SYS, user("Weather in Paris?"), assistant("", tool_calls=[CALL], reasoning_content="need tool"),
        tool_msg('{"temp": 21}'), assistant("It is 21°C.", reasoning_content="done"),
    ],
    "parallel_tools": [
        user("Do two things"), assistant("Sure, calling tools.", tool_calls=[CALL, CALL2]),
        tool_msg("r1"), tool_msg("r2"), assistant("Both done."), user("and again?"),
    ],
    "tool_response_as_user": [
        user("real question"), assistant("calling", tool_calls=[CALL]),
        user("<tool_response>\nresult\n</tool_response>"), assistant("ok", reasoning_content="kept"),
    ],
    "tool_last": [user("go"), assistant("", tool_calls=[CALL2]), tool_msg("out")],
    "assistant_last": [user("hi"), assistant("hello")],
    "unicode": [SYS, user("你好，世界 🎉 नमस्ते"), assistant("こんにちは", reasoning_content="考える")],
}


def jinja_render(messages, add_generation_prompt, enable_thinking, tools):
    kwargs = {} if enable_thinking is UNSET else {"enable_thinking": enable_thinking}
    rendered, _ = render_jinja_template(
        conversations=[messages], tools=tools, chat_template=QWEN35_CHAT_TEMPLATE,
        add_generation_prompt=add_generation_prompt, **kwargs,
    )
    return rendered[0]


def python_render(messages, add_generation_prompt, enable_thinking, tools):
    thinking = None if enable_thinking is UNSET else enable_thinking
    return render_chat(messages, add_generation_prompt=add_generation_prompt, enable_thinking=thinking, tools=tools)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_python_renderer_matches_official_jinja(name):
    messages = CONVERSATIONS[name]
    options = itertools.product([True, False], [False, True, None, UNSET], [None, [TOOL]])
    for add_generation_prompt, enable_thinking, tools in options:
        expected = jinja_render(messages, add_generation_prompt, enable_thinking, tools)
        got = python_render(messages, add_generation_prompt, enable_thinking, tools)
        assert got == expected, (name, add_generation_prompt, enable_thinking, tools is not None)


def test_spec_generation_prompts():
    messages = [{"role": "system", "content": "S"}, user("U")]
    head = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(messages, enable_thinking=False) == head + "<think>\n\n</think>\n\n"
    assert render_chat(messages, enable_thinking=True) == head + "<think>\n"
    assert render_chat(messages) == head + "<think>\n"  # the template's default is thinking on


def test_history_reasoning_dropped_before_last_query():
    text = render_chat(CONVERSATIONS["multi_turn_reasoning_before_last_query"], enable_thinking=False)
    assert "thinking 1" not in text
    assert "<|im_start|>assistant\nA1<|im_end|>" in text
    text = render_chat(CONVERSATIONS["reasoning_after_last_query"], add_generation_prompt=False)
    assert "<|im_start|>assistant\n<think>\nr2\n</think>\n\nA2<|im_end|>\n" in text
    assert "r1" not in text


def test_tool_messages_grouped_into_one_user_turn():
    text = render_chat(CONVERSATIONS["parallel_tools"], add_generation_prompt=False)
    assert "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response><|im_end|>\n" in text
    assert '<parameter=q>\n["a", "ü"]\n</parameter>' in text


def test_json_string_arguments_render_like_a_mapping():
    as_dict = [user("go"), assistant("", tool_calls=[CALL])]
    as_json = [user("go"), assistant("", tool_calls=[{"function": {"name": "get_weather",
                                                                   "arguments": json.dumps({"city": "Paris", "days": 3})}}])]
    assert render_chat(as_json) == render_chat(as_dict)


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "No messages provided"),
        ([user("hi"), SYS], "System message must be at the beginning"),
        ([SYS], "No user query found"),
        ([user("hi"), {"role": "developer", "content": "x"}], "developer"),
        ([{"role": "user", "content": {"text": "dict"}}], "Unexpected content type"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "Unexpected item type"),
    ],
)
def test_invalid_conversations_raise_value_error(messages, message):
    with pytest.raises(ValueError, match=message):
        render_chat(messages)
    if "developer" not in message:  # the template refuses the same inputs
        with pytest.raises(jinja2.exceptions.TemplateError):
            jinja_render(messages, True, UNSET, None)


def test_image_parts_are_rejected():
    with pytest.raises(ValueError, match="image"):
        render_chat([{"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "?"}]}])
