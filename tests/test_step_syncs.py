"""A serving step, a step of generate's batch of ragged prompts and a round of speculation read back
from the device once for all their rows (tokens, log probabilities and the likeliest alternatives
together): the host waits on the device once a step (issue 31, item 9). generate runs the engine's
steps, as the server does. Counted on CPU through a TorchFunctionMode that sees every read-back a
Tensor method does."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from llama_tp import Llama
from llama_tp.engine import Admission, run_job
from serve_harness import request
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

# Every Tensor method that copies device data to the host, or waits for it to decide.
READ_BACKS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
              torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class CountReadBacks(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READ_BACKS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Llama:
    directory = tmp_path_factory.mktemp("tiny")
    write_checkpoint(directory, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")
    return Llama.build(str(directory), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=4)


def decode_step_read_backs(llama: Llama, requests) -> list[str]:
    """Admit requests, prefill them, then count the read-backs of one decoding step of them all."""
    engine = llama.engine(max_prefill_tokens=64)
    for slot, each in enumerate(requests):
        engine.admit(Admission(each, slot, 7 + slot))
    while any(len(s.pending) > 1 for s in engine.scheduler.running):
        engine.step()
    assert len(engine.scheduler.plan().decode) == len(requests)
    with CountReadBacks() as counter:
        engine.step()
    return counter.calls


PROMPTS = [[1, 450, 4996, 17354], [1, 306, 4658], [1, 3869, 526, 29871, 13], [1, 15043]]


def test_a_sampled_step_with_every_option_reads_back_once(llama):
    # The tiny random model's distributions are flat: top-k keeps each nucleus within the candidates.
    requests = [request(llama, PROMPTS[0], 8, temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1),
                request(llama, PROMPTS[1], 8, temperature=0, logprobs=True, top_logprobs=3),
                request(llama, PROMPTS[2], 8, temperature=1.2, top_k=20, min_gen_len=4, logprobs=True),
                request(llama, PROMPTS[3], 8, temperature=0.7, top_p=1.0, seed=3)]
    assert decode_step_read_backs(llama, requests) == ["tolist"]


def test_a_greedy_step_reads_back_once(llama):
    requests = [request(llama, prompt, 8, temperature=0) for prompt in PROMPTS]
    assert decode_step_read_backs(llama, requests) == ["tolist"]


def test_a_nucleus_wider_than_the_candidates_costs_a_second_read_back_unless_our_kernel_samples(llama, sampler_path):
    """The tiny model's flat distribution puts 0.9 of the mass far beyond the 256 best tokens:
    torch's ops (every device but a CPU with our kernels) sort those rows in full after the
    step's read-back; our kernel settles every row before it."""
    requests = [request(llama, prompt, 8, temperature=0.8, top_p=0.9) for prompt in PROMPTS]
    expected = ["tolist"] if sampler_path == "our kernel" else ["tolist", "tolist"]
    assert decode_step_read_backs(llama, requests) == expected


@pytest.mark.parametrize("options", [dict(temperature=0), dict(temperature=0, logprobs=True),
                                     dict(temperature=0.8, top_k=50, repetition_penalty=1.2, min_gen_len=3, seed=1)],
                         ids=["greedy", "greedy with logprobs", "sampled"])
def test_a_step_of_generates_batch_reads_back_once(llama, options):
    """Ragged prompts: the step that takes them all in, and every step after, read back once."""
    logprobs = options.pop("logprobs", False)
    steps = run_job(llama.engine(), [(request(llama, prompt, 6, logprobs=logprobs, **options), 7) for prompt in PROMPTS])
    counts = []
    while True:
        with CountReadBacks() as counter:
            if next(steps, None) is None:
                break
        counts.append(counter.calls)
    assert len(counts) == 6
    assert counts == [["tolist"]] * len(counts)


