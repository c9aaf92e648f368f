"""Time sampled rounds of speculation on the tiny random Llama 2 (32,000 tokens), where a round's
cost is mostly choosing tokens rather than the model's passes: docs/speculative.md's figures.

    OMP_NUM_THREADS=1 taskset -c 1 python tests/round_timing.py [ROWS] [MODE] [TOP_K]

ROWS rows (default 16), each with its own seeded generator, sample at temperature 0.8 with
top_p 0.9 and TOP_K (default 50; 0 for none) and, on every other row, a repetition penalty of
1.1; MODE is "draft" (the target's int8 copy, 6 guesses; the default) or "lookup". Prints the
median of 20 rounds, after 3 to warm up.
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from llama_tp import Llama
from llama_tp.engine.speculative import Row
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint

ROUNDS, WARM_UP = 20, 3


def main(rows: int = 16, mode: str = "draft", top_k: int = 50) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint(Path(folder), TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")
        options = dict(speculate="draft", draft_quantize="int8") if mode == "draft" else dict(speculate="lookup")
        llama = Llama.build(folder, str(LLAMA2_TOKENIZER), max_seq_len=512, max_batch_size=rows, speculate_k=6,
                            **options)
    model = llama.model
    prompts = [[1, *range(300 + 7 * row, 320 + 7 * row)] * 2 for row in range(rows)]  # lookup finds guesses
    batch = []
    for slot, prompt in enumerate(prompts):  # the target's caches hold all but each row's last token
        model.forward(torch.tensor([prompt[:-1]]), 0, slots=[slot])
        model.prefix_cache.extend(slot, 0, prompt[:-1])
        chosen = llama.sampling_options(temperature=0.8, top_p=0.9, top_k=top_k,
                                        repetition_penalty=1.1 if slot % 2 else 1.0, seed=slot)
        batch.append(Row(slot, prompt, chosen, chosen.generator(model.rotary.device), len(prompt), [2], 400))
    times = []
    for _ in range(WARM_UP + ROUNDS):
        start = time.perf_counter()
        outcomes = llama.speculator.round(model, batch)
        times.append(time.perf_counter() - start)
        for row, outcome in zip(batch, outcomes):
            row.tokens = row.tokens + outcome.tokens
    print(f"{rows} rows, {mode}, top_k {top_k}: {1000 * statistics.median(times[WARM_UP:]):.1f} ms a round "
          f"({llama.speculator.stats.describe()})")


if __name__ == "__main__":
    main(*(arg if index == 1 else int(arg) for index, arg in enumerate(sys.argv[1:])))
