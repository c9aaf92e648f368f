"""The KV cache's cases of the serving benchmark: what a pool of blocks, handed out by the token,
lets one server do in the memory that rows of max_seq_len once reserved (docs/serving.md, "The
KV cache in blocks").

    python -m llama_tp.bench_serve --case many --ours int4 --peer llama-server --llama_server BIN
    python -m llama_tp.bench_serve --case shared --ours int4
    python -m llama_tp.bench_serve --case burst --ours int4

With --ours, our server on the demo model gets the KV memory of launch/serve.py's default of
before the pool, 8 rows x 2048 positions (256 blocks of 64), whatever --max_batch_size the case
needs; without it, the clients go to the server at --url, with whatever memory it has. While the
clients run, the server's /metrics is read every METRICS_PERIOD seconds (the running requests,
the blocks in use, the preemptions). Each case prints what it checks, PASS or FAIL, with the
figures, and writes them as JSON.

- many: 64 clients, closed loop, the load's everyday prompts (workload.py) with answers of up to
  128 tokens, sampled, at 16 clients then 64 on one server of 64 rows: all 64 run at once (the
  running gauge reaches 64), and output tokens/s at 64 clients is at least 1.3x that at 16; with
  --peer, at least 1.5x llama-server's at 64 (-np 64, a context of 64 x 1024).
- shared: 16 clients whose chats share a system prompt of about 1500 tokens, each coming when the
  one before has its first token (clients of a service arrive one after another; prompts admitted
  in one step would each prefill the start, as none of its blocks is filled yet), each answer
  128 tokens: the blocks in use at the peak hold the system prompt once (at most the requests' own
  blocks, the first's with the system prompt, the others' beyond the blocks they shared), and the
  time to first token of every client after the first is at most 0.25x the first's (which
  prefilled the system prompt).
- burst: 128 clients at once, greedy, answers of 256 tokens each, on 64 rows with a waiting line
  of 128: the pool overflows (requests are preempted, the gauge's preemptions), every request
  completes, and every answer is the one its prompt gets alone (asked again one at a time after
  the burst); none is refused.
"""

import asyncio
import time
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import AsyncIterator, Optional

import httpx

from ...model.args import ModelArgs
from ...model.kv_cache import BLOCK_POSITIONS, blocks_for
from ...model.memory import GIB, plan
from .. import demo
from .clients import print_table, request_body, run_level, served_model, write_report
from .reuse import house_rules
from .servers import free_port, server_for
from .stream_client import Outcome, send
from .workload import PROMPTS, SAMPLINGS

CASES = ("many", "shared", "burst")
OLD_DEFAULT = (8, 2048)  # launch/serve.py's rows x positions before the pool: every case's KV memory
METRICS_PERIOD = 0.1  # seconds between two reads of /metrics (each costs the server about a millisecond)
MANY_LEVELS = (16, 64)  # case many's clients
SHARED_CLIENTS = 16
SHARED_RULES = 74  # house rules in the shared system prompt: 1510 tokens with the demo's tokenizer
BURST_CLIENTS, BURST_TOKENS = 128, 256
# Each case's server: --max_batch_size (the most clients at once) and --max_waiting.
ROWS_AND_LINE = {"many": (64, 64), "shared": (16, 64), "burst": (64, BURST_CLIENTS)}
# A series of our /metrics: what the cases read from it.
WATCHED = {"llama_tp_requests_running": "running", "llama_tp_kv_cache_blocks_used": "blocks_used",
           "llama_tp_requests_running_max": "running_max", "llama_tp_kv_cache_blocks_used_max": "blocks_used_max",
           "llama_tp_kv_cache_blocks_cached": "blocks_cached", "llama_tp_preemptions_total": "preemptions"}
TIMEOUT = httpx.Timeout(1800.0, connect=10.0)


def read_metrics(text: str) -> dict[str, float]:
    """The WATCHED series' values in a Prometheus text exposition, by their short names."""
    values = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in WATCHED:
            values[WATCHED[name]] = float(value)
    return values


