"""One pass over several batches (Transformer.forward_segments): generating rows and prompt chunks
share the products, each attends on its own, and every row's logits and cache equal its own pass's;
the engine takes in prompts in the pass that decodes the other rows."""

import pytest
import torch

from job_answers import greedy_answers
from llama_tp import Llama
from llama_tp.engine import Engine
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint

VOCAB = 32000


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Llama:
    directory = tmp_path_factory.mktemp("tiny")
    write_checkpoint(directory, TINY_LLAMA2, full_weights(TINY_LLAMA2, VOCAB), 1, "dim")
    return Llama.build(str(directory), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=5, dtype="fp32")


def random_tokens(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape, generator=generator)


def test_a_mixed_pass_gives_each_batch_its_own_passs_logits_and_cache(llama):
    model = llama.model
    generator = torch.Generator().manual_seed(0)
    # cache rows 0-2 generate at positions 7, 12 and 3; row 3 starts a prompt; row 4 continues one from 5
    for slot, held in ((0, 7), (1, 12), (2, 3), (4, 5)):
        model.forward(random_tokens(generator, 1, held), 0, slots=[slot])
    decode = (random_tokens(generator, 3, 1), [7, 12, 3], [0, 1, 2])
    prompt = (random_tokens(generator, 1, 9), [0], [3])
    continued = (random_tokens(generator, 1, 4), [5], [4])
    batches = [prompt, decode, continued]
    before = [(layer.attention.cache.k.clone(), layer.attention.cache.v.clone()) for layer in model.layers]

    alone = [model.forward(tokens, starts, last_only=True, slots=slots)[:, -1] for tokens, starts, slots in batches]
    caches_alone = [(layer.attention.cache.k.clone(), layer.attention.cache.v.clone()) for layer in model.layers]
    for layer, (keys, values) in zip(model.layers, before):
        layer.attention.cache.k.copy_(keys)
        layer.attention.cache.v.copy_(values)

    mixed = model.forward_segments(batches)
    assert mixed.shape == (5, 1, VOCAB)  # the last token of every row: the prompt, 3 generating rows, the continued prompt
    torch.testing.assert_close(mixed[:, -1], torch.cat(alone), rtol=1e-5, atol=1e-5)
    for layer, (keys, values) in zip(model.layers, caches_alone):
        torch.testing.assert_close(layer.attention.cache.k, keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.attention.cache.v, values, rtol=1e-5, atol=1e-5)


def test_a_mixed_pass_can_give_vocabulary_slices(llama):
    generator = torch.Generator().manual_seed(1)
    batches = [(random_tokens(generator, 1, 6), [0], [0]), (random_tokens(generator, 1, 3), [0], [1])]
    whole = llama.model.forward_segments(batches)
    sliced = llama.model.forward_segments(batches, vocab_slice=True)  # one rank: its slice is all of it
    torch.testing.assert_close(sliced, whole)


def test_the_engine_takes_in_prompts_in_the_pass_that_decodes_the_others(llama, monkeypatch):
    """Each step of a batch job is one pass of the model, prompts and generating rows together,
    and every answer is the prompt's alone. Answers of different lengths free rows at different
    steps, so later prompts arrive while other rows generate."""
    generator = torch.Generator().manual_seed(2)
    prompts = [random_tokens(generator, length).tolist() for length in (3, 17, 5, 30, 8, 2, 11, 6)]
    lengths = [4, 9, 2, 12, 6, 3, 10, 5]
    alone = [llama.generate([prompt], max_gen_len=length, temperature=0)[0][0] for prompt, length in zip(prompts, lengths)]

    passes_per_step, mixed_batches = [], []
    model = llama.model
    forward, forward_segments, step = model.forward, model.forward_segments, Engine.step

    def counted_forward(*args, **kwargs):
        passes_per_step[-1] += 1
        return forward(*args, **kwargs)

    def counted_segments(batches, **kwargs):
        passes_per_step[-1] += 1
        mixed_batches.append([tuple(tokens.shape) for tokens, _, _ in batches])
        return forward_segments(batches, **kwargs)

    def counted_step(engine):
        passes_per_step.append(0)
        return step(engine)

    monkeypatch.setattr(model, "forward", counted_forward)
    monkeypatch.setattr(model, "forward_segments", counted_segments)
    monkeypatch.setattr(Engine, "step", counted_step)
    model.prefix_cache.forget()
    assert greedy_answers(llama.engine(512), prompts, lengths) == alone
    assert set(passes_per_step) == {1}
    # some pass took a prompt in beside generating rows: a batch of one-token rows and a prompt's chunk
    assert any(any(width == 1 for _, width in shapes) and any(width > 1 for _, width in shapes)
               for shapes in mixed_batches)
