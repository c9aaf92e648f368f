"""Where a serving step's time goes: our engine run in this process (no HTTP, one rank) on the
serving benchmark's requests, closed loop at one concurrency, its parts timed: the model's
passes (decoding and prefill), choosing the tokens (sampling, log probabilities, the read-back)
and the host's work per token (text, stop strings, the scheduler). Then torch.profiler's
busiest operators over a window of decoding steps. `python -m llama_tp.bench_serve --profile`.
"""

import time
from collections import defaultdict, deque
from functools import wraps
from typing import Callable

import torch

from ...engine import Admission, Engine, GenerationRequest
from ...generation import Llama
from .. import demo
from .workload import PROMPTS, SAMPLINGS

# The decoding steps torch.profiler watches, after these many steps of warm-up.
PROFILED_STEPS = 30
WARMUP_STEPS = 20


def profile_engine(quantize: str, sampling: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    """Serve `requests` of bench_serve's requests, `concurrency` at a time; print and return the parts."""
    checkpoint = demo.demo_checkpoint(1)
    llama = Llama.build(str(checkpoint), str(checkpoint / "tokenizer.json"), max_seq_len=2048,
                        max_batch_size=concurrency, quantize=None if quantize == "fp32" else quantize)
    engine = llama.engine(max_prefill_tokens=256)
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    _time(engine, "_choose", "choosing tokens", seconds, calls)
    _time(engine, "_advance", "host work per token", seconds, calls)
    model = engine.model
    _time(model, "forward", lambda tokens, *_, **__: "model: decoding" if tokens.shape[1] == 1 else "model: prefill",
          seconds, calls)
    _time(model, "forward_segments", "model: decoding and prompts in one pass", seconds, calls)
    options = llama.sampling_options(**SAMPLINGS[sampling])
    pending = deque(
        GenerationRequest(f"profile-{index}", tuple(llama.formatter.encode_dialog_prompt(
            [{"role": "user", "content": prompt}])), max(1, round(max_tokens * share)), options,
            frozenset(llama.formatter.stop_tokens))
        for index, (prompt, share) in ((i, PROMPTS[i % len(PROMPTS)]) for i in range(requests)))
    steps = 0
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    start = time.perf_counter()
    try:
        while pending or engine.running:
            for admission in _admissions(engine, pending, concurrency):
                engine.admit(admission)
            if steps == WARMUP_STEPS:
                profiler.start()
            engine.step()
            steps += 1
            if steps == WARMUP_STEPS + PROFILED_STEPS:
                profiler.stop()
    finally:  # the model is shared with nothing else, but left whole: its own methods again
        del model.forward, model.forward_segments
    wall = time.perf_counter() - start
    generated = calls["host work per token"]  # one call a token
    seconds["other (scheduler, feeding, Python)"] = wall - sum(seconds.values())
    print(f"\nprofile: ours {quantize}, {sampling}, {concurrency} requests at a time, {requests} requests, "
          f"{steps} steps in {wall:.1f} s: {generated / wall:.1f} tokens/s in-process")
    for part, value in sorted(seconds.items(), key=lambda item: -item[1]):
        print(f"  {part:<40}{1000 * value / steps:>8.2f} ms a step  {100 * value / wall:>5.1f}%")
    if steps > WARMUP_STEPS:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return {"quantize": quantize, "sampling": sampling, "steps": steps, "seconds": wall, "tokens": generated,
            "parts": dict(seconds)}


def _admissions(engine: Engine, pending: deque, concurrency: int) -> tuple[Admission, ...]:
    """The waiting requests that fit now, as rank 0 would admit them (a closed loop)."""
    admitted, taken = [], set()
    while pending and len(engine.running) + len(admitted) < concurrency:
        slot = engine.choose_slot(pending[0].prompt_tokens, taken)
        if slot is None:
            break
        taken.add(slot)
        admitted.append(Admission(pending.popleft(), slot, seed=len(taken)))
    return tuple(admitted)


def _time(owner, method: str, part: "str | Callable[..., str]", seconds: dict[str, float],
          calls: dict[str, int]) -> None:
    """Time every call of owner's method into seconds[part] (or the part that part(*args, **kwargs)
    names), and count them in calls[part]."""
    original = getattr(owner, method)

    @wraps(original)
    def timed(*args, **kwargs):
        name = part(*args, **kwargs) if callable(part) else part
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start
            calls[name] += 1

    setattr(owner, method, timed)
