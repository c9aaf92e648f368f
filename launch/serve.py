"""Serve a Llama checkpoint split across the torchrun processes over HTTP, as OpenAI's API does.

    torchrun --nproc_per_node N launch/serve.py --ckpt_dir DIR --tokenizer_path FILE --port 8000
    torchrun --nproc_per_node 1 launch/serve.py   # the built-in demo model (1 or 3 processes)

Rank 0 listens for requests (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models,
/health, /metrics) in an HTTP process of its own (serve/http_process.py), while every rank runs the
engine in lockstep, many requests in one batch (continuous batching). It prints one line with the
URL once it answers. Ctrl-C or SIGTERM stops it: running
requests end with what they have, new ones are refused, and every rank leaves.
"""

import os
import signal
import ssl
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from llama_tp import Llama, parallel
from llama_tp.model.memory import KV_CACHE_FRACTION
from llama_tp.optional import require_all
from llama_tp.parallel import print0
from llama_tp.serve.limits import ServerLimits  # core-only modules: the options' defaults
from llama_tp.structured.constraint import GrammarLimits
from llama_tp.tools import demo
from llama_tp.tools.cli import JobEnded, run

if TYPE_CHECKING:
    from llama_tp.serve.channel import EngineChannel


def main(
    ckpt_dir: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: Optional[str] = None,
    max_batch_size: int = 8,
    max_seq_len: int = 2048,
    kv_cache_memory: Optional[float] = None,
    kv_cache_fraction: float = KV_CACHE_FRACTION,
    max_waiting: int = 64,
    max_prefill_tokens: int = 256,
    no_prefix_cache: bool = False,
    dtype: Optional[str] = None,
    quantize: Optional[str] = None,
    compile: Optional[bool] = None,
    speculate: Optional[str] = None,
    speculate_k: Optional[int] = None,
    draft_ckpt_dir: Optional[str] = None,
    draft_quantize: Optional[str] = None,
    api_key: Optional[str] = None,
    ssl_certfile: Optional[str] = None,
    ssl_keyfile: Optional[str] = None,
    reasoning_parser: Optional[str] = None,
    max_stored_responses: int = 1024,
    max_body_bytes: int = ServerLimits.max_body_bytes,
    read_timeout: float = ServerLimits.read_timeout,
    max_grammar_bytes: int = GrammarLimits.max_bytes,
    grammar_timeout: float = GrammarLimits.max_seconds,
):
    """Answer OpenAI-style HTTP requests until Ctrl-C or SIGTERM.

    Args:
        ckpt_dir: folder with params.json and consolidated.XX.pth shards; leave out both paths to
            serve the built-in demo model (SmolLM2-135M-Instruct).
        tokenizer_path: the tokenizer file that came with the checkpoint.
        host: the address to listen on (0.0.0.0 for every interface).
        port: the port to listen on.
        model_name: the name clients ask for (default: the checkpoint folder's name, or
            smollm2-135m-instruct for the demo model).
        max_batch_size: requests generating at once (the rows of a step): each holds the blocks of
            the KV cache its tokens fill, growing as it does.
        max_seq_len: the longest prompt plus answer of one request, in tokens.
        kv_cache_memory: GiB of KV cache a process holds, shared out by the block (64 positions)
            as requests grow, a prompt's full blocks shared with every request that starts the
            same way (default: max_batch_size x max_seq_len positions' worth). Said at start as
            "N tokens of KV cache: about M conversations of max_seq_len". On a GPU the default
            is --kv_cache_fraction of the memory free after loading.
        kv_cache_fraction: on a GPU without --kv_cache_memory, the share of the memory free after
            loading the weights that the KV cache takes, less a pass's activations (as vLLM's
            --gpu-memory-utilization, but of what is free).
        max_waiting: requests that may wait for a row; beyond, requests are refused at once (429).
        max_prefill_tokens: prompt tokens fed in one step beside the generating requests: a long
            prompt is fed in chunks of this size, so that the others are not stalled for long.
        no_prefix_cache: prefill every prompt in full, never sharing the blocks of keys and values
            that an earlier request which began the same way filled.
        dtype: fp32, bf16 or fp16 (default: fp32 on CPU, bf16 or fp16 on GPU).
        quantize: int8 or int4 (weight-only; int4 on CPU) or int8_dynamic (CPU) linear layers, made
            at load time; a quantized checkpoint loads as it is stored.
        compile: compile the decoding step (worth it for a server that runs for long); by
            default on GPUs, not on CPUs.
        speculate: draft or lookup: guess tokens, then verify several in one pass, with the same
            greedy answers (docs/speculative.md); a draft needs --draft_quantize or --draft_ckpt_dir.
        speculate_k: guesses a round, 1 to 15 (default: tuned for each mode).
        draft_ckpt_dir: the draft model's checkpoint, sharing the tokenizer (default: this model).
        draft_quantize: the draft's quantization: int4 or int8 alone makes such a copy of this model.
        api_key: every request must then carry `Authorization: Bearer API_KEY` or `x-api-key:
            API_KEY`, else 401
            (default: $LLAMA_TP_API_KEY, else none; /health and /metrics stay open, the docs
            pages are off). Prefer the variable: a command line is visible to every user of the machine.
        ssl_certfile: serve HTTPS with this PEM certificate (with --ssl_keyfile).
        ssl_keyfile: the certificate's PEM private key.
        reasoning_parser: qwen3 or deepseek_r1: a thinking model's <think>...</think> goes apart
            from its chat answers (reasoning_content); none: left in them (default: the one the
            chat template calls for, where it is clear).
        max_stored_responses: Responses API answers kept for previous_response_id and GET
            /v1/responses/{id}, for the server's lifetime; beyond, the oldest are evicted first.
        max_body_bytes: the largest request body taken; larger: 413, before it is read.
        read_timeout: seconds a request's headers may take to arrive, and then its body; slower:
            the connection is closed (408 for a body).
        max_grammar_bytes: the largest structured output (a schema, regex or grammar) compiled; larger: 400.
        grammar_timeout: seconds a structured output's grammar may take to compile; longer: 400
            (docs/serving.md, "Limits").
    """
    limits = ServerLimits(max_body_bytes, read_timeout, GrammarLimits(max_grammar_bytes, grammar_timeout))
    _check_limits(limits)
    require_all(("fastapi", "uvicorn", "prometheus_client", "xgrammar"), "the server")  # every rank, first
    from llama_tp.serve.http_process import HttpProcess, HttpSettings
    from llama_tp.serve.served_model import ServedModel
    from llama_tp.serve.server import bind, engine_loop

    placement = parallel.init()
    api_key = api_key if api_key is not None else os.environ.get("LLAMA_TP_API_KEY") or None
    name = model_name or (Path(ckpt_dir).name if ckpt_dir else demo.MODEL_NAME)
    ckpt_dir, tokenizer_path = demo.model_paths(ckpt_dir, tokenizer_path)
    http = None
    with parallel.agreement("opening the server's port"):  # a busy port fails every rank, before loading
        if placement.is_main:  # only rank 0 reads the TLS files
            _check_tls(ssl_certfile, ssl_keyfile)
            # /health says 503 while loading
            http = HttpProcess(bind(host, port), HttpSettings(name, max_waiting, api_key, max_stored_responses,
                                                              limits, ssl_certfile, ssl_keyfile))
    try:
        generator = Llama.build(ckpt_dir, tokenizer_path, max_seq_len, max_batch_size, dtype=dtype,
                                quantize=quantize, compile=compile,
                                speculate=speculate, speculate_k=speculate_k, draft_ckpt_dir=draft_ckpt_dir,
                                draft_quantize=draft_quantize, kv_cache_memory=kv_cache_memory,
                                kv_cache_fraction=kv_cache_fraction,
                                reasoning_parser=reasoning_parser)
        generator.model.prefix_cache.enabled = not no_prefix_cache
        generator.warm_up()  # before /health says ready, not in the first requests
        with parallel.agreement("starting the HTTP server"):
            if http is not None:
                http.wait_until_listening()
        serving = engine_loop(generator, max_prefill_tokens, http.channel if http is not None else None)
        stopping = threading.Event()
        _stop_on_signals(stopping, http.channel if http is not None else None)
        if http is not None:
            http.channel.ready(ServedModel(generator))
            print0(f"llama_tp serves {name} at {http.url}/v1 (Ctrl-C to stop)")
        serving.run(lambda: stopping.is_set() or (http is not None and http.lost))
        if http is not None and http.lost:
            raise JobEnded(http.ended_unexpectedly())
        print0("llama_tp stopped serving: running requests were ended, new ones refused")
    finally:
        if http is not None:
            http.stop()  # open streams get their last events first


