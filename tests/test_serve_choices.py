"""`n`: several choices of one prompt, whose prefill they share. The scheduler's plan (the later
choices wait for the first's prefill, then share its full blocks), the HTTP side's shapes with
the fake engine (indices, usage, streams, seeds), and the real engine's answers (greedy choices
alike; seeded choice i is what a lone request with seed + i gets, so the shared blocks are right)."""

import json
from types import SimpleNamespace

import httpx
import pytest
import torch

from distributed import run_world
from fake_engine import MODEL, served
from llama_tp import Llama
from llama_tp.engine import GenerationRequest
from llama_tp.engine.blocks import BlockPool
from llama_tp.engine.scheduler import Scheduler
from llama_tp.model.kv_cache import BLOCK_POSITIONS
from llama_tp.model.prefix_cache import PrefixCache
from llama_tp.sampling import SamplingOptions
from llama_tp.serve.prepare import choices
from llama_tp.serve.server import engine_loop
from serve_client import CHAT, COMPLETION, GOOD_CHAT, GOOD_COMPLETION, HELLO, client
from serve_harness import Harness, request, tokens_of
from test_serve_real_engine import MODEL as REAL_MODEL
from test_serve_real_engine import real_server
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

PROMPT = [1, *range(5, 5 + BLOCK_POSITIONS + 5)]  # a full block of the KV cache and some


def choice_request(request_id: str, follows: str = None) -> GenerationRequest:
    return GenerationRequest(request_id, tuple(PROMPT), 4, SamplingOptions(), frozenset({2}),
                             shares_prefill_with=follows)


def test_later_choices_wait_for_the_first_prefill_then_share_its_blocks():
    scheduler = Scheduler(PrefixCache(3), max_prefill_tokens=256, pool=BlockPool(8))
    first = scheduler.admit(choice_request("a"), 0)
    second = scheduler.admit(choice_request("a-1", "a"), 1, follows=first)
    plan = scheduler.plan()
    assert [chunk.sequence for chunk in plan.prefill] == [first] and not plan.decode
    scheduler.fed(plan.prefill[0])
    first.tokens.append(42)  # its first token, chosen from the prefill's last logits
    plan = scheduler.plan()
    assert second.blocks[0] == first.blocks[0] and second.blocks[1] != first.blocks[1]
    assert plan.tables[1] == second.blocks and scheduler.pool.held == 3  # the full block held once
    assert [(chunk.sequence, chunk.start, chunk.tokens) for chunk in plan.decode] == [(first, len(PROMPT), [42])]
    # the rest of the prompt after the shared block, its last token for its logits
    assert [(chunk.sequence, chunk.start, chunk.tokens) for chunk in plan.prefill] == [
        (second, BLOCK_POSITIONS, PROMPT[BLOCK_POSITIONS:])]
    assert second.reused == BLOCK_POSITIONS and scheduler.prefix_cache.rows[1] == PROMPT[:BLOCK_POSITIONS]


def test_a_choice_whose_first_was_cancelled_shares_what_was_prefilled():
    # sharing needs no prefix cache
    scheduler = Scheduler(PrefixCache(2, enabled=False), max_prefill_tokens=BLOCK_POSITIONS + 1, pool=BlockPool(8))
    first = scheduler.admit(choice_request("a"), 0)
    second = scheduler.admit(choice_request("a-1", "a"), 1, follows=first)
    scheduler.fed(scheduler.plan().prefill[0])  # a block and a token of the prompt
    scheduler.release(first)
    plan = scheduler.plan()
    assert second.blocks[0] == 0 and second.reused == BLOCK_POSITIONS
    assert [(chunk.start, chunk.tokens) for chunk in plan.prefill] == [(BLOCK_POSITIONS, PROMPT[BLOCK_POSITIONS:])]


def test_choices_through_the_openai_client(llama2_tokenizer):
    with served(llama2_tokenizer, answer="One two three.") as s:
        openai_client = client(s.url)
        answer = openai_client.chat.completions.create(model=MODEL, messages=HELLO, n=3, seed=7)
        assert [choice.index for choice in answer.choices] == [0, 1, 2]
        assert {choice.message.content for choice in answer.choices} == {"One two three."}
        requests = s.engine.requests[-3:]
        prompt = len(requests[0].prompt_tokens)
        completion = len(llama2_tokenizer.encode("One two three.", bos=False, eos=False))
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt, 3 * completion)
        assert [r.options.seed for r in requests] == [7, 8, 9]  # each choice its own stream
        assert [r.shares_prefill_with for r in requests] == [None, requests[0].id, requests[0].id]
        assert len({r.id for r in requests}) == 3

        chunks = list(openai_client.completions.create(model=MODEL, prompt="Once", n=2, stream=True,
                                                       stream_options={"include_usage": True}))
        texts, reasons = {0: "", 1: ""}, {}
        for chunk in chunks[:-1]:
            (choice,) = chunk.choices
            texts[choice.index] += choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
        assert texts == {0: "One two three.", 1: "One two three."} and reasons == {0: "stop", 1: "stop"}
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * completion
        assert s.engine.requests[-1].options.seed is None  # drawn by the engine, for each choice


