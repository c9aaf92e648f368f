"""Prefix reuse, measured as a client sees it: time to first token with and without the server
reusing what its cache holds.

    python -m llama_tp.bench_serve --url http://127.0.0.1:8000 --case reuse

Two cases, one request at a time:
- a conversation of TURNS turns, each sending the whole history again (a passage to read and a
  question about it per turn, the answers greedy), growing to about 1500 tokens;
- questions behind one long system prompt (about 1000 tokens) shared with an earlier request.
'Without reuse' is the same request with a marker of its own at the very start, so that no cache
row holds any of it: the same lengths, every token prefilled. The server reports what it reused
(usage.prompt_tokens_details.cached_tokens), which the table shows beside the times.
"""

import asyncio
import itertools
import statistics
from typing import Optional

import httpx

from .stream_client import Outcome, send

TURNS = 10
ANSWER_TOKENS = 40
PASSAGES = (
    "The lighthouse on the northern cape was built in 1872, after three ships ran aground on the reef in a single "
    "winter. Its keeper lived in a small stone house beside the tower with his wife and four children, and kept a "
    "daily log of the weather, the ships that passed and the oil the lamp burned. The log survives in the town "
    "museum, and shows that in the stormiest years the lamp burned almost twice as much oil as in calm ones.",
    "Honeybees communicate the direction of flowers with a waggle dance. A forager returning to the hive walks a "
    "short straight line while shaking her body, then circles back and repeats it. The angle of the straight run "
    "against the vertical comb gives the direction of the food relative to the sun, and the length of the run "
    "tells how far away it is. Other bees follow the dancer and then fly out to find the flowers themselves.",
    "In the early days of railways, every town kept its own local time, set by the sun at noon. A train leaving "
    "one town at ten o'clock might arrive in the next before ten by that town's clock. Timetables became so "
    "confusing that the railway companies agreed on a single standard time, and over the following decades "
    "countries divided the world into time zones, each an hour apart, which we still use today.",
    "A sourdough starter is a mixture of flour and water in which wild yeasts and bacteria live together. The "
    "yeasts make the gas that raises the bread, while the bacteria produce acids that give it a sour taste and "
    "help it keep longer. A baker feeds the starter with fresh flour and water every day, and keeps part of it "
    "for the next loaf, so that some starters have been kept alive for many years.",
    "The city's first public library opened in a single room above the market hall, with four hundred books "
    "donated by a retired ship's captain. Anyone who could write their name could borrow one book a week. Within "
    "ten years the collection had grown so large that the council built a new library by the river, with a "
    "reading room, a children's corner and a map room that is still the most popular part of the building.",
)
QUESTIONS = ("What is the main point of this passage?", "Which detail in it surprised you most, and why?",
             "Summarise it in one sentence.", "What question would you ask its author?")
RULES = ("Answer politely and briefly, in plain words that a child could follow.",
         "When a question is ambiguous, say which reading you answer before answering it.",
         "Never invent facts, names, dates or numbers; say when you do not know something.",
         "Prefer examples from everyday life to abstract explanations.",
         "If asked for a list, give at most five items, most important first.",
         "Keep the user's own words where they are precise, and explain any technical term you use.")


def house_rules(count: int) -> str:
    """A deployed assistant's system prompt of count numbered rules (about 16 tokens each)."""
    return " ".join(f"Rule {n}: {rule}" for n, rule in enumerate(itertools.islice(itertools.cycle(RULES), count),
                                                                   start=1))


SYSTEM_PROMPT = house_rules(60)  # about 1000 tokens
SHARED_QUESTIONS = ("How do I boil an egg?", "Why do cats purr?", "What is a good name for a goldfish?",
                    "How far away is the moon?")


def unshared(messages: list[dict], marker: int) -> list[dict]:
    """The same messages with a marker of their own at the very start: nothing of them is cached."""
    first = messages[0]
    return [first | {"content": f"[{marker}] {first['content']}"}, *messages[1:]]


def body(model: str, messages: list[dict], max_tokens: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "repetition_penalty": 1.0, "stream": True, "stream_options": {"include_usage": True}}


