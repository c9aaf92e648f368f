"""A batch job both ways in one run: the chat script's path (continuous batching in process) and
our server at as many clients as rows, on the same varied dialogs, greedy.

    python -m llama_tp.bench_serve --case offline      # or python -m llama_tp.tools.bench.offline

The dialogs ask for anything from one word to about 150 words, so that answers end at very
different steps. The script's figure is its run_job (what launch/chat_completion.py runs, results
written as they finish) after the model has loaded; the server's is the closed-loop clients' wall
time, streaming. Both count generated tokens as the server's usage does (the end-of-turn token
included), and the answers are compared text for text. Each side runs the dialogs twice, the
sides taking turns (script, server, server, script), so that the machine's drift over the run
does not favour the side that ran first.
"""

import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import httpx

from ...generation import Llama
from .. import demo
from ..cli import run
from ..job_output import run_job
from .servers import LAUNCH_SERVE, free_port, started
from .stream_client import Outcome, send

STYLES = ("Answer in one word: {}", "Answer yes or no, then one sentence why: {}", "In one short sentence: {}",
          "{}", "Briefly: {}", "Give three short bullet points: {}", "Explain in about 150 words: {}",
          "Explain to a ten-year-old, in a short paragraph: {}")
QUESTIONS = ("What is the capital of France?", "Why is the sky blue?", "How does a refrigerator keep food cold?",
             "Is coffee good for your health?", "What makes a good night's sleep?", "How do vaccines work?",
             "Why do leaves change colour in autumn?", "What is inflation?", "How do airplanes stay in the air?",
             "Should I learn Python or JavaScript first?", "What is the tallest mountain on Earth?",
             "How do bees make honey?", "Why do we have seasons?", "What is a black hole?",
             "How can I save money on groceries?", "What is photosynthesis?", "Is it safe to swim after eating?",
             "How does the internet work?", "What is the best way to learn a language?", "Why is the sea salty?",
             "How do magnets work?", "What causes earthquakes?", "Why do cats purr?", "What is democracy?",
             "How do I boil an egg?", "What is machine learning?", "Why do we dream?", "How are rainbows formed?",
             "What is a good name for a goldfish?", "How far away is the moon?", "What is the speed of light?",
             "Why do onions make you cry?")


def dialogs(count: int) -> list[list[dict]]:
    """count dialogs: each question in each style, in an order that mixes short and long answers."""
    return [[{"role": "user", "content": STYLES[index % len(STYLES)].format(QUESTIONS[index // len(STYLES)
                                                                                       % len(QUESTIONS)])}]
            for index in range(count)]


def main(dialog_count: int = 256, rows: int = 16, max_gen_len: int = 256, max_seq_len: int = 1024,
         rounds: int = 2, ckpt_dir: Optional[str] = None, tokenizer_path: Optional[str] = None,
         json_path: str = "bench_offline.json"):
    """Run the dialogs through the script's path and through the server, print both, write JSON.

    Args:
        dialog_count: how many dialogs (the same on both sides).
        rows: --max_batch_size on both sides, and the server's concurrent clients.
        max_gen_len: the longest answer (the server's max_tokens).
        max_seq_len: the context of both models.
        rounds: how many times each side runs the dialogs, in alternating order (script, server,
            server, script, ...), so that a machine that speeds up or slows down during the run
            weighs on both sides alike; each side's figure is its tokens over its seconds, all
            runs together.
        ckpt_dir, tokenizer_path: the model (default: the demo model).
        json_path: where to write the figures.
    """
    if rounds < 1:
        raise ValueError(f"--rounds {rounds}: each side runs the dialogs at least once; pass 1 or more")
    ckpt_dir, tokenizer_path = demo.model_paths(ckpt_dir, tokenizer_path)
    jobs = dialogs(dialog_count)
    port = free_port()
    command = [sys.executable, str(LAUNCH_SERVE), "--ckpt_dir", ckpt_dir, "--tokenizer_path", tokenizer_path,
               "--port", str(port), "--max_batch_size", str(rows), "--max_seq_len", str(max_seq_len),
               "--model_name", "bench"]
    runs: dict[str, list[dict]] = {"script": [], "server": []}
    with started("our server", command, port) as url:
        answer = script_answerer(jobs, ckpt_dir, tokenizer_path, rows, max_gen_len, max_seq_len)
        for side in alternating(rounds):
            if side == "script":
                result = script_side(jobs, answer, max_gen_len)
            else:
                result = asyncio.run(server_side(url, jobs, rows, max_gen_len))
            runs[side].append(result)
            print(f"{side}: {described(result)}")
    texts = [result.pop("texts") for side in runs.values() for result in side]
    same = sum(len(set(answers)) == 1 for answers in zip(*texts))
    script, served = summed(runs["script"]), summed(runs["server"])
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": {"dialogs": dialog_count, "rows": rows, "clients": rows, "max_gen_len": max_gen_len,
                    "max_seq_len": max_seq_len, "rounds": rounds, "ckpt_dir": ckpt_dir,
                    "sampling": "greedy, repetition_penalty 1"},
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "platform": platform.platform()},
        "script": script, "server": served, "runs": runs, "same_answers": same,
        "script_over_server": script["output_tokens_per_s"] / served["output_tokens_per_s"],
    }
    print(f"script, {rounds} runs: {described(script)}")
    print(f"server at {rows} clients, {rounds} runs: {described(served)}")
    print(f"script / server: {report['script_over_server']:.2f}x; the same answer in every run for {same} of "
          f"{dialog_count} dialogs")
    Path(json_path).write_text(json.dumps(report, indent=2))
    print(f"wrote {json_path}")


