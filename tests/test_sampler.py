"""The batched sampler (sampler.py): every row with its own options and generator in one call,
drawing from exactly the distribution sampling.py defines (chi-square), whether a row's nucleus
fits its candidates or needs the full sort; the repetition penalty from each row's history. Each
test runs through torch's ops and through our kernel (conftest's sampler_path)."""

import pytest
import torch
from scipy.stats import chi2

from llama_tp.sampling import sampler
from llama_tp.sampling.sampler import TokenHistory, choose, sample
from llama_tp.sampling import SamplingOptions, adjust_logits, choose_next, distribution

pytestmark = pytest.mark.usefixtures("sampler_path")

VOCAB = 12
SAMPLES = 30_000
# A sharp row (its 4 best hold 0.9 of the mass at these options) and a flat one (they do not).
SHARP = torch.tensor([5.0, 4.0, 3.5, 3.0, 1.0, 0.5, 0.0, -1.0, -2.0, -2.0, -3.0, -4.0])
FLAT = torch.linspace(1.0, 0.0, VOCAB)


def chi_square_p_value(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    """The chance that draws from `expected` [vocab] fit it worse than tokens do."""
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "a token outside the distribution was drawn"
    wanted = expected[support].double() * len(tokens)
    statistic = float(((counts[support] - wanted) ** 2 / wanted).sum())
    return float(chi2.sf(statistic, int(support.sum()) - 1))


@pytest.fixture
def four_candidates(monkeypatch):
    """So few candidates that the flat row's nucleus reaches past them."""
    monkeypatch.setattr(sampler, "NUCLEUS_CANDIDATES", 4)
    sampler.step_options.cache_clear()
    yield
    sampler.step_options.cache_clear()


@pytest.mark.parametrize("logits", [SHARP, FLAT], ids=["held by the candidates", "full sort"])
@pytest.mark.parametrize("options", [
    SamplingOptions(temperature=0.8, top_p=0.9),
    SamplingOptions(temperature=1.3, top_p=0.7, top_k=6),
    SamplingOptions(temperature=0.7, top_p=1.0),
    SamplingOptions(temperature=1.0, top_p=0.95, min_p=0.3),
], ids=["top-p", "top-k and top-p", "no cut", "min-p"])
def test_draws_follow_the_defined_distribution(four_candidates, logits, options):
    expected = distribution(logits[None], options)[0]  # today's definition: a full sort
    draw = sample(logits.repeat(SAMPLES, 1), [options] * SAMPLES, torch.Generator().manual_seed(0))
    tokens = draw.settle()
    assert chi_square_p_value(tokens, expected) > 1e-3
    if draw.unsettled is None:  # our kernel settles every row itself
        return
    if logits is FLAT and options.top_p < 1 and options.top_k is None:
        assert draw.unsettled.all()  # the full sort was needed, and taken
    elif logits is SHARP:
        assert not draw.unsettled.any()


def test_a_row_found_by_the_full_sort_takes_the_token_its_candidates_would(monkeypatch):
    options = [SamplingOptions(temperature=1.0, top_p=0.95)] * 200
    wide = choose(FLAT.repeat(200, 1), options, torch.Generator().manual_seed(3))
    monkeypatch.setattr(sampler, "NUCLEUS_CANDIDATES", 4)
    sampler.step_options.cache_clear()
    try:
        narrow = choose(FLAT.repeat(200, 1), options, torch.Generator().manual_seed(3))
    finally:
        sampler.step_options.cache_clear()
    assert torch.equal(wide, narrow)


def test_each_row_keeps_its_own_options_and_generator_whatever_else_is_in_the_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    options = [SamplingOptions(temperature=0), SamplingOptions(temperature=0.9, top_p=0.8),
               SamplingOptions(temperature=1.2, top_k=5, top_p=1.0), SamplingOptions(temperature=0.5, min_p=0.1)]

    def run(rows):
        generators = [torch.Generator().manual_seed(10 + row) for row in rows]
        return torch.stack([choose(logits[rows], [options[r] for r in rows], generators) for _ in range(30)])

    together = run([0, 1, 2, 3])
    for row in range(4):
        assert torch.equal(run([row])[:, 0], together[:, row])
    assert (together[:, 0] == logits[0].argmax()).all()


def test_greedy_takes_the_first_of_equal_best():
    logits = torch.tensor([[0.0, 2.0, 5.0, 5.0, 1.0], [7.0, 7.0, 7.0, 7.0, 7.0]])
    assert choose(logits, [SamplingOptions(temperature=0)] * 2).tolist() == [2, 0]


def test_bans_apply_before_sampling():
    logits = torch.zeros(2, 6)
    ban = torch.tensor([[False, True, True, True, True, True], [True] * 5 + [False]])
    options = [SamplingOptions(temperature=1.0, top_p=1.0)] * 2
    for seed in range(20):
        assert choose(logits, options, torch.Generator().manual_seed(seed), ban=ban).tolist() == [0, 5]


def test_the_repetition_penalty_reads_the_history_token_0_included():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    history = torch.tensor([[0, 5, -1, -1], [3, 0, 7, 7], [-1, -1, -1, 4]])  # -1: padding, as speculation pads
    options = SamplingOptions(temperature=0, repetition_penalty=1.7)
    penalised = adjust_logits(logits, options, history)  # the definition: a [rows, vocab] mask
    assert penalised[0, 0] != logits[0, 0] and penalised[1, 0] != logits[1, 0] and penalised[2, 0] == logits[2, 0]
    step = sampler.step_options((options,) * 3, 20, logits.device)
    assert torch.equal(sampler.adjusted(logits, step, history, None), penalised)
    assert torch.equal(choose(logits, [options] * 3, history=history), penalised.max(dim=-1).indices)
    assert torch.equal(choose_next(logits, options, history), penalised.max(dim=-1).indices)
    nothing_yet = torch.full((1, 3), -1)
    assert torch.equal(sampler.adjusted(logits[:1], step, nothing_yet, None), logits[:1])


def test_the_history_grows_with_each_step():
    history = TokenHistory(2, 6, torch.device("cpu"))
    history.reset(0, [1, 2])
    history.reset(1, [0])
    history.append(torch.tensor([0, 1]), torch.tensor([2, 1]), torch.tensor([7, 3]))
    history.write(1, 2, [4, 4])
    assert history.ids.tolist() == [[1, 2, 7, -1, -1, -1], [0, 3, 4, 4, -1, -1]]


def test_distributions_are_each_rows_distribution_in_one_call():
    vocab = 40  # fewer than NUCLEUS_CANDIDATES: top-k 8 leaves its nucleus among them, top-k 40 does not
    logits = torch.randn(10, vocab, generator=torch.Generator().manual_seed(4)) * 3
    options = [SamplingOptions(temperature=0), SamplingOptions(temperature=0.8, top_p=0.9),
               SamplingOptions(temperature=1e-8, top_p=1.0), SamplingOptions(temperature=1.3, top_p=1.0, top_k=5),
               SamplingOptions(temperature=0.7, top_p=0.6, min_p=0.05),
               SamplingOptions(temperature=1.0, top_p=0.95, top_k=8, repetition_penalty=1.4),
               SamplingOptions(temperature=0, repetition_penalty=2.0), SamplingOptions(temperature=1.1, top_p=1.0),
               SamplingOptions(temperature=0.9, top_p=0.8, min_p=0.2, repetition_penalty=0.7),
               SamplingOptions(temperature=1.0, top_p=0.7, top_k=40)]
    history = torch.randint(0, vocab, (10, 6), generator=torch.Generator().manual_seed(5))
    history[:, 4:] = -1  # padding, as speculation pads
    ban = torch.zeros(10, vocab, dtype=torch.bool)
    ban[[1, 6, 8], logits[[1, 6, 8]].argmax(dim=-1)] = True  # each one's best token
    probs = sampler.distributions(logits, options, history, ban)
    for row, row_options in enumerate(options):
        expected = distribution(logits[row : row + 1], row_options, history[row : row + 1], ban[row : row + 1])
        torch.testing.assert_close(probs[row : row + 1], expected)
    assert torch.equal(probs[6].argmax(), choose_next(logits[6:7], options[6], history[6:7], ban[6:7])[0])
    assert len({int((row > 0).sum()) for row in probs}) > 3  # the cuts differ from row to row


def test_a_draw_takes_each_rows_token_with_its_own_generator():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0, 1.0]])
    generators = [torch.Generator().manual_seed(row) for row in range(3)]
    tokens = sampler.draw(probs, [0, 1], generators)
    uniform = [torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(row)) for row in range(2)]
    assert tokens.tolist() == [1 + int(uniform[0] >= 0.5), int(uniform[1] * 4)]
    assert sampler.draw(probs, [2, 0], torch.Generator().manual_seed(0)).tolist()[0] == 3
