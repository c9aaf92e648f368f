"""sampler.py's rules, each at its edge and exactly (test_sampler.py compares the draws with the
defined distribution): the uniform number each row draws, the inverse CDF, top-k's k-th token,
min-p alone, the full sort's cut, which rows are settled, the history, and the device."""

import pytest
import torch

from llama_tp.sampling import sampler
from llama_tp.sampling.sampler import TokenHistory, choose, sample
from llama_tp.sampling import SamplingOptions

pytestmark = pytest.mark.usefixtures("sampler_path")

SAMPLED = SamplingOptions(temperature=1.0, top_p=1.0)
GREEDY = SamplingOptions(temperature=0)


def test_each_row_takes_the_token_where_the_running_sum_passes_its_float64_uniform():
    rows, vocab = 64, 16  # equal logits: token floor(u * 16) for the row's uniform u
    tokens = choose(torch.zeros(rows, vocab), [SAMPLED] * rows, torch.Generator().manual_seed(7))
    uniform = torch.rand(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    assert tokens.tolist() == (uniform * vocab).floor().long().tolist()
    generators = [torch.Generator().manual_seed(100 + row) for row in range(rows)]
    tokens = choose(torch.zeros(rows, vocab), [SAMPLED] * rows, generators)
    uniform = torch.stack([torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(100 + row))
                           for row in range(rows)])
    assert tokens.tolist() == (uniform * vocab).floor().long().tolist()


def test_the_inverse_cdf_takes_the_first_running_sum_past_u_never_a_token_without_weight():
    inverse_cdf = sampler.inverse_cdf
    assert inverse_cdf(torch.tensor([[1.0, 1.0]]), torch.tensor([0.5], dtype=torch.float64)).tolist() == [1]
    assert inverse_cdf(torch.tensor([[0.0, 1.0, 1.0]]), torch.tensor([0.0], dtype=torch.float64)).tolist() == [1]


def test_top_k_keeps_exactly_the_k_best_with_and_without_top_p():
    logits = torch.tensor([4.0, 3.5, 3.0, 2.5, 0.0, -1.0]).repeat(300, 1)
    for top_p in (1.0, 0.999):
        for k in (1, 2, 3):
            options = [SamplingOptions(temperature=1.0, top_p=top_p, top_k=k)] * 300
            assert set(choose(logits, options, torch.Generator().manual_seed(k)).tolist()) == set(range(k))


def test_min_p_alone_cuts_the_unlikely():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(300, 1)
    options = [SamplingOptions(temperature=1.0, top_p=1.0, min_p=0.5)] * 300  # keeps 0.25 and above
    assert set(choose(logits, options, torch.Generator().manual_seed(0)).tolist()) == {0, 1}


def test_the_full_sort_keeps_the_tokens_whose_mass_before_is_below_p():
    rows, vocab = 5000, 512  # equal tokens, 2**-9 each: the sums are exact, and 256 candidates do not hold 0.5
    draw = sample(torch.zeros(rows, vocab), [SamplingOptions(temperature=1.0, top_p=0.5)] * rows,
                  torch.Generator().manual_seed(0))
    assert draw.unsettled is None or draw.unsettled.all()  # None: our kernel settled them
    assert len(set(draw.settle().tolist())) == 256  # the 257th has 0.5 before it


@pytest.mark.parametrize("sampler_path", ["torch's ops"], indirect=True)  # our kernel settles every row
def test_a_row_whose_candidates_are_the_whole_vocabulary_is_settled():
    draw = sample(torch.zeros(3, 4), [SamplingOptions(temperature=1.0, top_p=0.99)] * 3, torch.Generator())
    assert draw.unsettled.tolist() == [False] * 3


def test_a_history_without_a_penalty_or_without_tokens_changes_nothing():
    logits = torch.tensor([[1.0, 3.0, 2.0], [5.0, 4.0, 0.0]])
    assert choose(logits, [GREEDY] * 2, history=torch.tensor([[1], [0]])).tolist() == [1, 0]
    penalty = SamplingOptions(temperature=0, repetition_penalty=4.0)
    assert choose(logits, [penalty] * 2, history=torch.zeros(2, 0, dtype=torch.long)).tolist() == [1, 0]


def test_a_new_history_is_all_padding():
    assert TokenHistory(2, 3, torch.device("cpu")).ids.tolist() == [[-1] * 3] * 2


def test_a_step_is_made_on_the_logits_device():
    # On the meta device a tensor made on the CPU by mistake cannot be mixed in: a GPU's case.
    meta = torch.device("meta")
    options = [GREEDY, SamplingOptions(temperature=0.8, top_p=0.9, top_k=5), SamplingOptions(temperature=1.0, top_p=1.0,
               min_p=0.1, repetition_penalty=1.2)]
    history = TokenHistory(3, 4, meta)
    history.write(0, 0, [1, 2])
    assert history.ids.device == meta
    for rows in (options, options[1:]):  # with a greedy row, and every row sampled
        for generators in (None, [None] * len(rows)):
            draw = sample(torch.zeros(len(rows), 300, device=meta), rows, generators, history.ids[: len(rows)])
            assert draw.tokens.device == meta and draw.unsettled.device == meta