def alternating(rounds: int) -> list[str]:
    """The sides in the order they run: script, server; then server, script; and so on."""
    pair = ("script", "server")
    return [side for round_ in range(rounds) for side in (pair if round_ % 2 == 0 else pair[::-1])]


def summed(results: list[dict]) -> dict:
    """One side's runs as one figure: all their tokens over all their seconds."""
    seconds = sum(result["seconds"] for result in results)
    tokens = sum(result["output_tokens"] for result in results)
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds}


def described(figure: dict) -> str:
    """A run's or a side's figure in words."""
    return (f"{figure['output_tokens']} tokens in {figure['seconds']:.1f} s, "
            f"{figure['output_tokens_per_s']:.1f} tokens/s")


def script_answerer(jobs: list, ckpt_dir: str, tokenizer_path: str, rows: int, max_gen_len: int,
                    max_seq_len: int) -> Callable:
    """The model loaded and warmed up in this process, and the chat script's answer function on it."""
    llama = Llama.build(ckpt_dir, tokenizer_path, max_seq_len, rows)
    options = dict(temperature=0, repetition_penalty=1.0, max_gen_len=max_gen_len, token_ids=True)
    llama.chat_completion(jobs[:2], **options)  # the first passes pay for page faults and kernel choices

    def answer(batch, seed, on_result):
        llama.chat_completion(batch, seed=seed, on_result=on_result, **options)

    return answer


def script_side(jobs: list, answer: Callable, max_gen_len: int) -> dict:
    """The chat script's run_job in this process, results written to a file as they finish."""
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        records = run_job(jobs, answer, lambda result: result["generation"]["content"],
                          str(Path(folder) / "results.jsonl"), False, None)
        seconds = time.perf_counter() - start
    # As the server's usage counts: an answer that ended before the limit ended at its end-of-turn token.
    tokens = sum(len(r["token_ids"]) + (len(r["token_ids"]) < max_gen_len) for r in records)
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "texts": [r["generation"] for r in records]}


async def server_side(url: str, jobs: list, clients: int, max_tokens: int) -> dict:
    """The dialogs sent by `clients` closed-loop streaming clients, once the server is up and warm."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(1200.0, connect=10.0)) as client:
        bodies = [{"model": "bench", "messages": dialog, "max_tokens": max_tokens, "temperature": 0,
                   "repetition_penalty": 1.0, "stream": True, "stream_options": {"include_usage": True}}
                  for dialog in jobs]
        await send(client, url, bodies[0])
        outcomes: list[Optional[Outcome]] = [None] * len(bodies)
        pending = iter(enumerate(bodies))

        async def worker() -> None:
            for index, body in pending:
                outcomes[index] = await send(client, url, body)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        seconds = time.perf_counter() - start
    errors = [outcome.error for outcome in outcomes if outcome.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} of the server's answers failed, e.g. {errors[0]}")
    tokens = sum(outcome.tokens for outcome in outcomes)
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "texts": [outcome.text for outcome in outcomes]}


if __name__ == "__main__":
    run(main)