def _check_limits(limits: ServerLimits) -> None:
    """Each limit must leave room for a request."""
    for option, value in (("--max_body_bytes", limits.max_body_bytes), ("--read_timeout", limits.read_timeout),
                          ("--max_grammar_bytes", limits.grammar.max_bytes),
                          ("--grammar_timeout", limits.grammar.max_seconds)):
        if not value > 0:
            raise ValueError(f"{option} is {value}, but it must be more than 0; leave it out for its default")


def _check_tls(ssl_certfile: Optional[str], ssl_keyfile: Optional[str]) -> None:
    """HTTPS needs both files, and both must be there, a certificate and its key (here, before the
    model loads; the HTTP process reads them again)."""
    if (ssl_certfile is None) != (ssl_keyfile is None):
        given, missing = ("--ssl_certfile", "--ssl_keyfile") if ssl_keyfile is None else ("--ssl_keyfile", "--ssl_certfile")
        raise ValueError(f"{given} is given without {missing}; HTTPS needs both (PEM files)")
    for option, path in (("--ssl_certfile", ssl_certfile), ("--ssl_keyfile", ssl_keyfile)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{option} {path} is not a file; pass the PEM file's path")
    if ssl_certfile is not None:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(ssl_certfile, ssl_keyfile)
        except ssl.SSLError as error:
            raise ValueError(f"--ssl_certfile {ssl_certfile} and --ssl_keyfile {ssl_keyfile} are not a PEM certificate "
                             f"and its private key ({error.reason or error}); pass the server's own pair") from None


def _stop_on_signals(stopping: threading.Event, channel: "Optional[EngineChannel]") -> None:
    """Ctrl-C and SIGTERM (torchrun forwards both) end the serving loop cleanly at its next step."""

    def stop(signum, frame) -> None:
        stopping.set()
        if channel is not None:
            channel.wake()  # rank 0 may be waiting for a request

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


if __name__ == "__main__":
    run(main)