def test_streamed_chat_choices_open_and_end_each_index(llama2_tokenizer):
    with served(llama2_tokenizer, answer="Hi.") as s, httpx.Client() as http:
        with http.stream("POST", f"{s.url}{CHAT}", json=GOOD_CHAT | {"n": 2, "stream": True}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        openings = [e["choices"][0] for e in events if e["choices"][0]["delta"].get("role")]
        assert [o["index"] for o in openings] == [0, 1]
        ends = [e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]]
        assert sorted(ends) == [0, 1]


def test_each_streamed_choice_has_its_own_tool_calls(llama2_tokenizer):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with served(llama2_tokenizer, answer=call, max_seq_len=512) as s:
        chunks = list(client(s.url).chat.completions.create(model=MODEL, messages=HELLO, tools=tools, n=2,
                                                            stream=True))
    calls = {c.choices[0].index: c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls}
    assert {index: [(t.index, t.function.name, json.loads(t.function.arguments)) for t in found]
            for index, found in calls.items()} == {0: [(0, "get_weather", {"city": "Paris"})],
                                                   1: [(0, "get_weather", {"city": "Paris"})]}
    reasons = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert reasons == {0: "tool_calls", 1: "tool_calls"}


def test_best_of_equal_to_n_is_accepted_and_a_bad_n_leaves_the_server_serving(llama2_tokenizer):
    with served(llama2_tokenizer, answer="Hi.") as s:
        taken = len(s.engine.requests)
        refused = httpx.post(f"{s.url}{COMPLETION}", json=GOOD_COMPLETION | {"n": 5})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
        assert len(s.engine.requests) == taken  # nothing reached the engine
        answer = httpx.post(f"{s.url}{COMPLETION}", json=GOOD_COMPLETION | {"n": 2, "best_of": 2}).json()
        assert [choice["text"] for choice in answer["choices"]] == ["Hi.", "Hi."]


@pytest.fixture(scope="module")
def llama(checkpoints) -> Llama:
    return Llama.build(str(checkpoints["llama2", 1]), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=4)


@pytest.mark.usefixtures("one_thread")
def test_the_real_engines_choices(llama):
    prompt = "A tale of two cities began"
    with real_server(llama) as server:
        openai_client = client(server.url)
        greedy = openai_client.completions.create(model=REAL_MODEL, prompt=prompt, max_tokens=8, temperature=0, n=3)
        tokens, _ = llama.generate([llama.tokenizer.encode(prompt, bos=True, eos=False)], max_gen_len=8, temperature=0)
        assert [c.text for c in greedy.choices] == [llama.tokenizer.decode(tokens[0])] * 3

        dialog = [{"role": "user", "content": "Tell me a story about a fox."}]
        sampled = openai_client.chat.completions.create(model=REAL_MODEL, messages=dialog, max_tokens=10,
                                                        temperature=1.0, seed=11, n=3, logprobs=True)
        again = openai_client.chat.completions.create(model=REAL_MODEL, messages=dialog, max_tokens=10,
                                                      temperature=1.0, seed=11, n=3, logprobs=True)
        texts = [c.message.content for c in sampled.choices]
        assert texts == [c.message.content for c in again.choices]  # reproducible
        assert len(set(texts)) > 1  # each choice its own stream
        for index, choice in enumerate(sampled.choices):  # what a lone request with seed + index gets
            lone = openai_client.chat.completions.create(model=REAL_MODEL, messages=dialog, max_tokens=10,
                                                         temperature=1.0, seed=11 + index, logprobs=True)
            assert choice.message.content == lone.choices[0].message.content
            assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
                [t.logprob for t in lone.choices[0].logprobs.content], abs=1e-4)
        assert sampled.usage.completion_tokens == sum(
            len(c.logprobs.content) + (c.finish_reason == "stop") for c in sampled.choices)


# 24 prompt tokens: prefilled in two chunks of 16, while the other choices wait
LONG_PROMPT = [1, 18637, 29892, 920, 29871, 13] * 4
SAMPLED = dict(temperature=1.0, top_p=0.95, seed=5)


def _choices_on_two_ranks(checkpoint: str) -> list[list[int]]:
    """Rank 0 submits a request's 3 choices while every rank runs the engine."""
    llama = Llama.build(checkpoint, str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=3)
    if torch.distributed.get_rank() != 0:
        engine_loop(llama, 16, None).run(lambda: False)  # ends when rank 0 stops
        return []
    harness = Harness(llama, start=False)
    streams = [harness.submit(each) for each in choices(SimpleNamespace(n=3), request(llama, LONG_PROMPT, 8, **SAMPLED),
                                                        llama)]
    harness.thread.start()
    answers = [tokens_of(harness.deltas(stream)) for stream in streams]
    harness.close()
    return answers


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_two_ranks_give_each_choice_what_a_lone_request_with_its_seed_gets(tmp_path):
    write_checkpoint(tmp_path, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 2, "dim")
    answers = run_world(2, _choices_on_two_ranks, str(tmp_path))[0]
    single = tmp_path / "single"
    write_checkpoint(single, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")
    llama = Llama.build(str(single), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=3)
    alone = [llama.generate([LONG_PROMPT], max_gen_len=8, **(SAMPLED | {"seed": 5 + index}))[0][0] for index in range(3)]
    assert answers == alone and len({tuple(answer) for answer in answers}) > 1
