"""A thinking model's answers (tests/thinking_model.py: a tiny Qwen3 whose template thinks) through
the official openai client, the Python API and a batch job: the reasoning and the content arrive
apart and join into exactly what the model generated; enable_thinking false thinks not; a JSON
schema and a forced tool call hold the answer after the thinking, never the thinking itself; a
token limit inside the thinking leaves no content."""

import json

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from llama_tp import Llama
from llama_tp.tools.run_batch import Output, answer_all
from serve_client import client
from serve_harness import HttpHarness
from thinking_model import CONTENT, REASONING, thinking_qwen3
from tiny_checkpoint import LLAMA2_TOKENIZER
from torchrun import one_thread, run_script  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "qwen3-thinking"
HELLO = [{"role": "user", "content": "Where is Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return thinking_qwen3(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def llama(checkpoint) -> Llama:
    return Llama.build(str(checkpoint), str(checkpoint / "tokenizer.json"), max_seq_len=1024, max_batch_size=2)


@pytest.fixture(scope="module")
def server(llama):
    harness = HttpHarness(llama, MODEL)
    yield harness
    harness.close()


def generated(llama: Llama, checkpoint, messages: list[dict], **variables) -> str:
    """The text of the model's own greedy answer, its tags and all, decoded by `tokenizers` itself."""
    prompt = llama.formatter.encode_messages(messages, variables=variables)
    tokens, _ = llama.generate([prompt], 64, temperature=0)
    return Tokenizer.from_file(str(checkpoint / "tokenizer.json")).decode(tokens[0])


def chat(server, **options):
    return client(server.url).chat.completions.create(model=MODEL, messages=HELLO, temperature=0, **options)


def streamed(server, **options) -> tuple[list[tuple[str, str]], str]:
    """The stream's deltas as (field, text) in order, and its finish reason."""
    pieces, finish = [], None
    for chunk in chat(server, stream=True, **options):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            pieces += [(field, delta[field]) for field in ("reasoning_content", "content") if delta.get(field)]
            finish = choice.finish_reason or finish
    return pieces, finish


def test_reasoning_and_content_arrive_apart_and_join_into_what_the_model_generated(server, llama, checkpoint):
    text = generated(llama, checkpoint, HELLO)
    assert text == f"<think>{REASONING}</think>\n\n{CONTENT}"  # the model's known answer
    reasoning, _, content = text.removeprefix("<think>").partition("</think>")
    message = chat(server).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (reasoning, content)
    pieces, finish = streamed(server)
    fields = [field for field, _ in pieces]
    assert fields == sorted(fields, reverse=True) and len(pieces) > 2  # the thinking's deltas, then the answer's
    assert "".join(t for f, t in pieces if f == "reasoning_content") == reasoning
    assert "".join(t for f, t in pieces if f == "content") == content
    assert finish == "stop"


def test_enable_thinking_false_gives_no_reasoning(server, llama, checkpoint):
    assert generated(llama, checkpoint, HELLO, enable_thinking=False) == CONTENT
    message = chat(server, extra_body=NO_THINKING).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (None, CONTENT)
    pieces, _ = streamed(server, extra_body=NO_THINKING)
    assert pieces and all(field == "content" for field, _ in pieces)


def test_a_json_schema_holds_the_content_and_not_the_reasoning(server):
    for stream in (False, True):
        if stream:
            pieces, _ = streamed(server, response_format=JSON_SCHEMA)
            reasoning = "".join(t for f, t in pieces if f == "reasoning_content")
            content = "".join(t for f, t in pieces if f == "content")
        else:
            message = chat(server, response_format=JSON_SCHEMA).choices[0].message
            reasoning, content = message.model_extra["reasoning_content"], message.content
        assert reasoning == REASONING  # free text, thought before the grammar began
        jsonschema.validate(json.loads(content), SCHEMA)


def test_a_limit_inside_the_thinking_ends_with_length_and_no_content(server):
    answer = chat(server, max_tokens=3).choices[0]
    assert answer.finish_reason == "length" and answer.message.content is None
    assert REASONING.startswith(answer.message.model_extra["reasoning_content"])
    pieces, finish = streamed(server, max_tokens=3)
    assert finish == "length" and pieces and all(field == "reasoning_content" for field, _ in pieces)


def test_a_forced_call_follows_the_thinking(server):
    for stream in (False, True):
        options = dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
        if stream:
            chunks = list(chat(server, stream=True, **options))
            deltas = [choice.delta for chunk in chunks for choice in chunk.choices]
            reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
            calls = [call for d in deltas for call in d.tool_calls or ()]
        else:
            message = chat(server, **options).choices[0].message
            reasoning, calls = message.model_extra["reasoning_content"], message.tool_calls
        assert reasoning == REASONING
        assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == [
            ("get_weather", {"city": "Paris"})]


def test_an_answer_sent_back_with_its_reasoning_is_taken(server):
    message = chat(server).choices[0].message
    follow_up = client(server.url).chat.completions.create(
        model=MODEL, temperature=0, messages=[*HELLO, message, {"role": "user", "content": "And Rome?"}])
    assert follow_up.choices[0].message.content == "\n\n" + CONTENT


def test_template_variables_the_server_sets_are_refused(server):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(server, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert refused.value.body["param"] == "chat_template_kwargs"
    assert "'add_generation_prompt' is set by the server" in refused.value.body["message"]


def test_the_python_api_keeps_the_two_apart(llama):
    results = llama.chat_completion([HELLO, HELLO], temperature=0, max_gen_len=32)
    assert [r["generation"] for r in results] == 2 * [
        {"role": "assistant", "content": "\n\n" + CONTENT, "reasoning_content": REASONING}]
    off = llama.chat_completion([HELLO], temperature=0, chat_template_kwargs={"enable_thinking": False})
    assert off[0]["generation"] == {"role": "assistant", "content": CONTENT, "reasoning_content": ""}
    held = llama.chat_completion([HELLO], temperature=0, response_format=JSON_SCHEMA)[0]["generation"]
    assert held["reasoning_content"] == REASONING
    jsonschema.validate(json.loads(held["content"]), SCHEMA)


def test_without_a_parser_the_thinking_stays_in_the_answer(checkpoint):
    plain = Llama.build(str(checkpoint), str(checkpoint / "tokenizer.json"), max_seq_len=1024, max_batch_size=1,
                        reasoning_parser="none")
    assert plain.reasoning is None
    assert plain.chat_completion([HELLO], temperature=0)[0]["generation"] == {
        "role": "assistant", "content": f"<think>{REASONING}</think>\n\n{CONTENT}"}


def test_deepseek_r1s_parser_reads_the_answer_as_thinking_from_its_start(checkpoint):
    """DeepSeek-R1's templates open the thinking in the prompt; its parser takes the answer as
    thinking from the start (the tag the model writes anyway dropped), and its grammar waits too."""
    r1 = Llama.build(str(checkpoint), str(checkpoint / "tokenizer.json"), max_seq_len=1024, max_batch_size=1,
                     reasoning_parser="deepseek_r1")
    assert r1.chat_completion([HELLO], temperature=0)[0]["generation"] == {
        "role": "assistant", "content": "\n\n" + CONTENT, "reasoning_content": REASONING}
    held = r1.chat_completion([HELLO], temperature=0, response_format=JSON_SCHEMA)[0]["generation"]
    assert held["reasoning_content"] == REASONING
    jsonschema.validate(json.loads(held["content"]), SCHEMA)
    off = r1.chat_completion([HELLO], temperature=0, chat_template_kwargs={"enable_thinking": False})
    assert off[0]["generation"] == {"role": "assistant", "content": "", "reasoning_content": CONTENT}


def test_a_parser_the_model_cannot_use_is_refused_before_loading(checkpoint, checkpoints):
    with pytest.raises(ValueError, match="^reasoning_parser 'qwen' is not one of qwen3, deepseek_r1 or none$"):
        Llama.build(str(checkpoint), str(checkpoint / "tokenizer.json"), max_seq_len=64, max_batch_size=1,
                    reasoning_parser="qwen")
    with pytest.raises(ValueError, match="reasoning_parser qwen3 needs <think> and </think> as tokens"):
        Llama.build(str(checkpoints["llama2", 1]), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=1,
                    reasoning_parser="qwen3")


def test_a_batch_job_keeps_the_two_apart(llama, tmp_path):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": HELLO, "temperature": 0}}
    with Output(tmp_path / "out.jsonl") as output:
        answer_all(llama, MODEL, [json.dumps(line)], output)
    record = json.loads((tmp_path / "out.jsonl").read_text())
    message = record["response"]["body"]["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (REASONING, "\n\n" + CONTENT)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_the_chat_script_keeps_the_two_apart(checkpoint, tmp_path, stream):
    prompts, output = tmp_path / "dialogs.json", tmp_path / "out.json"
    prompts.write_text(json.dumps([HELLO]))
    result = run_script("chat_completion.py", 1, "--ckpt_dir", str(checkpoint), "--tokenizer_path",
                        str(checkpoint / "tokenizer.json"), "--prompts_file", str(prompts), "--output_json", str(output),
                        "--temperature", "0", "--max_seq_len", "128", *(["--stream"] if stream else []))
    [record] = json.loads(output.read_text())
    assert (record["reasoning_content"], record["generation"]) == (REASONING, "\n\n" + CONTENT)
    assert CONTENT in result.stdout and REASONING in result.stdout
