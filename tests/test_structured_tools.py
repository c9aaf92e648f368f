"""Tool calls' pure parts: dialogs rendered in the Hermes and Llama 3 formats, answers parsed into
OpenAI's tool_calls, and a forced call's grammar that only lets the model write a call whose
arguments follow the function's parameters."""

import json

import pytest
import torch

from llama_tp.structured.grammars import Grammars, tokenizer_info
from llama_tp.structured.rows import RowAdjustment, adjust_rows
from llama_tp.structured.tools import HERMES, LLAMA3, call_constraint, parse_tool_calls, render_dialog
from llama_tp.text.tokenizer import Llama3Tokenizer
from tiny_checkpoint import SHARED_DATA

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
ROUND_TRIP = [{"role": "user", "content": "Weather in Oslo?"},
              {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
              {"role": "tool", "tool_call_id": "call_1", "content": "very cold"}]


def test_hermes_dialog():
    dialog = render_dialog(ROUND_TRIP, [WEATHER], HERMES)
    assert [m["role"] for m in dialog] == ["system", "user", "assistant", "user"]
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in dialog[0]["content"]
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert dialog[2]["content"] == call + "\n" + call
    assert dialog[3]["content"] == "<tool_response>\ncold\n</tool_response>\n<tool_response>\nvery cold\n</tool_response>"


def test_llama3_dialog_keeps_the_system_prompt_and_tool_role():
    dialog = render_dialog([{"role": "system", "content": "Be brief."}] + ROUND_TRIP[:3], [WEATHER], LLAMA3)
    assert dialog[0]["content"].startswith("Be brief.\n\nYou have access to the following functions")
    assert dialog[2]["content"] == '{"name": "weather", "parameters": {"city": "Oslo"}}\n' * 1 + \
        '{"name": "weather", "parameters": {"city": "Oslo"}}'
    assert dialog[3] == {"role": "tool", "content": "cold"}


def test_a_dialog_without_tools_is_left_as_it_is():
    dialog = [{"role": "user", "content": "hi"}]
    assert render_dialog([m | {"tool_calls": []} for m in dialog], [], HERMES) == dialog


@pytest.mark.parametrize("fmt, text, content, calls", [
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Let me look.", [("weather", '{"city": "Oslo"}')]),
    (HERMES, '<tool_call>{"name": "weather", "arguments": {}}</tool_call><tool_call>{"name": "weather", '
     '"arguments": {"city": "Rome"}}</tool_call>', None, [("weather", "{}"), ("weather", '{"city": "Rome"}')]),
    (HERMES, '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', None, []),
    (HERMES, "<tool_call>{not json", None, []),
    (HERMES, "Just words.", "Just words.", []),
    (LLAMA3, ' {"name": "weather", "parameters": {"city": "Oslo"}}', None, [("weather", '{"city": "Oslo"}')]),
    (LLAMA3, "It is sunny.", "It is sunny.", []),
])
def test_parsing_answers(fmt, text, content, calls):
    found_content, found = parse_tool_calls(text, fmt, {"weather"})
    assert [(call.name, call.arguments) for call in found] == calls
    assert found_content == (content if calls else text)


def test_a_forced_call_can_only_be_a_valid_call():
    tokenizer = Llama3Tokenizer(str(SHARED_DATA / "llama3-tokenizer.model"))
    grammars = Grammars(tokenizer_info(tokenizer, tokenizer.n_words, tokenizer.stop_tokens))
    # a bounded string: greedy over flat logits would otherwise write "!!!..." for ever
    bounded = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"]}}}
    for fmt, start in ((HERMES, "<tool_call>\n"), (LLAMA3, '{"name": "weather"')):
        row = RowAdjustment(grammars.matcher(call_constraint([bounded, WEATHER | {"function": {"name": "other"}}],
                                                             "weather", fmt)))
        text = ""
        for _ in range(80):  # greedy over flat logits: the grammar alone decides
            logits = adjust_rows([row], torch.zeros(1, tokenizer.n_words))
            token = int(logits.argmax())
            if token in tokenizer.stop_tokens:
                break
            row.accept(token)
            text += tokenizer.decode([token])
        assert text.startswith(start)
        content, calls = parse_tool_calls(text, fmt, {"weather"})
        assert content is None and [call.name for call in calls] == ["weather"], text
        assert len(json.loads(calls[0].arguments)["city"]) <= 4
