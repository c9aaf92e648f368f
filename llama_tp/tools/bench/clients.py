"""Closed-loop clients against an OpenAI-compatible server and their figures, for the serving
benchmark's cases (serve.py, pool.py): the requests they send, one concurrency's run, its
statistics and table, and the JSON report."""

import asyncio
import json
import math
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import httpx

from .stream_client import Outcome, send
from .workload import PROMPTS, SAMPLINGS


def percentile(values: list[float], q: float) -> Optional[float]:
    """The q-th percentile (0-100) of values, interpolating linearly between ranks; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(concurrency: int, outcomes: list[Outcome], seconds: float) -> dict:
    """One concurrency's figures from its requests and its wall time."""
    done = [o for o in outcomes if o.error is None]
    ttft = [o.first - o.start for o in done if o.first is not None]
    tpot = [(o.last - o.first) / (o.tokens - 1) for o in done if o.first is not None and o.tokens > 1]
    result = {
        "concurrency": concurrency,
        "requests": len(outcomes),
        "errors": len(outcomes) - len(done),
        "seconds": seconds,
        "requests_per_s": len(done) / seconds,
        "output_tokens": sum(o.tokens for o in done),
        "output_tokens_per_s": sum(o.tokens for o in done) / seconds,
        "tokens_from_usage": sum(o.tokens_from_usage for o in done),
    }
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 90, 99):
            result[f"{name}_p{q}_s"] = percentile(values, q)
    result["first_errors"] = [o.error for o in outcomes if o.error is not None][:3]
    return result


def print_table(results: list[dict]) -> None:
    """The figures as a plain-text table, times in milliseconds."""
    def ms(value: Optional[float]) -> str:
        return "-" if value is None else f"{1000 * value:.1f}"

    print(f"{'concurrency':>11}{'requests':>10}{'errors':>8}{'req/s':>8}{'out tok/s':>11}"
          f"{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}   (times in ms)")
    for r in results:
        print(f"{r['concurrency']:>11}{r['requests']:>10}{r['errors']:>8}{r['requests_per_s']:>8.2f}"
              f"{r['output_tokens_per_s']:>11.1f}{ms(r['ttft_p50_s']):>10}{ms(r['ttft_p99_s']):>10}"
              f"{ms(r['tpot_p50_s']):>10}{ms(r['tpot_p99_s']):>10}")
    for r in results:
        for error in r["first_errors"]:
            print(f"concurrency {r['concurrency']}: error: {error}")


def request_body(index: int, model: str, max_tokens: int, extra_body: dict, sampling: str = "greedy") -> dict:
    """The index-th request: the next prompt in turn, with its share of max_tokens."""
    prompt, share = PROMPTS[index % len(PROMPTS)]
    return ({"model": model, "messages": [{"role": "user", "content": prompt}],
             "max_tokens": max(1, round(max_tokens * share))} | SAMPLINGS[sampling]
            | {"stream": True, "stream_options": {"include_usage": True}} | extra_body)


async def run_level(client: httpx.AsyncClient, url: str, concurrency: int, bodies: list[dict]) -> dict:
    """bodies sent by concurrency closed-loop workers; the level's figures."""
    pending = iter(bodies)
    outcomes: list[Outcome] = []

    async def worker() -> None:
        for body in pending:  # the workers share the iterator: each takes the next request in turn
            outcomes.append(await send(client, url, body))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarize(concurrency, outcomes, time.perf_counter() - start)


async def served_model(client: httpx.AsyncClient, url: str) -> str:
    """The first model the server lists."""
    response = await client.get(f"{url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def benchmark(url: str, levels: tuple[int, ...], requests: int, max_tokens: int, model: Optional[str],
                    warmup: int, extra_body: dict, sampling: str = "greedy") -> tuple[str, list[dict]]:
    limits = httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
        model = model or await served_model(client, url)
        bodies = [request_body(index, model, max_tokens, extra_body, sampling) for index in range(requests)]
        for body in bodies[:warmup]:  # the first requests may pay for compiling, caches, page faults
            outcome = await send(client, url, body)
            if outcome.error:
                raise ValueError(f"the warm-up request failed: {outcome.error}")
        results = []
        for concurrency in levels:
            results.append(await run_level(client, url, concurrency, bodies))
            print(f"concurrency {concurrency}: done in {results[-1]['seconds']:.1f} s", flush=True)
    return model, results


def write_report(json_path: str, label: Optional[str], url: str, model: str, command: dict, results,
                 sampling: str = "greedy") -> None:
    report = {
        "label": label or url, "url": url, "model": model,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command | {"sampling": SAMPLINGS.get(sampling, sampling)},
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "platform": platform.platform(),
                    "processor": _processor()},
        "results": results,
    }
    Path(json_path).write_text(json.dumps(report, indent=2))
    print(f"wrote {json_path}")


def _processor() -> str:
    """The CPU's model name (Linux), for the record."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
