"""Anthropic's Messages bodies without a server: what a dialog becomes as a chat completion's body
(the shared pipeline's input), every refusal word for word in Anthropic's error envelope, and a
forced call's input read piece by piece as a model writes it."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llama_tp.serve.messages.protocol import CountTokensRequest, MessagesRequest, messages_error
from llama_tp.serve.messages.reply import CallInput
from llama_tp.serve.messages.translate import chat_body
from llama_tp.serve.protocol import ChatCompletionRequest, RequestError, parse_body

WEATHER = {"name": "weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASKED = {"role": "user", "content": "How cold is Oslo?"}


def messages_body(**fields) -> MessagesRequest:
    return parse_body(json.dumps({"model": "m", "max_tokens": 10, "messages": [ASKED]} | fields).encode(),
                      MessagesRequest)


def test_a_dialog_with_calls_and_results_is_the_chat_body_it_means():
    body = messages_body(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Use metric units."}],
        messages=[ASKED,
                  {"role": "assistant", "content": [
                      {"type": "thinking", "thinking": "Oslo is in Norway.", "signature": "x"},
                      {"type": "text", "text": "Let me look."},
                      {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}},
                      {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Bergen"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "-3"},
                                                                                     {"type": "text", "text": "C"}]},
                      {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True},
                      {"type": "text", "text": "And"}, {"type": "text", "text": "Paris?"}]}],
        tools=[WEATHER], tool_choice={"type": "auto"}, stop_sequences=["\n\n"], temperature=0, top_k=5,
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
        thinking={"type": "enabled", "budget_tokens": 2048})
    expected = ChatCompletionRequest.model_validate({
        "model": "m", "max_tokens": 10, "stop": ["\n\n"], "temperature": 0.0, "top_k": 5,
        "messages": [
            {"role": "system", "content": "Be brief.\nUse metric units."},
            ASKED,
            {"role": "assistant", "content": "Let me look.", "reasoning_content": "Oslo is in Norway.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
                {"id": "toolu_2", "type": "function", "function": {"name": "weather",
                                                                   "arguments": '{"city": "Bergen"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "-3\nC"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
            {"role": "user", "content": "And\nParis?"}],
        "tools": [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                                    "parameters": WEATHER["input_schema"]}}],
        "tool_choice": "auto", "chat_template_kwargs": {"enable_thinking": True},
        "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}}})
    assert chat_body(body) == expected


@pytest.mark.parametrize("choice, chat_choice", [
    ({"type": "any"}, "required"), ({"type": "none"}, "none"), ({"type": "auto"}, "auto"),
    ({"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
     {"type": "function", "function": {"name": "weather"}})])
def test_tool_choices_are_openais(choice, chat_choice):
    body = chat_body(messages_body(tools=[WEATHER], tool_choice=choice))
    assert body.tool_choice == (chat_choice if isinstance(chat_choice, str) else
                                ChatCompletionRequest.model_validate({"model": "m", "messages": [ASKED],
                                                                      "tool_choice": chat_choice}).tool_choice)


@pytest.mark.parametrize("thinking, enabled", [("enabled", True), ("adaptive", True), ("disabled", False)])
def test_thinking_is_the_templates_switch(thinking, enabled):
    body = chat_body(messages_body(thinking={"type": thinking}))
    assert body.chat_template_kwargs == {"enable_thinking": enabled}
    assert chat_body(messages_body()).chat_template_kwargs is None  # the template's own default


def test_a_call_alone_has_no_content_and_an_empty_message_stays_a_turn():
    body = chat_body(messages_body(messages=[ASKED, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "weather", "input": {}}]}, {"role": "user", "content": []}]))
    assert body.messages[1].content is None and body.messages[1].tool_calls[0].function.arguments == "{}"
    assert [(m.role, m.content) for m in body.messages[2:]] == [("user", "")]


def test_count_tokens_bodies_translate_without_the_answers_settings():
    body = parse_body(json.dumps({"model": "m", "messages": [ASKED], "system": "Hi"}).encode(), CountTokensRequest)
    chat = chat_body(body)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Hi"), ("user", ASKED["content"])]
    assert chat.max_tokens is None and chat.stop is None


def refusal(body: dict, body_type=MessagesRequest) -> tuple[int, dict]:
    try:
        chat_body(parse_body(json.dumps(body).encode(), body_type))
    except RequestError as error:
        return messages_error(error)
    raise AssertionError(f"accepted: {body}")


def invalid(message: str) -> tuple[int, dict]:
    return 400, {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


GOOD = {"model": "m", "max_tokens": 10, "messages": [ASKED]}
REFUSALS = {
    "missing max_tokens": ({"model": "m", "messages": [ASKED]}, invalid("`max_tokens` is required")),
    "unknown role": (GOOD | {"messages": [{"role": "system", "content": "Be brief."}]}, invalid(
        '`messages[0].role` must be "user" or "assistant" (a system prompt goes in the top-level `system`), '
        'found "system"')),
    "negative max_tokens": (GOOD | {"max_tokens": -1}, invalid(
        "`max_tokens`: input should be greater than or equal to 1, found -1")),
    "empty messages": (GOOD | {"messages": []}, invalid(
        "`messages`: list should have at least 1 item after validation, not 0, found []")),
    "unknown field": (GOOD | {"n": 2}, invalid(
        "`n` is not a field this server knows (see docs/serving.md for those it takes)")),
    "unknown field in a block": (GOOD | {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "colour": "red"}]}]}, invalid(
        "`messages[0].content[0].colour` is not a field this server knows (see docs/serving.md for those it takes)")),
    "an image": (GOOD | {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, invalid(
        '`messages[0].content`: block 0 is of type "image", which is not supported by this server: it takes text, '
        "tool_use, tool_result and thinking blocks (no images or documents)")),
    "a user's tool_use": (GOOD | {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "weather", "input": {}}]}]}, invalid(
        "`messages[0]`: block 0 is a tool_use block, which belongs to assistant messages, not user ones")),
    "a call without its input": (GOOD | {"messages": [ASKED, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "weather"}]}]}, invalid(
        "`messages[1].content[0].input` is required")),
    "a server tool": (GOOD | {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, invalid(
        '`tools[0]`: a tool of type "web_search_20250305" is one of Anthropic\'s server tools, which this server '
        'does not run: it takes the client\'s own tools {"name", "description", "input_schema"}')),
    "a tool's input not an object": (GOOD | {"tools": [WEATHER | {"input_schema": {"type": "string"}}]}, invalid(
        '`tools[0]`: the tool\'s `input_schema` must be an object\'s schema, {"type": "object", ...}')),
    "a forced call without tools": (GOOD | {"tool_choice": {"type": "any"}}, invalid(
        '`tool_choice` {"type": "any"} needs `tools`')),
    "a named tool not among them": (GOOD | {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "time"}},
                                    invalid('`tool_choice.name` is "time", which is not one of the tools: weather')),
    "a tool choice without its name": (GOOD | {"tools": [WEATHER], "tool_choice": {"type": "tool"}}, invalid(
        '`tool_choice` must be {"type": "tool", "name": ...}, or a type "auto", "any" or "none" without a name, '
        'found {"type": "tool"}')),
    "MCP servers": (GOOD | {"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, invalid(
        '`mcp_servers` = [{"type": "url", "url": "https://x", "name": "x"}] is not supported by this server: it '
        "connects to no MCP servers; run them in the client")),
    "a deferred tool": (GOOD | {"tools": [WEATHER | {"defer_loading": True}]}, invalid(
        "`tools[0].defer_loading` = true is not supported by this server: it does not search tools")),
    "a system image": (GOOD | {"system": [{"type": "image"}]}, invalid(
        '`system`: block 0 is of type "image", which is not supported by this server: it takes text blocks only '
        "here")),
    "count_tokens without messages": ({"model": "m"}, invalid("`messages` is required")),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_word_for_word(case):
    body, expected = REFUSALS[case]
    assert refusal(body, CountTokensRequest if case.startswith("count_tokens") else MessagesRequest) == expected


def test_the_shared_checks_name_fields_as_messages_clients_sent_them():
    error = RequestError(400, "`response_format.json_schema.schema` cannot be compiled into a grammar: x; and `stop`",
                         "response_format.json_schema.schema", "invalid_value")
    assert messages_error(error) == invalid("`output_config.format.schema` cannot be compiled into a grammar: x; "
                                            "and `stop_sequences`")


@pytest.mark.parametrize("status, shown, kind", [
    (401, 401, "authentication_error"), (404, 404, "not_found_error"), (405, 405, "invalid_request_error"),
    (413, 413, "request_too_large"), (429, 429, "rate_limit_error"), (500, 500, "api_error"),
    (503, 529, "overloaded_error")])
def test_statuses_and_error_types(status, shown, kind):
    assert messages_error(RequestError(status, "why")) == (shown, {"type": "error",
                                                                   "error": {"type": kind, "message": "why"}})


def test_neutral_values_of_what_is_not_done_are_accepted():
    body = messages_body(service_tier="standard_only", speed="standard", mcp_servers=[], metadata={"user_id": "u"},
                         thinking={"type": "disabled"}, output_config={"effort": "low"},
                         cache_control={"type": "ephemeral"}, container=None)
    assert chat_body(body).response_format is None


# A forced call's input, read as the model writes it

def pieces_of(text: str, cuts: list[int]) -> tuple[CallInput, list[str]]:
    call, pieces, start = CallInput(), [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        pieces.append(call.push(text[start:cut]))
        start = cut
    return call, pieces


@pytest.mark.parametrize("before, key, after", [("<tool_call>\n", "arguments", "\n</tool_call>"),
                                                ("", "parameters", "")])
def test_a_forced_call_streams_its_input_and_nothing_else(before, key, after):
    arguments = '{"city": "Os{lo}\\" [x", "days": [1, {"a": 2}]}'
    text = f'{before}{{"name": "weather", "{key}": {arguments}}}{after}'
    call, pieces = pieces_of(text, list(range(len(text))))  # one character at a time
    assert call.name == "weather" and call.closed
    assert "".join(pieces) == arguments and sum(1 for piece in pieces if piece) > 10


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=8)


@given(st.dictionaries(st.text(max_size=6), JSON, max_size=4), st.lists(st.integers(0, 200), max_size=12),
       st.sampled_from([(",", ":"), (", ", ": ")]))
def test_any_input_split_anywhere_comes_out_whole(arguments, cuts, separators):
    written = json.dumps(arguments, separators=separators, ensure_ascii=False)
    text = f'<tool_call>\n{{"name"{separators[1]}"f"{separators[0]}"arguments"{separators[1]}{written}}}\n</tool_call>'
    call, pieces = pieces_of(text, [cut for cut in cuts if cut <= len(text)])
    assert call.closed and json.loads("".join(pieces)) == arguments and "".join(pieces) == written
