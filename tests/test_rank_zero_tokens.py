"""Ranks whose logits differ (GPUs of different models or drivers round differently) still take
the same tokens: rank 0's choices reach the others with each step's read-back (llama_tp/choices.py,
issue 31 item 6). Rank 1's logits get noise that would change every sampled token; the ranks
must still return the same answers, rank 0's own, and nothing may hang."""

import pytest
import torch

from distributed import run_world
from llama_tp import Llama
from llama_tp.model.transformer import Transformer
from llama_tp.parallel import collectives
from serve_harness import Harness, request, tokens_of
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # worlds of two spawned processes

# 5 prompts on 3 rows: generate batches them continuously through the serving engine.
PROMPTS = [[1, 450, 4996, 17354], [1, 306, 4658] * 5, [1, 450], [1, 18637, 29892, 920, 29871, 13], [1, 15043]]
SAMPLED = dict(temperature=1.0, top_p=0.95, top_k=50, seed=11)


def perturb_logits_on_rank_one() -> None:
    """On rank 1, noise on every gathered logit (slices for vocab_argmax stay as they are: every
    rank picks the greedy winner from the same gathered pairs)."""
    if torch.distributed.get_rank() != 1:
        return
    forward, noise = Transformer.forward, torch.Generator().manual_seed(5)

    def noisy(self, *args, **kwargs):
        logits = forward(self, *args, **kwargs)
        if kwargs.get("vocab_slice"):
            return logits
        return logits + 3 * torch.randn(logits.shape, generator=noise, dtype=logits.dtype)

    Transformer.forward = noisy


def answers(llama: Llama, speculating: Llama) -> dict:
    return {
        "static": llama.generate(PROMPTS[:1], max_gen_len=12, logprobs=True, **SAMPLED),
        "continuous": llama.generate(PROMPTS, max_gen_len=12, logprobs=True, **SAMPLED),
        "top": llama.text_completion(["Hello"], max_gen_len=6, show_top=2, **SAMPLED),
        "speculation": speculating.generate(PROMPTS[:3], max_gen_len=12, **SAMPLED),
    }


def serve(llama: Llama) -> list[list[int]]:
    """Sampled requests served with rank 0's mailbox; every rank returns the answers it made."""
    sampled = {name: value for name, value in SAMPLED.items() if name != "seed"}
    if torch.distributed.get_rank() == 0:
        harness = Harness(llama, start=False)
        streams = [harness.submit(request(llama, prompt, 8, seed=index, **sampled))
                   for index, prompt in enumerate(PROMPTS)]
        harness.thread.start()
        served = [tokens_of(harness.deltas(stream)) for stream in streams]
        harness.close()
        return served
    from llama_tp.engine import Observer, Serving  # the other ranks have no mailbox

    ended = {}

    class Answers(Observer):
        def finished(self, sequence, reason):
            ended[sequence.request.id] = sequence.sampling.answer

    Serving(llama.engine(16, Answers()), None).run(lambda: False)  # ends when rank 0 stops
    return [ended[key] for key in sorted(ended, key=lambda key: int(key.rsplit("-", 1)[-1]))]


def on_each_rank(checkpoint: str) -> tuple[dict, dict, list[list[int]]]:
    # CPU ranks of one host compute alike and skip the exchange; here they stand for GPUs that differ.
    collectives._ranks_compute_alike = lambda: False
    llama = Llama.build(checkpoint, str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=3)
    speculating = Llama.build(checkpoint, str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=3,
                              speculate="draft", draft_ckpt_dir=checkpoint, speculate_k=3)
    before = answers(llama, speculating)
    perturb_logits_on_rank_one()
    return before, answers(llama, speculating), serve(llama)


def test_every_rank_takes_rank_zeros_tokens_whatever_its_own_logits_say(tmp_path):
    write_checkpoint(tmp_path, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 2, "dim")
    (before, after, served), (_, after_on_one, served_on_one) = run_world(2, on_each_rank, str(tmp_path))
    assert after_on_one == after  # bit for bit, log probabilities and top candidates included
    for case in ("static", "continuous"):  # rank 0's logits are untouched: its answers too
        assert after[case][0] == before[case][0]
        for row, before_row in zip(after[case][1], before[case][1]):  # the cache reused: the last bits may differ
            assert row == pytest.approx(before_row, abs=1e-5)
    assert after["speculation"][0] == before["speculation"][0]
    assert served_on_one == served and all(served)