async def ask(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int) -> Outcome:
    outcome = await send(client, url, body(model, messages, max_tokens))
    if outcome.error:
        raise ValueError(f"a request failed: {outcome.error}")
    return outcome


def row(case: str, reused: Outcome, fresh: Outcome) -> dict:
    return {"case": case, "cached_tokens": reused.cached_tokens, "cached_tokens_without_reuse": fresh.cached_tokens,
            "ttft_s": reused.first - reused.start, "ttft_without_reuse_s": fresh.first - fresh.start}


async def conversation(client: httpx.AsyncClient, url: str, model: str, markers: itertools.count) -> list[dict]:
    """Each turn asked twice: as the conversation goes on (reusing the turns before), then unshared."""
    messages = [{"role": "system", "content": "You are a careful reader. Answer in two or three sentences."}]
    rows = []
    for turn in range(TURNS):
        question = f"{PASSAGES[turn % len(PASSAGES)]}\n\n{QUESTIONS[turn % len(QUESTIONS)]}"
        messages.append({"role": "user", "content": question})
        reused = await ask(client, url, model, messages, ANSWER_TOKENS)
        fresh = await ask(client, url, model, unshared(messages, next(markers)), ANSWER_TOKENS)
        rows.append(row(f"turn {turn + 1}", reused, fresh))
        messages.append({"role": "assistant", "content": reused.text})
    return rows


async def shared_system_prompt(client: httpx.AsyncClient, url: str, model: str, markers: itertools.count) -> list[dict]:
    """Questions behind one long system prompt that an earlier request sent, and the same unshared."""
    system = {"role": "system", "content": SYSTEM_PROMPT}
    await ask(client, url, model, [system, {"role": "user", "content": "Hello!"}], 1)  # the earlier request
    rows = []
    for question in SHARED_QUESTIONS:
        messages = [system, {"role": "user", "content": question}]
        reused = await ask(client, url, model, messages, 8)
        fresh = await ask(client, url, model, unshared(messages, next(markers)), 8)
        rows.append(row(f"shared system prompt: {question}", reused, fresh))
    return rows


async def measure(url: str, model: Optional[str]) -> tuple[str, dict]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        if model is None:
            response = await client.get(f"{url}/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        markers = itertools.count(1)
        # The server's first requests may pay for lazy set-up; a marked one shares nothing after.
        await ask(client, url, model, unshared([{"role": "user", "content": "Hello!"}], next(markers)), 8)
        return model, {"conversation": await conversation(client, url, model, markers),
                       "shared_system_prompt": await shared_system_prompt(client, url, model, markers)}


def summary(results: dict) -> dict:
    """The goals' figures: turn 10's time to first token over the same without reuse, and how
    many times sooner a question behind a shared system prompt starts (median)."""
    last = results["conversation"][-1]
    shared = results["shared_system_prompt"]
    return {"last_turn_ttft_ratio": last["ttft_s"] / last["ttft_without_reuse_s"],
            "shared_system_prompt_speedup": statistics.median(r["ttft_without_reuse_s"] / r["ttft_s"] for r in shared)}


def print_table(results: dict) -> None:
    print(f"{'case':<48}{'cached':>8}{'TTFT reuse':>12}{'TTFT none':>11}{'ratio':>7}   (times in ms)")
    for rows in results.values():
        for r in rows:
            print(f"{r['case'][:47]:<48}{r['cached_tokens']:>8}{1000 * r['ttft_s']:>12.1f}"
                  f"{1000 * r['ttft_without_reuse_s']:>11.1f}{r['ttft_s'] / r['ttft_without_reuse_s']:>7.2f}")
    figures = summary(results)
    print(f"turn {TURNS}: time to first token {figures['last_turn_ttft_ratio']:.2f}x that without reuse; behind a "
          f"shared system prompt, {figures['shared_system_prompt_speedup']:.1f}x sooner (median)")


def run_reuse(url: str, model: Optional[str]) -> tuple[str, dict]:
    """Both cases against the server at url: the model's name and the rows, printed as a table."""
    model, results = asyncio.run(measure(url, model))
    print_table(results)
    return model, results | {"summary": summary(results)}
