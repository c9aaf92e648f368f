"""Serving benchmark: closed-loop clients against an OpenAI-compatible server (ours, or llama.cpp's
Python server), at several concurrencies.

    python -m llama_tp.bench_serve --url http://127.0.0.1:8000 --concurrency 1,4,8,16 --requests 64

At concurrency c, c workers each send a streaming chat request and the next as soon as the last
has ended, until --requests have been sent. The requests cycle through PROMPTS, everyday questions
of mixed lengths, each with its own share of --max_tokens, so that answers end at different
times. --sampling greedy: temperature 0 without a repetition penalty, the same work on every
server whatever its sampling defaults (llama.cpp's servers ignore repetition_penalty: they are
sent repeat_penalty 1.0); --sampling sampled: temperature 0.7 and every other setting the
server's own (ours: the model's recommended top_p and repetition penalty), what chat users get.

It measures the server at --url, or starts servers itself one after the other and measures each
in the same run (servers.py): ours (--ours fp32,int4) and llama.cpp's C++ server (--peer
llama-server --llama_server PATH), on the demo model and its GGUF:

    python -m llama_tp.bench_serve --ours fp32,int4 --peer llama-server --llama_server BIN \
        --sampling greedy,sampled --concurrency 1,16 --requests 48 --max_tokens 64

--profile runs our engine in this process on the same requests (no HTTP) and prints where a
step's time goes (profile.py).

Per concurrency: requests/s, output tokens/s (from the usage chunk, else one token per chunk of
text), time to first token (to the first chunk with text) and time per output token ((last chunk
- first chunk) / (tokens - 1)), p50 and p99 (time to first token's p90 too, in the JSON), and the errors (a stream that ends without a finish
reason is one). Prints a table, writes JSON.
"""

import asyncio
import json
from pathlib import Path
from typing import Optional, Union

from ..cli import run
from . import offline, pool
from .clients import benchmark, print_table, write_report
from .reuse import run_reuse
from .servers import free_port, server_for
from .workload import SAMPLINGS

PEERS = ("llama-server",)
OURS = ("fp32", "int4")

# --structured: every answer constrained to a JSON object whose one string field holds the answer,
# so that constrained answers run about as long as free ones (measured in output tokens per second).
STRUCTURED_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
    "additionalProperties": False}}}


