"""serve/protocol.py's parse_body, without a server: each refusal's exact status, message, param
and code (the HTTP tests check that they reach the client), and what accepted bodies become."""

import json

import pytest

from llama_tp.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestError,
                                     TokenizeRequest, error_body, parse_body)

M = {"model": "m"}
HI = [{"role": "user", "content": "hi"}]
CHAT = M | {"messages": HI}
PARTS = '{"type": "text", "text": ...}'
CONTENT_REQUIRED = "`content` is required (it may be null only beside an assistant's `tool_calls`)"
SCHEMA_SHAPE = ('{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, or a type "text" or '
                '"json_object" alone')

REFUSALS = {
    # name: (request model, body (a dict, or raw bytes), message, param, code)
    "not JSON": (ChatCompletionRequest, b'{"model": "m", ', "the body is not valid JSON: Expecting property name "
                 "enclosed in double quotes: line 1 column 16 (char 15)", None, "invalid_json"),
    "Infinity": (ChatCompletionRequest, b'{"model": "m", "temperature": Infinity}',
                 "the body is not valid JSON: Infinity is not a JSON number", None, "invalid_json"),
    "a list": (ChatCompletionRequest, b"[1]", "the body must be a JSON object, found list", None, "invalid_json"),
    "no model": (ChatCompletionRequest, {"messages": HI}, "`model` is required", "model",
                 "missing_required_parameter"),
    "unknown field": (ChatCompletionRequest, CHAT | {"colour": 1}, "`colour` is not a field this server knows (see "
                      "docs/serving.md for those it takes)", "colour", "unknown_parameter"),
    "stream_options alone": (ChatCompletionRequest, CHAT | {"stream_options": {"include_usage": True}},
                             "`stream_options` is only allowed when `stream` is true", "stream_options", "invalid_value"),
    "stream_options, stream false": (ChatCompletionRequest, CHAT | {"stream": False, "stream_options": {}},
                                     "`stream_options` is only allowed when `stream` is true", "stream_options",
                                     "invalid_value"),
    "no content": (ChatCompletionRequest, M | {"messages": [{"role": "user"}]}, f"`messages[0]`: {CONTENT_REQUIRED}",
                   "messages[0]", "invalid_value"),
    "null content, no calls": (ChatCompletionRequest, M | {"messages": [{"role": "assistant", "content": None}]},
                               f"`messages[0]`: {CONTENT_REQUIRED}", "messages[0]", "invalid_value"),
    "null content beside a user's calls": (
        ChatCompletionRequest, M | {"messages": [{"role": "user", "content": None, "tool_calls": []}]},
        f"`messages[0]`: {CONTENT_REQUIRED}", "messages[0]", "invalid_value"),
    "a user's calls": (ChatCompletionRequest, M | {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
        "`messages[0]`: `tool_calls` belong to assistant messages, not 'user' ones", "messages[0]", "invalid_value"),
    "an image part": (ChatCompletionRequest, M | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                      '`messages[0].content`: part 0 is of type "image_url", which is not supported by this server: '
                      "it takes text parts only", "messages[0].content", "unsupported_parameter"),
    "a part's text a number": (
        ChatCompletionRequest, M | {"messages": [HI[0], {"role": "user", "content": [{"type": "text", "text": 3}]}]},
        f'`messages[1].content` must be a string or a list of parts {PARTS}, found [{{"type": "text", "text": 3}}]',
        "messages[1].content", "invalid_type"),
    "a part without text": (ChatCompletionRequest, M | {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
                            f'`messages[0].content` must be a string or a list of parts {PARTS}, found [{{"type": '
                            '"text"}]', "messages[0].content", "invalid_type"),
    "parts not objects": (ChatCompletionRequest, M | {"messages": [{"role": "user", "content": ["a"]}]},
                          f'`messages[0].content` must be a string or a list of parts {PARTS}, found ["a"]',
                          "messages[0].content", "invalid_type"),
    "a participant name": (ChatCompletionRequest, M | {"messages": [{"role": "user", "content": "x", "name": "bob"}]},
                           '`messages[0].name` = "bob" is not supported by this server: a message\'s participant '
                           "name has no place in this model's chat format", "messages[0].name", "unsupported_parameter"),
    "another tier": (ChatCompletionRequest, CHAT | {"service_tier": "flex"}, '`service_tier` = "flex" is not '
                     "supported by this server: it has one tier", "service_tier", "unsupported_parameter"),
    "store": (ChatCompletionRequest, CHAT | {"store": True}, "`store` = true is not supported by this server: it "
              "stores no answers", "store", "unsupported_parameter"),
    "a long unsupported value": (ChatCompletionRequest, CHAT | {"modalities": ["text", "audio"] * 10},
                                 '`modalities` = ["text", "audio", "text", "audio", "text", "audio", "text... is not '
                                 "supported by this server: it answers in text only", "modalities",
                                 "unsupported_parameter"),
    "a stop that is not a string": (ChatCompletionRequest, CHAT | {"stop": ["a", 1]}, '`stop` must be a string or a '
                                    'list of strings, found ["a", 1]', "stop", "invalid_type"),
    "a long wrong value": (ChatCompletionRequest, CHAT | {"temperature": "x" * 100},
                           f'`temperature`: input should be a valid number, found "{"x" * 76}...', "temperature",
                           "invalid_type"),
    "a wrong value of 80 characters": (ChatCompletionRequest, CHAT | {"temperature": "x" * 78},
                                       f'`temperature`: input should be a valid number, found "{"x" * 78}"',
                                       "temperature", "invalid_type"),
    "one of 81": (ChatCompletionRequest, CHAT | {"temperature": "x" * 79},
                  f'`temperature`: input should be a valid number, found "{"x" * 76}...', "temperature", "invalid_type"),
    "too many top_logprobs": (ChatCompletionRequest, CHAT | {"top_logprobs": 21}, "`top_logprobs`: input should be "
                              "less than or equal to 20, found 21", "top_logprobs", "invalid_value"),
    "max_tokens 0": (ChatCompletionRequest, CHAT | {"max_tokens": 0}, "`max_tokens`: input should be greater than or "
                     "equal to 1, found 0", "max_tokens", "invalid_value"),
    "a seed past 64 bits": (ChatCompletionRequest, CHAT | {"seed": 2**63}, "`seed`: input should be less than "
                            f"{2**63}, found {2**63}", "seed", "invalid_value"),
    "json_schema without its schema": (ChatCompletionRequest, CHAT | {"response_format": {"type": "json_schema"}},
                                       f'`response_format` must be {SCHEMA_SHAPE}, found {{"type": "json_schema"}}',
                                       "response_format", "invalid_type"),
    "a schema with type text": (ChatCompletionRequest, CHAT | {"response_format": {"type": "text", "json_schema": {
        "name": "a"}}}, f'`response_format` must be {SCHEMA_SHAPE}, found {{"type": "text", "json_schema": '
        '{"name": "a"}}', "response_format", "invalid_type"),
    "a tool choice's name a number": (ChatCompletionRequest, CHAT | {"tool_choice": {"type": "function", "function": {
        "name": 3}}}, "`tool_choice`: input should be 'none', 'auto' or 'required', found {\"type\": \"function\", "
        '"function": {"name": 3}}', "tool_choice", "invalid_value"),
    "two prompts": (CompletionRequest, M | {"prompt": ["a", "b"]}, "`prompt`: 2 prompts in one request are not "
                    "supported by this server: send 2 requests of one prompt each", "prompt", "unsupported_parameter"),
    "two token prompts": (CompletionRequest, M | {"prompt": [[1, 2], [3], [4]]}, "`prompt`: 3 prompts in one request "
                          "are not supported by this server: send 3 requests of one prompt each", "prompt",
                          "unsupported_parameter"),
    "a boolean token": (CompletionRequest, M | {"prompt": [1, True]}, "`prompt` must be a string or a list of token "
                        "ids (or a list of one of them), found [1, true]", "prompt", "invalid_type"),
    "a prompt and something else": (CompletionRequest, M | {"prompt": ["a", {"x": 1}]}, "`prompt` must be a string "
                                    'or a list of token ids (or a list of one of them), found ["a", {"x": 1}]', "prompt",
                                    "invalid_type"),
    "an unsupported value of 60 characters": (ChatCompletionRequest, CHAT | {"modalities": ["x" * 56]},
                                              f'`modalities` = ["{"x" * 56}"] is not supported by this server: it '
                                              "answers in text only", "modalities", "unsupported_parameter"),
    "one of 61": (ChatCompletionRequest, CHAT | {"modalities": ["x" * 57]}, f'`modalities` = ["{"x" * 55}... is not '
                  "supported by this server: it answers in text only", "modalities", "unsupported_parameter"),
    "a number prompt": (CompletionRequest, M | {"prompt": 5}, "`prompt` must be a string or a list of token ids (or "
                        "a list of one of them), found 5", "prompt", "invalid_type"),
    "a suffix": (CompletionRequest, M | {"prompt": "x", "suffix": "y"}, '`suffix` = "y" is not supported by this '
                 "server: it does not fill in text before a suffix", "suffix", "unsupported_parameter"),
    "neither prompt nor messages": (TokenizeRequest, M, "the body must have one of `prompt` or `messages`", None,
                                    "invalid_type"),
    "prompt and messages": (TokenizeRequest, {"prompt": "a", "messages": HI}, "the body must have one of `prompt` or "
                            "`messages`", None, "invalid_type"),
    "a refusal to tokenize": (TokenizeRequest, {"messages": [{"role": "user", "content": "x", "refusal": "no"}]},
                              '`messages[0].refusal` = "no" is not supported by this server: it takes a message\'s '
                              "text as content", "messages[0].refusal", "unsupported_parameter"),
    "a token that is text": (DetokenizeRequest, {"tokens": [1, "a"]}, '`tokens[1]`: input should be a valid integer, '
                             'found "a"', "tokens[1]", "invalid_type"),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_each_refusal_says_exactly_what_is_wrong(name):
    model, body, message, param, code = REFUSALS[name]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(RequestError) as refused:
        parse_body(raw, model)
    error = refused.value
    assert (error.status, error.message, error.param, error.code, str(error)) == (400, message, param, code, message)
    assert error.body() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                      "code": code}}


def test_error_types_follow_the_status():
    types = {status: error_body(status, "m")["error"]["type"] for status in (400, 401, 404, 405, 429, 500, 503, 418)}
    assert types == {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                     405: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
                     503: "server_error", 418: "server_error"}
    assert error_body(429, "busy", "p", "c") == {"error": {"message": "busy", "type": "rate_limit_error",
                                                           "param": "p", "code": "c"}}


def parsed(model, body: dict):
    return parse_body(json.dumps(body).encode(), model)


def test_accepted_bodies_are_normalised():
    chat = parsed(ChatCompletionRequest, M | {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}], "stop": "end"})
    assert [m.content for m in chat.messages] == ["a\nb", None] and chat.stop == ["end"]
    assert parsed(ChatCompletionRequest, CHAT | {"stop": ["x", "y"]}).stop == ["x", "y"]
    assert parsed(ChatCompletionRequest, CHAT).stop is None
    assert parsed(CompletionRequest, M | {"prompt": ["only"]}).prompt == "only"
    assert parsed(CompletionRequest, M | {"prompt": [[5, 6]]}).prompt == [5, 6]
    assert parsed(CompletionRequest, M | {"prompt": [5, 6]}).prompt == [5, 6]
    assert parsed(CompletionRequest, M | {"prompt": "text"}).prompt == "text"


def test_values_that_change_nothing_are_taken():
    neutral = {"service_tier": "auto", "store": False, "modalities": ["text"], "functions": [],
               "function_call": "none", "audio": None}
    parsed(ChatCompletionRequest, CHAT | neutral)
    parsed(ChatCompletionRequest, CHAT | {"service_tier": "default"})
    parsed(CompletionRequest, M | {"prompt": "x", "best_of": 1, "suffix": ""})


def test_include_usage_needs_both_stream_options_and_its_flag():
    assert parsed(ChatCompletionRequest, CHAT | {"stream": True, "stream_options": {"include_usage": True}}).include_usage
    assert not parsed(ChatCompletionRequest, CHAT | {"stream": True, "stream_options": {}}).include_usage
    assert not parsed(ChatCompletionRequest, CHAT | {"stream": True}).include_usage
