"""The OpenAI and vLLM fields that reach the engine as options (logit_bias, penalties, structured
outputs), completions' echo, and /tokenize and /detokenize, through the official openai client and
httpx, with a fake engine behind the app."""

import httpx
import pytest

from fake_engine import ANSWER, MODEL, served
from llama_tp.structured.constraint import Constraint
from serve_client import COMPLETION, HELLO, client


@pytest.fixture(scope="module")
def server(llama2_tokenizer):
    with served(llama2_tokenizer, max_seq_len=256) as s:
        yield s


def test_logit_bias_and_penalties_reach_the_engine(server):
    client(server.url).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, presence_penalty=0.5,
                                               frequency_penalty=-1.0, logit_bias={"13": 5, "29": -100, "7": 0})
    request = server.engine.requests[-1]
    assert request.logit_bias == ((13, 5.0), (29, -100.0))  # a bias of 0 changes nothing
    assert (request.presence_penalty, request.frequency_penalty) == (0.5, -1.0)


@pytest.mark.parametrize("body, expected", [
    ({"response_format": {"type": "json_object"}}, Constraint("json_object")),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"choice": ["a", "b"]}}, Constraint("choice", '["a", "b"]')),
    ({"guided_json": '{"type": "integer"}'}, Constraint("json_schema", '{"type": "integer"}')),
    ({"structured_outputs": {"json": {"type": "integer"}}}, Constraint("json_schema", '{"type": "integer"}')),
    ({"guided_regex": "[0-9]+", "guided_decoding_backend": "xgrammar"}, Constraint("regex", "[0-9]+")),
])
def test_structured_fields_become_one_constraint(server, body, expected):
    response = httpx.post(f"{server.url}{COMPLETION}", json={"model": MODEL, "prompt": "x", "max_tokens": 3} | body)
    assert response.status_code == 200, response.text
    assert server.engine.requests[-1].constraint == expected


def test_echo_puts_the_prompt_first_whole_and_streamed(server, llama2_tokenizer):
    openai_client = client(server.url)
    whole = openai_client.completions.create(model=MODEL, prompt="Once upon", max_tokens=50, echo=True)
    assert whole.choices[0].text == "Once upon" + ANSWER
    streamed = openai_client.completions.create(model=MODEL, prompt="Once upon", max_tokens=50, echo=True,
                                                stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == "Once upon" + ANSWER
    ids = llama2_tokenizer.encode("Twice", bos=True, eos=False)
    assert openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=50, echo=True).choices[0].text == \
        "Twice" + ANSWER


def test_tokenize_and_detokenize(server, llama2_tokenizer):
    tokens = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert tokens == {"count": len(tokens["tokens"]), "max_model_len": 256,
                      "tokens": llama2_tokenizer.encode("Hello world", bos=True, eos=False)}
    bare = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == tokens["tokens"][1:]
    dialog = httpx.post(f"{server.url}/tokenize", json={"messages": HELLO}).json()
    assert dialog["tokens"] == server.generator.formatter.encode_dialog_prompt(HELLO)
    # with tools: the prompt a chat completion with them has (the tools described in it)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    with_tools = httpx.post(f"{server.url}/tokenize", json={"messages": HELLO, "tools": tools}).json()
    client(server.url).chat.completions.create(model=MODEL, messages=HELLO, tools=tools, max_tokens=5)
    assert with_tools["tokens"] == list(server.engine.requests[-1].prompt_tokens)
    assert with_tools["count"] > dialog["count"] + 10
    refused = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hi", "tools": tools})
    assert refused.status_code == 400 and "go with `messages`" in refused.json()["error"]["message"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
