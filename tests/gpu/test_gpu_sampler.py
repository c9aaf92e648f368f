"""The batched sampler on a GPU: a step's tensors all on the logits' device (a tensor made on the
CPU by mistake fails only here: the CPU suite cannot see it, and the meta device lets CPU values
into index_put), each row with its own generator (the GPU's, or the host's as the engine's are), and the draws still following the
distribution sampling.py defines, on both of top-p's paths (its candidates, the full sort)."""

import pytest
import torch

from llama_tp.sampling.sampler import sample
from llama_tp.sampling import SamplingOptions, distribution
from test_sampler import FLAT, SHARP, SAMPLES, chi_square_p_value, four_candidates  # noqa: F401 (a fixture)

CUDA = torch.device("cuda")
GREEDY = SamplingOptions(temperature=0)
NUCLEUS = SamplingOptions(temperature=0.8, top_p=0.9)
WHOLE = SamplingOptions(temperature=0.7, top_p=1.0)
CUT = SamplingOptions(temperature=1.0, top_p=0.95, top_k=6, min_p=0.05)


@pytest.mark.parametrize("options", [NUCLEUS, WHOLE, CUT], ids=["top-p", "no cut", "top-k, min-p, top-p"])
@pytest.mark.parametrize("logits", [SHARP, FLAT], ids=["held by the candidates", "full sort"])
def test_draws_on_the_gpu_follow_the_defined_distribution(four_candidates, logits, options):
    # A greedy row in every other place: the step's greedy and sampled rows are written into one
    # tensor on the device.
    rows = [GREEDY if row % 2 else options for row in range(2 * SAMPLES)]
    draw = sample(logits.to(CUDA).repeat(len(rows), 1), rows, torch.Generator(CUDA).manual_seed(0))
    tokens = draw.settle()
    assert tokens.device.type == "cuda"
    assert (tokens[1::2] == logits.argmax()).all()
    expected = distribution(logits[None], options)[0]
    assert chi_square_p_value(tokens[0::2].cpu(), expected) > 1e-3
    if logits is FLAT and options is NUCLEUS:
        assert draw.unsettled[0::2].all()  # the full sort's path was taken, on the device


@pytest.mark.parametrize("where", ["cuda", "cpu"], ids=["the GPU's generators", "the host's (the engine's)"])
def test_each_row_draws_from_its_own_generator_whatever_shares_the_step(where):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)).to(CUDA)
    options = [GREEDY, NUCLEUS, SamplingOptions(temperature=1.2, top_k=5, top_p=1.0), CUT]

    def run(rows):
        generators = [torch.Generator(where).manual_seed(10 + row) for row in rows]
        return torch.stack([sample(logits[rows], [options[r] for r in rows], generators).settle()
                            for _ in range(30)])

    together = run([0, 1, 2, 3])
    for row in range(4):
        assert torch.equal(run([row])[:, 0], together[:, row])