def json_literals(value):
    """fire reads --extra_body '{"a": false}' as Python, where false is a bare word: the string
    'false'. Give JSON's true, false and null their meaning back."""
    if isinstance(value, dict):
        return {key: json_literals(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_literals(item) for item in value]
    return {"true": True, "false": False, "null": None}.get(value, value) if isinstance(value, str) else value


def main(
    url: str = "http://127.0.0.1:8000",
    concurrency: Union[int, tuple[int, ...]] = (1, 4, 8, 16),
    requests: int = 32,
    max_tokens: int = 128,
    model: Optional[str] = None,
    json_path: str = "bench_serve.json",
    label: Optional[str] = None,
    warmup: int = 1,
    extra_body: Union[str, dict, None] = None,
    case: str = "load",
    sampling: Union[str, tuple[str, ...]] = "greedy",
    ours: Union[str, tuple[str, ...], None] = None,
    peer: Optional[str] = None,
    llama_server: Optional[str] = None,
    gguf: Optional[str] = None,
    profile: bool = False,
    structured: bool = False,
):
    """Measure a server at each concurrency, print a table and write it as JSON.

    Args:
        url: the server's base URL, without /v1 (unused when --ours or --peer start servers).
        concurrency: the numbers of closed-loop clients, e.g. 1,4,8,16.
        requests: requests per concurrency (at least the largest concurrency).
        max_tokens: the longest answer; each prompt asks for its share of it (PROMPTS).
        model: the model name to send; default: the first the server lists at /v1/models.
        json_path: where to write the results.
        label: names the server in the JSON (e.g. ours, llama.cpp); default: the URL.
        warmup: requests sent one by one before measuring, not counted.
        extra_body: JSON object merged into every request, for a server's own fields, e.g.
            '{"repeat_penalty": 1.0}' for llama.cpp, whose default penalises repeats.
        case: "load" (the concurrencies above) or "reuse": time to first token with and
            without reusing cached prompts, in a growing conversation and behind a shared system
            prompt (reuse.py; the other options but url, model, json_path and label unused);
            or "offline": 256 dialogs through the chat script's path and through our own server
            at 16 clients, started here with the demo model (offline.py; json_path only);
            or the KV cache's cases (pool.py), each in the memory of 8 rows x 2048 positions with
            --ours, printing what it checks: "many" (64 clients at once; with --peer, beside
            llama-server), "shared" (16 chats behind one 1500-token system prompt), "burst" (128
            clients at once overflowing the pool); url, model, ours, peer, llama_server, gguf,
            json_path and label used.
        sampling: "greedy", "sampled" (temperature 0.7, the server's defaults otherwise), or both.
        ours: start our server on the demo model for each of these, in turn: fp32, int4.
        peer: start llama.cpp's C++ server ("llama-server") on the demo model's GGUF too.
        llama_server: the llama-server binary, or the folder build-llama-cpp.sh prints.
        gguf: the GGUF llama-server runs (default: the demo model's Q4_1 file).
        profile: instead of measuring servers, run our engine in this process on the same load
            and print where a step's time goes (each --ours quantization, else fp32; each
            --sampling; the largest concurrency).
        structured: constrain every answer by a JSON schema (STRUCTURED_FORMAT), to compare with
            the same load unconstrained.
    """
    if case == "offline":
        offline.main(json_path=json_path)
        return
    url = url.rstrip("/")
    if case in pool.CASES:
        pool.main(case, url, model, _choices("--ours", ours, OURS) if ours else (), peer, llama_server, gguf,
                  json_path, label)
        return
    if case == "reuse":
        model, results = run_reuse(url, model)
        write_report(json_path, label, url, model, {"case": "reuse"}, results)
        return
    if case != "load":
        raise ValueError(f"--case {case!r} is not one of load, reuse, offline, {', '.join(pool.CASES)}")
    levels = (concurrency,) if isinstance(concurrency, int) else tuple(concurrency)  # fire: "8" is an int
    if not levels or any(not isinstance(c, int) or c < 1 for c in levels):
        raise ValueError(f"--concurrency must be positive integers, e.g. 1,4,8,16; found {concurrency!r}")
    if requests < max(levels):
        raise ValueError(f"--requests {requests} is fewer than the concurrency {max(levels)}: some clients "
                         f"would have nothing to send; pass --requests {max(levels)} or more")
    if max_tokens < 1 or warmup < 0:
        raise ValueError(f"--max_tokens must be at least 1 and --warmup at least 0, found {max_tokens} and {warmup}")
    extra = json.loads(extra_body) if isinstance(extra_body, str) else json_literals(extra_body or {})
    if not isinstance(extra, dict):
        raise ValueError(f"--extra_body must be a JSON object, found {extra_body!r}")
    if structured:
        extra = {"response_format": STRUCTURED_FORMAT} | extra
    samplings = _choices("--sampling", sampling, tuple(SAMPLINGS))
    quantizations = _choices("--ours", ours, OURS) if ours else ()
    if peer is not None and peer not in PEERS:
        raise ValueError(f"--peer {peer!r} is not one of {', '.join(PEERS)}")
    command = {"concurrency": list(levels), "requests": requests, "max_tokens": max_tokens, "warmup": warmup,
               "extra_body": extra}
    if profile:
        from .profile import profile_engine  # builds a model in this process: only when asked
        for quantize in quantizations or ("fp32",):
            for chosen in samplings:
                profile_engine(quantize, chosen, max(levels), requests, max_tokens)
        return
    servers = [f"ours-{q}" for q in quantizations] + ([peer] if peer else [])
    if servers:
        runs = _run_servers(servers, levels, requests, max_tokens, model, warmup, extra, samplings, gguf,
                            llama_server)
        write_report(json_path, label or "servers started by bench_serve", "", model or "",
                     command | {"servers": servers, "samplings": list(samplings)}, runs, "per run")
        return
    for chosen in samplings:
        model, results = asyncio.run(benchmark(url, levels, requests, max_tokens, model, warmup, extra, chosen))
        print(f"sampling: {chosen}")
        print_table(results)
        path = json_path if len(samplings) == 1 else str(Path(json_path).with_suffix(f".{chosen}.json"))
        write_report(path, label, url, model, command, results, chosen)


def _choices(option: str, value, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated option's values (fire gives a str or a tuple), each checked."""
    values = tuple(value.split(",")) if isinstance(value, str) else tuple(value)
    for item in values:
        if item not in allowed:
            raise ValueError(f"{option} {item!r} is not one of {', '.join(allowed)}")
    return values


def _run_servers(servers: list[str], levels: tuple[int, ...], requests: int, max_tokens: int,
                 model: Optional[str], warmup: int, extra: dict, samplings: tuple[str, ...], gguf: Optional[str],
                 llama_server: Optional[str]) -> list[dict]:
    """Start each server in turn and measure it under each sampling; print a summary of all."""
    if gguf is None:
        from ..demo import demo_gguf  # the download, only when a peer needs the file
        gguf = str(demo_gguf())
    runs = []
    for name in servers:
        with server_for(name, free_port(), max(levels), llama_server, gguf) as url:
            for chosen in samplings:
                # llama.cpp ignores repetition_penalty; its own repeat_penalty is off for greedy.
                own = {"repeat_penalty": 1.0} if name in PEERS and chosen == "greedy" else {}
                served, results = asyncio.run(benchmark(url, levels, requests, max_tokens, model, warmup,
                                                        extra | own, chosen))
                print(f"{name}, {chosen}:")
                print_table(results)
                runs.append({"server": name, "sampling": chosen, "model": served, "results": results})
    print_summary(runs, levels)
    return runs


def print_summary(runs: list[dict], levels: tuple[int, ...]) -> None:
    """Output tokens/s and time to first token's p90 of every run, side by side."""
    print(f"{'server':<16}{'sampling':<10}" + "".join(f"{f'tok/s @{c}':>12}{f'TTFT p90 @{c}':>15}" for c in levels))
    for run_ in runs:
        by_level = {r["concurrency"]: r for r in run_["results"]}
        cells = "".join(f"{by_level[c]['output_tokens_per_s']:>12.1f}"
                        f"{1000 * (by_level[c]['ttft_p90_s'] or 0):>12.0f} ms" for c in levels)
        print(f"{run_['server']:<16}{run_['sampling']:<10}{cells}")


if __name__ == "__main__":
    run(main)
