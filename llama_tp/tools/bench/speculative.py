"""Speculative decoding against plain decoding, taking turns in one run: speed, acceptance, and a
check that greedy tokens are the same.

    python -m llama_tp.tools.bench.speculative --speculate draft --draft_quantize int8
    python -m llama_tp.tools.bench.speculative --speculate lookup --speculate_k 2,4,6,8

By default the demo model in fp32 at batch 1, greedy (temperature 0, no repetition penalty).
The draft answers everyday questions; prompt lookup rewrites a 300-token passage, a task that
copies from its input. Each repeat runs every dialog once plainly, then once with each
speculate_k given (one figure per k: a sweep), dialog by dialog, and times decoding after the
first token (the prefill is the same both ways). The speed-up is the median ratio of a
speculative run to the plain run of the same dialog just before. It also times where a round's
time goes: the draft's passes, the target's verifying pass, and the rest (choosing,
bookkeeping); for plain decoding, a step's.
"""

import json
import os
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from ... import parallel
from ...engine import GenerationRequest, run_job
from ...engine.speculative import SpeculationStats, Speculator
from ...generation import Llama
from ...text.chat_format import Dialog
from .. import demo
from ..cli import run

EVERYDAY = [
    "What are three tips for staying focused while working from home?",
    "Explain how a rainbow forms, in a short paragraph.",
    "Write a friendly email inviting my neighbours to a garden party on Saturday.",
    "What is the difference between a list and a tuple in Python?",
]

PASSAGE = (
    "The town of Harrowgate sat at the bend of a slow brown river, and for most of its history it was known "
    "for nothing more than its bridge. The bridge was built of grey stone in the year the old mill burned down, "
    "and it had seven arches, each a little lower than the one before, so that from the water it looked like a "
    "giant stepping carefully across. Farmers brought their wool over it on market days, and children dared each "
    "other to walk along its narrow parapet. In the spring of the flood, the river rose higher than anyone could "
    "remember. It swallowed the meadows, then the lower streets, then the steps of the church. People gathered on "
    "the hill and watched the water press against the bridge, certain that the arches would give way. They did "
    "not. When the flood went down, the bridge stood exactly as before, with only a line of mud to show how high "
    "the water had come. After that, the people of Harrowgate began to speak of the bridge with a kind of pride. "
    "They painted the line of mud onto the stone so that visitors could see it, and they held a small festival "
    "every year on the day the water fell. The mill was never rebuilt, but a bakery now stands where it was, and "
    "on festival mornings it sells round loaves marked with seven lines, one for each arch of the bridge."
)
COPYING = [
    f"Rewrite the following text in your own words, keeping every detail:\n\n{PASSAGE}",
    f"Summarise the following text in a few sentences:\n\n{PASSAGE}",
]


def dialogs_for(speculate: str) -> list[Dialog]:
    """The task each mode is measured on: everyday questions for a draft, copying for lookup."""
    return [[{"role": "user", "content": text}] for text in (COPYING if speculate == "lookup" else EVERYDAY)]


class Timer:
    """Seconds spent in a model's forward passes, and their number, between start and stop (on a
    GPU until the pass has run: each waits for its device, as the round's read-back would soon after)."""

    def __init__(self, model: torch.nn.Module):
        self.seconds, self.calls, self.running = 0.0, 0, False
        forward = model.forward
        device = model.rotary.device

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                if self.running:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    self.seconds += time.perf_counter() - start
                    self.calls += 1

        model.forward = timed

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False

    def take(self) -> tuple[float, int]:
        """The time and calls counted so far, starting afresh."""
        taken = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return taken


def decode(llama: Llama, prompt: list[int], new_tokens: int, options: dict,
           timers: tuple[Timer, ...] = ()) -> tuple[list[int], float]:
    """Greedy tokens for prompt, and the seconds after the first (which every way gets from the
    same prefill); the timers count only those seconds' passes."""
    sampling = llama.sampling_options(**options)
    room = min(new_tokens, llama.model.max_seq_len - len(prompt))
    request = GenerationRequest("bench", tuple(prompt), room, sampling, frozenset(llama.tokenizer.stop_tokens))
    steps = run_job(llama.engine(), [(request, sampling.seed or 0)])
    updates = []
    while not any(update.delta.tokens or update.delta.finished for update in updates):
        updates = next(steps)  # the prefill, until it has chosen the first token
    for timer in timers:
        timer.start()
    start = time.perf_counter()
    for updates in steps:
        pass
    elapsed = time.perf_counter() - start
    for timer in timers:
        timer.stop()
    return updates[-1].sequence.sampling.answer, elapsed