class Watch:
    """The server's gauges as /metrics showed them while clients ran: the first read (before),
    each one's peak, and the last read (after the clients ended)."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.peak: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def record(self, values: dict[str, float]) -> None:
        self.first = self.first or values
        for name, value in values.items():
            self.peak[name] = max(self.peak.get(name, value), value)
        self.last = values

    def grew(self, name: str) -> float:
        """How much a counter grew while the clients ran."""
        return self.last.get(name, 0.0) - self.first.get(name, 0.0)

    def highest(self, name: str) -> float:
        """A gauge's highest value while the clients ran: the server's own record of it (NAME_max,
        every step's value) where the record rose meanwhile, so it was set then; else the highest
        of the reads, which can miss a step's."""
        record = f"{name}_max"
        if self.last.get(record, 0.0) > self.first.get(record, 0.0):
            return self.last[record]
        return self.peak[name]


@asynccontextmanager
async def watching(url: str) -> AsyncIterator[Watch]:
    """/metrics read before the block, every METRICS_PERIOD seconds while it runs, and after it."""
    watch = Watch()
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        async def read() -> None:
            response = await client.get(f"{url}/metrics")
            response.raise_for_status()
            watch.record(read_metrics(response.text))

        async def poll() -> None:
            while True:
                await asyncio.sleep(METRICS_PERIOD)
                await read()

        await read()
        task = asyncio.create_task(poll())
        try:
            yield watch
        finally:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        await read()


def check(what: str, passed: bool) -> dict:
    return {"check": what, "passed": bool(passed)}


def print_checks(case: str, checks: list[dict]) -> None:
    for item in checks:
        print(f"{'PASS' if item['passed'] else 'FAIL'}  {case}: {item['check']}")


def stream_body(model: str, messages: list[dict], max_tokens: int, sampling: str, least: int = 0) -> dict:
    """A streaming chat request with usage; least: min_tokens (vLLM's, ours), answers as long as asked."""
    return ({"model": model, "messages": messages, "max_tokens": max_tokens} | SAMPLINGS[sampling]
            | ({"min_tokens": least} if least else {}) | {"stream": True, "stream_options": {"include_usage": True}})


def own_blocks(outcome: Outcome) -> int:
    """The blocks of our KV cache a request held at its end beyond those it shared at admission."""
    return blocks_for(outcome.prompt_tokens + outcome.tokens) - outcome.cached_tokens // BLOCK_POSITIONS


# many

async def many(url: str, model: Optional[str] = None, levels: tuple[int, ...] = MANY_LEVELS, requests: int = 128,
               max_tokens: int = 128, sampling: str = "sampled", watch: bool = True) -> tuple[str, list[dict]]:
    """The load's requests at each number of clients, closed loop: each level's figures, with the
    running gauge's peak and the preemptions (watch: read /metrics: ours; llama-server has none)."""
    limits = httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        model = model or await served_model(client, url)
        bodies = [request_body(index, model, max_tokens, {}, sampling) for index in range(requests)]
        warm = await send(client, url, bodies[0])  # the first request may pay for lazy set-up
        if warm.error:
            raise ValueError(f"the warm-up request failed: {warm.error}")
        results = []
        for clients in levels:
            if watch:
                async with watching(url) as gauges:
                    result = await run_level(client, url, clients, bodies)
                result |= {"peak_running": gauges.highest("running"), "peak_blocks_used": gauges.highest("blocks_used"),
                           "preemptions": gauges.grew("preemptions")}
            else:
                result = await run_level(client, url, clients, bodies)
            results.append(result)
            print(f"{clients} clients: done in {result['seconds']:.1f} s", flush=True)
    return model, results


def many_checks(ours: list[dict], peer: Optional[list[dict]] = None) -> list[dict]:
    """What case many promises, from our levels' figures (the last, the most clients) and the peer's."""
    low, high = ours[0], ours[-1]
    ratio = high["output_tokens_per_s"] / low["output_tokens_per_s"]
    checks = [
        check(f"every request answered ({sum(r['errors'] for r in ours)} errors)", not any(r["errors"] for r in ours)),
        check(f"all {high['concurrency']} clients ran at once: the running gauge reached {high['peak_running']:.0f}",
              high["peak_running"] >= high["concurrency"]),
        check(f"output tokens/s at {high['concurrency']} clients {high['output_tokens_per_s']:.1f}, {ratio:.2f}x "
              f"that at {low['concurrency']} ({low['output_tokens_per_s']:.1f}; at least 1.3x)", ratio >= 1.3),
    ]
    if peer is not None:
        theirs = next(r for r in peer if r["concurrency"] == high["concurrency"])
        over = high["output_tokens_per_s"] / theirs["output_tokens_per_s"]
        checks.append(check(f"at {high['concurrency']} clients {over:.2f}x llama-server's output tokens/s "
                            f"({theirs['output_tokens_per_s']:.1f}; at least 1.5x)", over >= 1.5))
    return checks


# shared

async def shared(url: str, model: Optional[str] = None, clients: int = SHARED_CLIENTS, rules: int = SHARED_RULES,
                 max_tokens: int = 128, sampling: str = "sampled") -> tuple[str, dict]:
    """clients chats behind one system prompt of `rules` house rules, each sent when the one before
    has its first token, each answer max_tokens long: every request's figures and the gauges' peaks."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        model = model or await served_model(client, url)
        warm = await send(client, url, stream_body(model, [{"role": "user", "content": "Hello!"}], 4, sampling))
        if warm.error:
            raise ValueError(f"the warm-up request failed: {warm.error}")
        # A start of its own: no block of an earlier run's system prompt is cached.
        system = {"role": "system", "content": f"Session {time.time_ns()}. {house_rules(rules)}"}
        bodies = [stream_body(model, [system, {"role": "user", "content": PROMPTS[index % len(PROMPTS)][0]}],
                              max_tokens, sampling, least=max_tokens) for index in range(clients)]
        answered = [asyncio.Event() for _ in range(clients)]  # each client's first token

        async def chat(index: int) -> Outcome:
            if index:
                await answered[index - 1].wait()
            try:
                return await send(client, url, bodies[index], on_first=answered[index].set)
            finally:
                answered[index].set()  # a request that failed lets the next one go all the same

        async with watching(url) as gauges:
            outcomes = await asyncio.gather(*(chat(index) for index in range(clients)))
        print(f"shared: {clients} chats ended", flush=True)
    requests = [{"ttft_s": None if o.first is None else o.first - o.start, "prompt_tokens": o.prompt_tokens,
                 "cached_tokens": o.cached_tokens, "completion_tokens": o.tokens, "own_blocks": own_blocks(o),
                 "error": o.error} for o in outcomes]
    return model, {"requests": requests, "peak_running": gauges.highest("running"),
                   "peak_blocks_used": gauges.highest("blocks_used")}


def shared_checks(figures: dict) -> list[dict]:
    """What case shared promises, from its figures."""
    requests = figures["requests"]
    errors = [r["error"] for r in requests if r["error"]]
    if errors:
        return [check(f"every request answered ({len(errors)} errors; the first: {errors[0]})", False)]
    first, later = requests[0], requests[1:]
    reused = min(r["cached_tokens"] for r in later)
    held_once = sum(r["own_blocks"] for r in requests)  # the first's blocks hold the system prompt's
    copies = sum(blocks_for(r["prompt_tokens"] + r["completion_tokens"]) for r in requests)
    worst = max(r["ttft_s"] for r in later)
    return [
        check(f"every request answered, all {len(requests)} at once: the running gauge reached "
              f"{figures['peak_running']:.0f}", figures["peak_running"] >= len(requests)),
        check(f"every later request started from the first's blocks: at least {reused} of its "
              f"{first['prompt_tokens']}-token prompt each", reused >= first["prompt_tokens"] - 2 * BLOCK_POSITIONS),
        check(f"blocks in use at the peak {figures['peak_blocks_used']:.0f}: the system prompt held once (the "
              f"requests' own blocks: at most {held_once}; a copy per request: {copies})",
              figures["peak_blocks_used"] <= held_once),
        check(f"time to first token after the first's: at most {1000 * worst:.0f} ms, "
              f"{worst / first['ttft_s']:.3f}x the first's {1000 * first['ttft_s']:.0f} ms (at most 0.25x)",
              worst <= 0.25 * first["ttft_s"]),
    ]


# burst

async def burst(url: str, model: Optional[str] = None, clients: int = BURST_CLIENTS,
                max_tokens: int = BURST_TOKENS) -> tuple[str, dict]:
    """clients greedy requests of the load's prompts at once, each answer max_tokens long, then each
    prompt alone: every request's outcome, the answers alone, and the gauges."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        model = model or await served_model(client, url)
        prompts = [PROMPTS[index % len(PROMPTS)][0] for index in range(clients)]

        def body(prompt: str) -> dict:
            return stream_body(model, [{"role": "user", "content": prompt}], max_tokens, "greedy", least=max_tokens)

        async with watching(url) as gauges:
            start = time.perf_counter()
            outcomes = await asyncio.gather(*(send(client, url, body(prompt)) for prompt in prompts))
            seconds = time.perf_counter() - start
        print(f"burst: {clients} requests ended in {seconds:.1f} s; now each prompt alone", flush=True)
        alone = {}
        for prompt in dict.fromkeys(prompts):  # one at a time, in the order they came
            outcome = await send(client, url, body(prompt))
            alone[prompt] = outcome.text if outcome.error is None else None
    requests = [{"prompt": prompt, "completion_tokens": o.tokens, "error": o.error, "same_as_alone": o.text == alone[prompt]}
                for prompt, o in zip(prompts, outcomes)]
    return model, {"requests": requests, "seconds": seconds, "output_tokens": sum(o.tokens for o in outcomes),
                   "preemptions": gauges.grew("preemptions"), "peak_running": gauges.highest("running"),
                   "peak_blocks_used": gauges.highest("blocks_used")}


def burst_checks(figures: dict, max_tokens: int) -> list[dict]:
    """What case burst promises, from its figures."""
    requests = figures["requests"]
    refused = [r for r in requests if (r["error"] or "").startswith("HTTP 429")]
    failed = [r for r in requests if r["error"] and r not in refused]
    whole = [r for r in requests if not r["error"] and r["completion_tokens"] == max_tokens]
    same = [r for r in requests if not r["error"] and r["same_as_alone"]]
    return [
        check(f"the pool overflowed: {figures['preemptions']:.0f} preemptions (blocks in use at the peak "
              f"{figures['peak_blocks_used']:.0f}, {figures['peak_running']:.0f} requests running)",
              figures["preemptions"] > 0),
        check(f"every request completed: {len(whole)} of {len(requests)} answers of {max_tokens} tokens, "
              f"{len(refused)} refused by the waiting line, {len(failed)} failed"
              + (f" (the first: {failed[0]['error']})" if failed else ""), len(whole) == len(requests)),
        check(f"every answer is its prompt's alone (greedy): {len(same)} of {len(requests)}", len(same) == len(requests)),
    ]


# The command

def old_default_memory(ckpt_dir: str) -> float:
    """GiB of the demo model's KV cache of OLD_DEFAULT rows x positions (fp32, as on a CPU): what
    --kv_cache_memory gives each case's server."""
    args = ModelArgs.load(Path(ckpt_dir) / "params.json")
    rows, positions = OLD_DEFAULT
    memory = plan(args, 1, rows, positions, "fp32")
    return memory.kv_cache_positions * memory.position_bytes / GIB


def main(case: str, url: str, model: Optional[str], ours: tuple[str, ...], peer: Optional[str],
         llama_server: Optional[str], gguf: Optional[str], json_path: str, label: Optional[str]) -> None:
    """Run one of CASES against the server at url, or against ours (each of `ours` in turn) and,
    for case many, the peer; print the checks, write the figures."""
    if case not in CASES:
        raise ValueError(f"--case {case!r} is not one of {', '.join(CASES)}")
    if peer not in (None, "llama-server"):
        raise ValueError(f"--peer {peer!r} is not one of llama-server")
    if peer is not None and case != "many":
        raise ValueError(f"--peer runs in case many only; case {case} measures our KV cache alone")
    runs = []
    if not ours:
        if peer is not None:
            raise ValueError("--case many --peer needs --ours too: the ratio is ours over the peer's")
        runs.append(run_on(case, url, model))
    else:
        ckpt_dir, _ = demo.model_paths(None, None)
        options = ["--kv_cache_memory", repr(old_default_memory(ckpt_dir))]
        rows, line = ROWS_AND_LINE[case]
        options += ["--max_waiting", str(line)]
        for quantize in ours:
            with server_for(f"ours-{quantize}", free_port(), rows, None, "", options) as served:
                runs.append(run_on(case, served, model) | {"server": f"ours-{quantize}"})
        if peer is not None:
            if gguf is None:
                gguf = str(demo.demo_gguf())
            clients = MANY_LEVELS[-1]
            with server_for(peer, free_port(), clients, llama_server, gguf, context=clients * 1024) as served:
                peer_results = asyncio.run(many(served, model, levels=(clients,), watch=False))[1]
            print(f"{peer}, {clients} clients:")
            print_table(peer_results)
            for run in runs:
                run["peer"] = peer_results
                run["checks"] = many_checks(run["results"], peer_results)
    for run in runs:
        print_checks(f"{case} ({run.get('server', url)})", run["checks"])
    write_report(json_path, label or f"bench_serve --case {case}", "" if ours else url, runs[0]["model"],
                 {"case": case, "servers": [run.get("server", url) for run in runs],
                  "kv_cache": f"{OLD_DEFAULT[0]} x {OLD_DEFAULT[1]} positions" if ours else "the server's"},
                 runs, "per case")


def run_on(case: str, url: str, model: Optional[str]) -> dict:
    """One case against the server at url: its figures and checks."""
    if case == "many":
        model, results = asyncio.run(many(url, model))
        print_table(results)
        return {"model": model, "results": results, "checks": many_checks(results)}
    if case == "shared":
        model, figures = asyncio.run(shared(url, model))
        return {"model": model, "results": figures, "checks": shared_checks(figures)}
    model, figures = asyncio.run(burst(url, model))
    return {"model": model, "results": figures, "checks": burst_checks(figures, BURST_TOKENS)}
