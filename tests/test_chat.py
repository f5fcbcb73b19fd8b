"""The DS4 chat template (spec §5): rendered text written out by hand, and the ids ds4 builds."""

from __future__ import annotations

import pytest

from ds4.core.chat import (DEFAULT_SYSTEM, THINK_MAX_PREFIX, Message, encode_chat, encode_prompt,
                           render_chat, render_prompt)
from ds4.core.tokenizer import Tokenizer, real_vocabulary

BOS = "<｜begin▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_vocabulary(*real_vocabulary())


# --- rendered text ------------------------------------------------------------------------------

def test_single_turn_default_system():
    assert DEFAULT_SYSTEM == "You are a helpful assistant"
    assert render_prompt("What is 2+2?") == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant<｜User｜>What is 2+2?<｜Assistant｜><think>")


def test_single_turn_empty_system():
    expected = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>"
    assert render_prompt("Hi", system="") == expected
    assert render_prompt("Hi", system=None) == expected


def test_single_turn_nothink():
    assert render_prompt("Hi", think=False) == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant<｜User｜>Hi<｜Assistant｜></think>")


def test_single_turn_think_max():
    assert render_prompt("Hi", system="", think_max=True) == (
        "<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        + THINK_MAX_PREFIX.split("\n", 1)[1] + "<｜User｜>Hi<｜Assistant｜><think>")
    assert THINK_MAX_PREFIX.endswith("left unchecked.\n\n")


def test_chat_matches_prompt_for_one_turn():
    assert render_chat([Message("system", DEFAULT_SYSTEM), Message("user", "Hi")]) == render_prompt("Hi")
    assert render_chat([Message("user", "Hi")], think=False) == render_prompt("Hi", system="", think=False)


def test_multi_turn_with_assistant():
    messages = [
        Message("system", "Be brief."),
        Message("user", "Hi"),
        Message("assistant", "Hello! How can I help?"),
        Message("user", "Tell me a joke."),
    ]
    assert render_chat(messages) == (
        "<｜begin▁of▁sentence｜>Be brief."
        "<｜User｜>Hi"
        "<｜Assistant｜></think>Hello! How can I help?"
        "<｜User｜>Tell me a joke."
        "<｜Assistant｜><think>")
    assert render_chat(messages, think=False, add_generation_prompt=False) == (
        "<｜begin▁of▁sentence｜>Be brief."
        "<｜User｜>Hi"
        "<｜Assistant｜></think>Hello! How can I help?"
        "<｜User｜>Tell me a joke.")


def test_assistant_with_own_reasoning_markers():
    messages = [
        Message("user", "2+2?"),
        Message("assistant", "<think>add them</think>4"),
        Message("user", "and 3+3?"),
        Message("assistant", "</think>6"),
    ]
    assert render_chat(messages, add_generation_prompt=False) == (
        "<｜begin▁of▁sentence｜>"
        "<｜User｜>2+2?"
        "<｜Assistant｜><think>add them</think>4"
        "<｜User｜>and 3+3?"
        "<｜Assistant｜></think>6")


def test_tool_result_and_aliases():
    messages = [
        Message("developer", "Use tools."),
        Message("user", "Weather in Paris?"),
        Message("assistant", "Calling the tool."),
        Message("tool", '{"temp": 21}'),
        {"role": "function", "content": "sunny"},
    ]
    assert render_chat(messages, think=False) == (
        "<｜begin▁of▁sentence｜>Use tools."
        "<｜User｜>Weather in Paris?"
        "<｜Assistant｜></think>Calling the tool."
        '<｜User｜>Tool: {"temp": 21}'
        "<｜User｜>Tool: sunny"
        "<｜Assistant｜></think>")


def test_unknown_role():
    with pytest.raises(ValueError, match=r"'robot'.*system, developer, user, assistant, tool"):
        render_chat([Message("robot", "beep")])
    with pytest.raises(ValueError, match="robot"):
        encode_chat(None, [Message("robot", "beep")])


def test_empty_chat():
    assert render_chat([]) == BOS + A + "<think>"
    assert render_chat([], add_generation_prompt=False) == BOS


# --- token ids ----------------------------------------------------------------------------------

def test_rendered_prompt_ids(tok):
    ids = tok.encode_rendered(render_prompt("What is 2+2?"))
    system = tok.encode("You are a helpful assistant")
    user = tok.encode("What is 2+2?")
    assert ids[0] == 0
    assert ids[1 + len(system)] == 128803
    assert ids[2 + len(system) + len(user)] == 128804
    assert ids == [0, *system, 128803, *user, 128804, 128821]
    assert encode_prompt(tok, "What is 2+2?") == ids
    assert encode_prompt(tok, "Hi", system="", think=False) == [0, 128803, *tok.encode("Hi"), 128804, 128822]


def test_multi_turn_ids(tok):
    messages = [Message("user", "Hi"), Message("assistant", "Hello!"), Message("user", "Bye")]
    ids = encode_chat(tok, messages)
    hi, hello, bye = tok.encode("Hi"), tok.encode("Hello!"), tok.encode("Bye")
    assert ids == [0, 128803, *hi, 128804, 128822, *hello, 128803, *bye, 128804, 128821]
    assert tok.encode_rendered(render_chat(messages)) == ids
    assert [i for i, t in enumerate(ids) if t == 128803] == [1, 1 + len(hi) + 3 + len(hello)]


def test_encode_is_part_by_part_like_ds4(tok):
    # ds4 BPEs "Tool: " and the content separately, and never makes specials from message text.
    ids = encode_chat(tok, [Message("tool", "hello")], add_generation_prompt=False)
    assert ids == [0, 128803, *tok.encode("Tool: "), *tok.encode("hello")]
    assert ids != tok.encode_rendered(render_chat([Message("tool", "hello")], add_generation_prompt=False))
    ids = encode_chat(tok, [Message("assistant", "<think>r</think>a")], add_generation_prompt=False)
    assert ids == [0, 128804, *tok.encode("<think>r</think>a")]
    assert 128821 not in ids
    ids = encode_prompt(tok, "Hi", think_max=True, system="S")
    assert ids == [0, *tok.encode(THINK_MAX_PREFIX), *tok.encode("S"), 128803, *tok.encode("Hi"), 128804, 128821]
