"""serve/responses.py's answers in OpenAI's shapes, written out whole, on a stand-in tokenizer whose
tokens are characters: several choices, each streamed, with log probabilities, echo, usage and tool
calls, in milliseconds (test_serve_http.py checks the same answers through a server)."""

import json
import time

from llama_tp.engine import Delta, TokenLogprob
from llama_tp.serve.responses import Answered, ChatReply, CompletionReply, event
from llama_tp.structured.tools import HERMES


class Characters:
    def decode(self, tokens: list[int]) -> str:
        return "".join(map(chr, tokens))


A, B = ord("a"), ord("b")
SAID_A = TokenLogprob(A, -0.5, ((A, -0.5), (B, -1.5)))
SAID_B = TokenLogprob(B, -0.25)
ENDED = Delta(finish_reason="stop", prompt_tokens=5, completion_tokens=2, cached_tokens=3)
CUT = Delta(finish_reason="length", prompt_tokens=5, completion_tokens=3, cached_tokens=3)
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def chunks(reply, events: list[bytes]) -> list:
    """Each event's data, with the reply's own id, object, created and model checked and taken out."""
    found = []
    for data in events:
        assert data.startswith(b"data: ") and data.endswith(b"\n\n")
        if data == b"data: [DONE]\n\n":
            found.append("[DONE]")
            continue
        chunk = json.loads(data[len(b"data: "):])
        head = {"id": reply.id, "object": reply.chunk_object, "created": reply.created, "model": "m"}
        assert {key: chunk.pop(key) for key in head} == head
        found.append(chunk)
    return found


def without_ids(calls: list[dict]) -> list[dict]:
    for call in calls:
        assert call.pop("id").startswith("call_")
    return calls


def test_an_event_is_compact_json_with_text_as_written():
    assert event({"text": "é ü", "n": [1, 2]}) == 'data: {"text":"é ü","n":[1,2]}\n\n'.encode()


def test_a_whole_chat_answer_has_each_choice_and_the_usage_once():
    reply = ChatReply("m", Characters(), n=2)
    answer = reply.response([Answered("hi", [SAID_A, SAID_B], ENDED), Answered("yo", None, CUT)])
    assert reply.id.startswith("chatcmpl-") and abs(reply.created - time.time()) < 5
    assert answer == {"id": reply.id, "object": "chat.completion", "created": reply.created, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop", "logprobs": {"content": [
            {"token": "a", "logprob": -0.5, "bytes": [A],
             "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [A]}, {"token": "b", "logprob": -1.5, "bytes": [B]}]},
            {"token": "b", "logprob": -0.25, "bytes": [B], "top_logprobs": []}]}},
        {"index": 1, "message": {"role": "assistant", "content": "yo"}, "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                  "prompt_tokens_details": {"cached_tokens": 3}}}


def test_a_chat_stream_of_two_choices_ends_after_both_with_the_usage():
    reply = ChatReply("m", Characters(), include_usage=True, n=2)
    events = reply.opening()
    events += reply.chunks(1, Delta(text="", logprobs=(SAID_B,)), logprobs=True)  # a token with no whole text yet
    events += reply.chunks(0, Delta(text="a", logprobs=(SAID_A,)), logprobs=False)
    events += reply.chunks(1, ENDED, logprobs=True)  # choice 0 is still open: no usage, no [DONE]
    events += reply.chunks(0, Delta(text="b", finish_reason="cancelled", prompt_tokens=5, completion_tokens=1),
                           logprobs=False)
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}}
    assert chunks(reply, events) == [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}], "usage": None},
        {"choices": [{"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}], "usage": None},
        {"choices": [{"index": 1, "delta": {"content": ""}, "finish_reason": None, "logprobs": {"content": [
            {"token": "b", "logprob": -0.25, "bytes": [B], "top_logprobs": []}]}}], "usage": None},
        {"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None}], "usage": None},
        {"choices": [{"index": 1, "delta": {}, "logprobs": None, "finish_reason": "stop"}], "usage": None},
        {"choices": [{"index": 0, "delta": {"content": "b"}, "logprobs": None, "finish_reason": None}], "usage": None},
        {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}], "usage": None},
        {"choices": [], "usage": usage},
        "[DONE]",
    ]


def test_by_default_a_stream_is_one_choice_without_usage():
    for reply in (ChatReply("m", Characters()), CompletionReply("m", Characters())):
        assert chunks(reply, reply.chunks(0, ENDED, logprobs=False)) == [
            {"choices": [reply.chunk_choice(0, "", None, "stop")]}, "[DONE]"]


def test_tool_calls_are_answered_whole_and_streamed_when_their_choice_ends():
    reply = ChatReply("m", Characters(), include_usage=True, n=2)
    reply.tools = (HERMES, {"get_weather"})
    answer = reply.response([Answered("Let me look." + WEATHER_CALL, None, ENDED), Answered(WEATHER_CALL, None, CUT)])
    first, cut = answer["choices"]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert without_ids(first["message"].pop("tool_calls")) == [call]
    assert without_ids(cut["message"].pop("tool_calls")) == [call]
    assert first == {"index": 0, "message": {"role": "assistant", "content": "Let me look."}, "logprobs": None,
                     "finish_reason": "tool_calls"}
    assert cut == {"index": 1, "message": {"role": "assistant", "content": None}, "logprobs": None,
                   "finish_reason": "length"}  # cut short: the call is shown, the reason stays
    plain = reply.response([Answered("No call.", None, ENDED)])["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "No call."} and plain["finish_reason"] == "stop"

    events = reply.chunks(1, Delta(text="Let me look."), logprobs=False)
    assert events == []  # held until the choice ends: a call is only known once it is whole
    events += reply.chunks(1, Delta(text=WEATHER_CALL, finish_reason="stop"), logprobs=False)
    streamed = chunks(reply, events)
    assert without_ids(streamed[1]["choices"][0]["delta"]["tool_calls"]) == [call | {"index": 0}]
    assert streamed == [
        {"choices": [{"index": 1, "delta": {"content": "Let me look."}, "logprobs": None, "finish_reason": None}],
         "usage": None},
        {"choices": [{"index": 1, "delta": {"tool_calls": [call | {"index": 0}]}, "logprobs": None,
                      "finish_reason": None}], "usage": None},
        {"choices": [{"index": 1, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}], "usage": None},
    ]
    ended = reply.chunks(0, Delta(text="Hi", finish_reason="stop", prompt_tokens=4, completion_tokens=1), logprobs=False)
    assert chunks(reply, ended) == [
        {"choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}], "usage": None},
        {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}], "usage": None},
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5,
                                  "prompt_tokens_details": {"cached_tokens": 0}}},
        "[DONE]",
    ]


