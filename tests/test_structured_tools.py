"""Tool calls' pure parts: dialogs rendered in the Hermes and Llama 3 formats, answers parsed into
OpenAI's tool_calls, and a forced call's grammar that only lets the model write a call whose
arguments follow the function's parameters."""

import json

import pytest
import torch

from llama_tp.structured.grammars import Grammars, tokenizer_info
from llama_tp.structured.rows import RowAdjustment, adjust_rows
from llama_tp.structured.constraint import Constraint
from llama_tp.structured.tools import (HERMES, LLAMA3, call_constraint, call_or_answer, parse_tool_calls,
                                      render_dialog)
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


def test_hermes_dialog_takes_the_users_words_after_the_answers_into_their_turn():
    # as agents send a conversation on: the turns still alternate, as ChatML, Llama 2 and Mistral ask
    dialog = render_dialog(ROUND_TRIP + [{"role": "user", "content": "And tomorrow?"}], [WEATHER], HERMES)
    assert [m["role"] for m in dialog] == ["system", "user", "assistant", "user"]
    assert dialog[3]["content"] == ("<tool_response>\ncold\n</tool_response>\n<tool_response>\nvery cold\n"
                                    "</tool_response>\n\nAnd tomorrow?")
    later = render_dialog(ROUND_TRIP + [{"role": "user", "content": "And tomorrow?"}, ROUND_TRIP[1], ROUND_TRIP[2]],
                          [WEATHER], HERMES)
    assert [m["role"] for m in later] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert later[5]["content"] == "<tool_response>\ncold\n</tool_response>"


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


LLAMA3_TOKENIZER = SHARED_DATA / "llama3-tokenizer.model"
# a bounded string: greedy over flat logits would otherwise write "!!!..." for ever
BOUNDED = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"]}}}


def greedy_text(grammars: Grammars, tokenizer, constraint: Constraint, bias: dict[int, float] = {}) -> str:
    """What greedy decoding over flat logits (plus bias) writes: the grammar alone decides."""
    row = RowAdjustment(grammars.matcher(constraint))
    flat = torch.zeros(1, tokenizer.n_words)
    for token, value in bias.items():
        flat[0, token] = value
    text = ""
    for _ in range(80):
        token = int(adjust_rows([row], flat.clone()).argmax())
        if token in tokenizer.stop_tokens:
            break
        row.accept(token)
        text += tokenizer.decode([token])
    return text


def test_a_forced_call_can_only_be_a_valid_call():
    tokenizer = Llama3Tokenizer(str(LLAMA3_TOKENIZER))
    grammars = Grammars(tokenizer_info(tokenizer, tokenizer.n_words, tokenizer.stop_tokens))
    for fmt, start in ((HERMES, "<tool_call>\n"), (LLAMA3, '{"name": "weather"')):
        text = greedy_text(grammars, tokenizer, call_constraint([BOUNDED, WEATHER | {"function": {"name": "other"}}],
                                                                "weather", fmt))
        assert text.startswith(start)
        content, calls = parse_tool_calls(text, fmt, {"weather"})
        assert content is None and [call.name for call in calls] == ["weather"], text
        assert len(json.loads(calls[0].arguments)["city"]) <= 4


def test_beside_tools_a_typed_answer_is_a_call_or_that_answer():
    """response_format with tools the model may call: the grammar takes a call of any tool or an
    answer in the schema, and nothing else; whichever the model starts, it finishes."""
    tokenizer = Llama3Tokenizer(str(LLAMA3_TOKENIZER))
    grammars = Grammars(tokenizer_info(tokenizer, tokenizer.n_words, tokenizer.stop_tokens))
    place = {"type": "object", "properties": {"port": {"type": "boolean"}}, "required": ["port"],
             "additionalProperties": False}
    for fmt in (HERMES, LLAMA3):
        constraint = call_or_answer([BOUNDED], fmt, Constraint.json_schema(place))
        starts = {start: tokenizer.encode(start, bos=False, eos=False)[0] for start in ("<", '{"')}
        answered = greedy_text(grammars, tokenizer, constraint, {starts['{"']: 1.0})
        if fmt == HERMES:  # a call starts "<tool_call>"; an answer "{"
            called = greedy_text(grammars, tokenizer, constraint, {starts["<"]: 1.0})
            assert parse_tool_calls(called, fmt, {"weather"})[1][0].name == "weather", called
        assert set(json.loads(answered)) in ({"port"}, {"name", "parameters"}), answered
        call, other = (render_dialog([{"role": "assistant", "content": None, "tool_calls": [
            CALL | {"function": {"name": name, "arguments": '{"city": "Oslo"}'}}]}], [], fmt)[0]["content"]
            for name in ("weather", "other"))
        for text, whole in (('{"port": true}', True), (call, True), ("hello", False), ('{"port": 1}', False),
                            (other, False), (call + '{"port": true}', False)):
            matcher = grammars.matcher(constraint)  # the text, then the end of the turn
            assert (matcher.accept_string(text) and matcher.accept_token(tokenizer.eot_id)) == whole, text
    json_mode = call_or_answer([BOUNDED], HERMES, Constraint("json_object"))
    assert json.loads(json_mode.source)["answer"] == {"type": "object"}