@pytest.fixture(scope="module")
def speculating(llama, tmp_path_factory) -> Llama:
    directory = tmp_path_factory.mktemp("tiny-lookup")
    write_checkpoint(directory, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")
    return Llama.build(str(directory), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=4, speculate="lookup")


@pytest.mark.parametrize("options", [dict(temperature=0), dict(temperature=0, repetition_penalty=1.2),
                                     dict(temperature=0.8, top_k=50, seed=1)], ids=["greedy", "penalty", "sampled"])
def test_a_round_of_speculation_reads_back_once_for_every_row(speculating, options):
    from llama_tp.engine.speculative import Row

    model, chosen = speculating.model, speculating.sampling_options(**options)
    prompts = [prompt * 2 for prompt in PROMPTS]  # something for prompt lookup to copy
    generator = chosen.generator(model.rotary.device)
    for slot, prompt in enumerate(prompts):  # the target's caches hold all but each row's last token
        model.forward(torch.tensor([prompt[:-1]]), 0, slots=[slot])
        model.prefix_cache.extend(slot, 0, prompt[:-1])
    rows = [Row(slot, prompt, chosen, generator, len(prompt), [2], 10) for slot, prompt in enumerate(prompts)]
    with CountReadBacks() as counter:
        outcomes = speculating.speculator.round(model, rows)
    assert counter.calls == ["tolist"] and all(outcome.tokens for outcome in outcomes)


@pytest.fixture(scope="module")
def drafting(tmp_path_factory) -> Llama:
    directory = tmp_path_factory.mktemp("tiny-draft")
    write_checkpoint(directory, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")
    return Llama.build(str(directory), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=4, speculate="draft",
                       draft_quantize="int8", speculate_k=3)


def test_a_round_with_a_draft_reads_back_once_a_guess_and_once_for_the_verdicts(drafting):
    """Rows with their own options and generators: each of the draft's steps draws every row's
    guess in one call, and the target's verdicts come in one more."""
    from llama_tp.engine.speculative import Row

    model = drafting.model
    options = [dict(temperature=0), dict(temperature=0.8, top_k=50, repetition_penalty=1.2, seed=1),
               dict(temperature=1.1, top_p=1.0, min_gen_len=5, seed=2), dict(temperature=0.7, top_k=20)]
    rows = []
    for slot, (prompt, chosen) in enumerate(zip(PROMPTS, options)):
        model.forward(torch.tensor([prompt[:-1]]), 0, slots=[slot])
        model.prefix_cache.extend(slot, 0, prompt[:-1])
        chosen = drafting.sampling_options(**chosen)
        rows.append(Row(slot, prompt, chosen, chosen.generator(model.rotary.device), len(prompt), [2], 10))
    with CountReadBacks() as counter:
        outcomes = drafting.speculator.round(model, rows)
    assert counter.calls == ["tolist"] * (3 + 1) and all(outcome.tokens for outcome in outcomes)


def test_a_speculating_step_with_log_probabilities_reads_back_twice_for_every_row(speculating):
    """The round's tokens once, then every gained token's log probability and alternatives once."""
    requests = [request(speculating, prompt * 2, 8, temperature=0, logprobs=True, top_logprobs=2) for prompt in PROMPTS]
    assert decode_step_read_backs(speculating, requests) == ["tolist", "tolist"]


def test_a_rounds_log_probabilities_are_each_gained_tokens_under_the_logits_that_chose_it(llama):
    from llama_tp.engine.speculative import Outcome
    from llama_tp.engine.step import round_extras

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    outcomes = [Outcome([4, 1], logits[:2]), Outcome([9], logits[2:3]), Outcome([7], logits[3:])]
    requests = [request(llama, PROMPTS[0], 8, logprobs=True, top_logprobs=3), request(llama, PROMPTS[1], 8),
                request(llama, PROMPTS[2], 8, logprobs=True)]
    first, second, third = [None if gained is None else [logprob for logprob, _ in gained]
                            for gained in round_extras(requests, [None] * 3, outcomes)]
    expected = torch.log_softmax(logits.double(), dim=-1)
    assert second is None
    assert [entry.token for entry in first] == [4, 1] and [entry.token for entry in third] == [7]
    for entry, row in zip(first + third, (0, 1, 3)):
        assert entry.logprob == pytest.approx(expected[row, entry.token].item(), abs=1e-6)
    values, ids = expected[1].topk(3)
    assert [i for i, _ in first[1].top] == ids.tolist()
    assert [v for _, v in first[1].top] == pytest.approx(values.tolist(), abs=1e-6)
    assert third[0].top == ()  # it asked for no alternatives
