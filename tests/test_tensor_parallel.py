"""Split over 2 and 4 processes, the model computes what it computes on one."""

import pytest
import torch

from distributed import run_world
from llama_tp import Llama, parallel

# Worlds of 1, 2 and 4 spawned processes; test_reshard_load.py checks logits and greedy tokens quickly.
pytestmark = pytest.mark.slow

PROMPTS = [[1, 450, 4996, 17354, 1701], [1, 306, 4658], [1, 18637, 29892, 3186, 29991, 910, 338]]
FAMILIES = ("llama2", "llama3")


def logits_and_greedy_tokens(folders: dict[str, str], tokenizer_path: str) -> dict[str, tuple]:
    """On each rank: full-forward logits and greedy generations for each checkpoint, and the
    widths of the logits plain greedy decoding picked from (parallel.vocab_argmax)."""
    results = {}
    picked_from = []
    vocab_argmax = parallel.vocab_argmax
    parallel.vocab_argmax = lambda logits: picked_from.append(logits.shape[-1]) or vocab_argmax(logits)
    for family, folder in folders.items():
        llama = Llama.build(folder, tokenizer_path, max_seq_len=32, max_batch_size=3)
        tokens = torch.tensor([prompt[:3] for prompt in PROMPTS])
        logits = llama.model.forward(tokens, 0)
        generated, logprobs = llama.generate(PROMPTS, max_gen_len=8, temperature=0, logprobs=True)
        picked_from.clear()
        greedy, _ = llama.generate(PROMPTS, max_gen_len=8, temperature=0)  # picked from vocabulary slices
        sampled, _ = llama.generate(PROMPTS, max_gen_len=8, temperature=0.8, top_p=0.9)
        results[family] = (logits, generated, logprobs, sampled, greedy, set(picked_from), llama.model.args.vocab_size)
    return results


@pytest.fixture(scope="module")
def single_process(checkpoints, tokenizer_path):
    folders = {family: str(checkpoints[family, 1]) for family in FAMILIES}
    results = run_world(1, logits_and_greedy_tokens, folders, tokenizer_path)[0]
    for logits, tokens, logprobs, sampled, greedy, picked_from, vocab_size in results.values():
        assert greedy == tokens and picked_from == {vocab_size}
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_world_size_gives_single_process_results(world_size, checkpoints, tokenizer_path, single_process):
    folders = {family: str(checkpoints[family, world_size]) for family in FAMILIES}
    per_rank = run_world(world_size, logits_and_greedy_tokens, folders, tokenizer_path)
    for family in FAMILIES:
        expected_logits, expected_tokens, expected_logprobs, expected_sampled, *_ = single_process[family]
        for rank, results in enumerate(per_rank):
            logits, tokens, logprobs, sampled, greedy, picked_from, vocab_size = results[family]
            torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=0, msg=f"{family} rank {rank}")
            assert tokens == expected_tokens, f"{family} rank {rank}"
            assert greedy == expected_tokens, f"{family} rank {rank}: greedy from vocabulary slices"
            assert picked_from == {vocab_size // world_size}, f"{family} rank {rank}"
            for row, expected_row in zip(logprobs, expected_logprobs):
                assert row == pytest.approx(expected_row, abs=1e-4)
            # Same seed everywhere and the same logits: sampling agrees across ranks and sizes.
            assert sampled == per_rank[0][family][3] == expected_sampled