def main(
    speculate: str = "draft",
    speculate_k: tuple[int, ...] = (6,),
    draft_ckpt_dir: Optional[str] = None,
    draft_quantize: Optional[str] = "int8",
    ckpt_dir: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    new_tokens: int = 128,
    repeats: int = 3,
    temperature: float = 0.0,
    repetition_penalty: float = 1.0,
    threads: Optional[int] = None,
    compile: bool = False,
    dtype: str = "fp32",
    json_path: str = "bench_speculative.json",
):
    """Time plain and speculative decoding, interleaved; print the speed-up and acceptance per k.

    Args:
        speculate: draft or lookup.
        speculate_k: guesses a round; several (e.g. 2,4,6,8) to sweep.
        draft_ckpt_dir: the draft's checkpoint (default: the target's own, quantized as draft_quantize).
        draft_quantize: the draft's quantization (default int8; ignored with --speculate lookup).
        ckpt_dir: the target (default: the demo model).
        tokenizer_path: its tokenizer (default: the demo model's).
        new_tokens: most tokens generated per dialog.
        repeats: timed runs of each way (medians are reported).
        temperature: 0 (greedy) checks that the tokens are the same both ways.
        repetition_penalty: 1 (none) by default, whatever the model recommends.
        threads: torch threads (default: torch's choice).
        compile: compile the steps (Llama.build's compile: on a CPU the draft's; on a GPU the
            target's too, its verifying step recorded for the first speculate_k).
        dtype: the models' (fp32, bf16, fp16): bf16 on a GPU.
        json_path: where to write every figure.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    ks = (speculate_k,) if isinstance(speculate_k, int) else tuple(speculate_k)
    ckpt_dir, tokenizer_path = demo.model_paths(ckpt_dir, tokenizer_path)
    if speculate == "lookup":
        draft_quantize = draft_ckpt_dir = None
    llama = Llama.build(ckpt_dir, tokenizer_path, max_seq_len=1024, max_batch_size=1, dtype=dtype,
                        speculate=speculate, speculate_k=ks[0], draft_ckpt_dir=draft_ckpt_dir,
                        draft_quantize=draft_quantize, compile=compile)
    speculator = llama.speculator
    plain = Llama(llama.model, llama.tokenizer, llama.formatter, llama.sampling_defaults)
    prompts = [llama.formatter.encode_dialog_prompt(dialog) for dialog in dialogs_for(speculate)]
    options = dict(temperature=temperature, repetition_penalty=repetition_penalty)
    timers = {"target": Timer(llama.model)}
    if speculator.draft is not None:
        timers["draft"] = Timer(speculator.draft.model)
    ways = {"plain": None} | {f"k={k}": k for k in ks}
    for prompt in prompts[:1]:  # warm-up: first calls, the kernels' lazy set-up
        for k in ways.values():
            run_once(plain if k is None else llama, prompt, new_tokens, options, speculator, k, timers)
    # Each prompt every way in turn, so that a shared machine's drifting speed falls on all alike.
    runs: dict[str, list[dict]] = {name: [] for name in ways}
    for _ in range(repeats):
        for prompt in prompts:
            for name, k in ways.items():
                runs[name].append(run_once(plain if k is None else llama, prompt, new_tokens, options, speculator, k,
                                           timers))
    report = summarise(runs, temperature == 0)
    report["command"] = {"speculate": speculate, "speculate_k": list(ks), "draft_ckpt_dir": draft_ckpt_dir,
                         "draft_quantize": draft_quantize, "ckpt_dir": str(ckpt_dir), "new_tokens": new_tokens,
                         "repeats": repeats, "temperature": temperature, "repetition_penalty": repetition_penalty,
                         "compile": compile, "dtype": dtype}
    report["machine"] = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                         "load_average": os.getloadavg(), "torch": torch.__version__}
    if parallel.global_rank() == 0:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print_table(report)
        print(f"wrote {json_path}")


def run_once(llama: Llama, prompt: list[int], new_tokens: int, options: dict, speculator: Speculator,
             k: Optional[int], timers: dict[str, Timer]) -> dict:
    """Decode one prompt (plainly if k is None); its tokens, seconds, passes, and for speculation its counts."""
    if k is not None:
        speculator.k = k
        speculator.stats = SpeculationStats()
    for timer in timers.values():
        timer.take()
    tokens, seconds = decode(llama, prompt, new_tokens, options, tuple(timers.values()))
    result = {"tokens": tokens, "seconds": seconds, "decoded": len(tokens) - 1,
              "passes": {name: timer.take() for name, timer in timers.items()}}
    if k is not None:
        stats = speculator.stats
        result |= {"proposed": stats.proposed, "accepted": stats.accepted, "rounds": stats.verified_rows,
                   "round_tokens": stats.tokens}
    return result


def summarise(runs: dict[str, list[dict]], greedy: bool) -> dict:
    """Per way: the median of its runs' decode tokens/s, and of their ratios to the plain run of
    the same prompt just before (the speed-up); acceptance, tokens a round, and milliseconds a
    round in the draft's passes, the target's and the rest (plain: a step's)."""
    summary: dict = {"ways": {}}
    plain = runs["plain"]
    for name, way in runs.items():
        speeds = [r["decoded"] / r["seconds"] for r in way]
        ratios = [speed * p["seconds"] / p["decoded"] for speed, p in zip(speeds, plain)]
        figures = {"tokens_per_s": statistics.median(speeds), "speedup": statistics.median(ratios),
                   "runs_tokens_per_s": speeds, "runs_speedup": ratios}
        if greedy:
            figures["same_tokens_as_plain"] = all(r["tokens"] == p["tokens"] for r, p in zip(way, plain))
        steps = [r.get("rounds") or r["decoded"] for r in way]  # a plain run's steps are its tokens
        figures["ms_per_round"] = {part: statistics.median(r["passes"][part][0] * 1000 / n for r, n in zip(way, steps))
                                   for part in way[0]["passes"] if way[0]["passes"][part][1]}
        figures["ms_per_round"]["total"] = statistics.median(r["seconds"] * 1000 / n for r, n in zip(way, steps))
        if "proposed" in way[0]:
            figures["acceptance_rate"] = sum(r["accepted"] for r in way) / max(sum(r["proposed"] for r in way), 1)
            figures["tokens_per_target_pass"] = sum(r["round_tokens"] for r in way) / max(sum(steps), 1)
            figures["draft_passes_per_round"] = statistics.median(r["passes"].get("draft", (0, 0))[1] / n
                                                                  for r, n in zip(way, steps))
        summary["ways"][name] = figures
    return summary


def print_table(report: dict) -> None:
    print(f"{'way':<8}{'tok/s':>8}{'speed-up':>10}{'same':>6}{'accepted':>10}{'tok/pass':>10}"
          f"{'ms/round: draft':>17}{'target':>8}{'rest':>7}")
    for name, figures in report["ways"].items():
        same = {True: "yes", False: "NO", None: "-"}[figures.get("same_tokens_as_plain")]
        ms = figures["ms_per_round"]
        rest = ms["total"] - ms.get("draft", 0) - ms["target"]
        accepted = f"{100 * figures['acceptance_rate']:>9.0f}%" if "acceptance_rate" in figures else f"{'-':>10}"
        per_pass = f"{figures.get('tokens_per_target_pass', 1.0):>10.2f}"
        print(f"{name:<8}{figures['tokens_per_s']:>8.1f}{figures['speedup']:>9.2f}x{same:>6}{accepted}{per_pass}"
              f"{ms.get('draft', 0):>17.1f}{ms['target']:>8.1f}{rest:>7.1f}")


if __name__ == "__main__":
    run(main)