def test_a_completion_has_each_choices_text_and_legacy_log_probabilities():
    reply = CompletionReply("m", Characters(), n=2)
    answer = reply.response([Answered("ab", [SAID_A, SAID_B], ENDED), Answered("b", None, CUT)])
    assert reply.id.startswith("cmpl-") and answer["object"] == "text_completion" and answer["model"] == "m"
    assert answer["choices"] == [
        {"index": 0, "text": "ab", "finish_reason": "stop", "logprobs": {
            "tokens": ["a", "b"], "token_logprobs": [-0.5, -0.25], "top_logprobs": [{"a": -0.5, "b": -1.5}, {}],
            "text_offset": [0, 1]}},
        {"index": 1, "text": "b", "logprobs": None, "finish_reason": "length"}]


def test_a_completion_streams_each_choices_own_text_offsets():
    reply = CompletionReply("m", Characters(), n=2)
    events = []
    for index, said in ((0, SAID_A), (1, SAID_B), (0, SAID_B)):
        events += reply.chunks(index, Delta(text=chr(said.token), logprobs=(said,)), logprobs=True)
    assert chunks(reply, events) == [
        {"choices": [{"index": 0, "text": "a", "finish_reason": None, "logprobs": {
            "tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5, "b": -1.5}], "text_offset": [0]}}]},
        {"choices": [{"index": 1, "text": "b", "finish_reason": None, "logprobs": {
            "tokens": ["b"], "token_logprobs": [-0.25], "top_logprobs": [{}], "text_offset": [0]}}]},
        {"choices": [{"index": 0, "text": "b", "finish_reason": None, "logprobs": {
            "tokens": ["b"], "token_logprobs": [-0.25], "top_logprobs": [{}], "text_offset": [1]}}]},
    ]


def test_echo_puts_the_prompt_before_each_choice_whole_and_streamed():
    reply = CompletionReply("m", Characters(), n=2)
    reply.echo = "Q:"
    answer = reply.response([Answered("a", None, ENDED), Answered("b", None, CUT)])
    assert [choice["text"] for choice in answer["choices"]] == ["Q:a", "Q:b"]
    assert chunks(reply, reply.opening()) == [
        {"choices": [{"index": 0, "text": "Q:", "logprobs": None, "finish_reason": None}]},
        {"choices": [{"index": 1, "text": "Q:", "logprobs": None, "finish_reason": None}]},
    ]
    assert CompletionReply("m", Characters()).opening() == []  # no echo: the stream begins with the text
