"""The model on one process: KV-cache decoding, Meta's generation semantics."""

import pytest
import torch

from llama_tp import Llama


@pytest.fixture(scope="module", params=["llama2", "llama3"])
def llama(request, checkpoints, tokenizer_path):
    return Llama.build(str(checkpoints[request.param, 1]), tokenizer_path, max_seq_len=64, max_batch_size=3)


def test_incremental_decoding_equals_one_full_forward(llama):
    tokens = torch.randint(0, 32000, (3, 20), generator=torch.Generator().manual_seed(1))
    full = llama.model.forward(tokens, 0)
    prefix = llama.model.forward(tokens[:, :7], 0)
    chunk = llama.model.forward(tokens[:, 7:12], 7)  # several tokens on top of a cache
    steps = [llama.model.forward(tokens[:, pos : pos + 1], pos) for pos in range(12, 20)]
    incremental = torch.cat([prefix, chunk, *steps], dim=1)
    assert full.shape == (3, 20, 32000) and full.dtype == torch.float32
    torch.testing.assert_close(incremental, full, atol=1e-5, rtol=1e-5)


def test_rows_anywhere_in_the_cache_at_their_own_positions_match_each_alone(llama):
    """Continuous batching's placement: rows prefilled into cache rows 2, 0 and 1 at different
    lengths, then decoded together, each at its own position (one token, then two at once),
    give each sequence's own full-forward logits."""
    tokens = torch.randint(0, 32000, (3, 16), generator=torch.Generator().manual_seed(2))
    full = [llama.model.forward(tokens[r : r + 1], 0)[0] for r in range(3)]
    lengths, slots = [9, 4, 12], [2, 0, 1]
    for row, (length, slot) in enumerate(zip(lengths, slots)):
        prefill = llama.model.forward(tokens[row : row + 1, :length], 0, slots=[slot])[0]
        torch.testing.assert_close(prefill, full[row][:length], atol=1e-5, rtol=1e-5)
    step = llama.model.forward(torch.stack([tokens[r, n : n + 1] for r, n in enumerate(lengths)]), lengths, slots=slots)
    for row, length in enumerate(lengths):
        torch.testing.assert_close(step[row, 0], full[row][length], atol=1e-5, rtol=1e-5)
    order = [1, 2, 0]  # the batch's rows in another order than before, two tokens each
    starts = [lengths[r] + 1 for r in order]
    chunk = llama.model.forward(torch.stack([tokens[r, n : n + 2] for r, n in zip(order, starts)]), starts,
                                slots=[slots[r] for r in order])
    for index, (row, start) in enumerate(zip(order, starts)):
        torch.testing.assert_close(chunk[index], full[row][start : start + 2], atol=1e-5, rtol=1e-5)


def test_a_row_decodes_to_the_same_bits_whatever_else_is_in_the_batch(checkpoints, tokenizer_path):
    """Where our CPU kernels take every product and the attention (the tiny Llama 2's heads are 16
    wide), a row's step is computed the same way alone or beside others: greedy answers cannot
    depend on the batch."""
    llama = Llama.build(str(checkpoints["llama2", 1]), tokenizer_path, max_seq_len=32, max_batch_size=3)
    if not llama.model.exact_steps:
        pytest.skip("our products and attention do not all run on this CPU: they need AVX-512")
    tokens = torch.randint(0, 32000, (3, 8), generator=torch.Generator().manual_seed(3))
    for row in range(3):
        llama.model.forward(tokens[row : row + 1, : 5 + row], 0, slots=[row])
    alone = llama.model.forward(tokens[1:2, 6:7], [6], slots=[1])
    together = llama.model.forward(torch.stack([tokens[0, 5:6], tokens[1, 6:7], tokens[2, 7:8]]), [5, 6, 7],
                                   slots=[0, 1, 2])
    assert torch.equal(together[1], alone[0])


def test_a_step_of_several_tokens_gives_each_the_bits_of_a_step_of_its_own(checkpoints, tokenizer_path):
    """Where our kernels run, feeding 4 tokens a row in one pass (guesses to verify) gives exactly
    the logits of 4 one-token steps: speculative decoding cannot change a greedy answer."""
    llama = Llama.build(str(checkpoints["llama2", 1]), tokenizer_path, max_seq_len=32, max_batch_size=2)
    if not llama.model.exact_steps:
        pytest.skip("our products and attention do not all run on this CPU: they need AVX-512")
    tokens = torch.randint(0, 32000, (2, 12), generator=torch.Generator().manual_seed(4))
    llama.model.forward(tokens[:, :5], 0)
    steps = torch.cat([llama.model.forward(tokens[:, pos : pos + 1], pos) for pos in range(5, 9)], dim=1)
    llama.model.forward(tokens[:, :5], 0)
    assert torch.equal(llama.model.forward(tokens[:, 5:9], 5), steps)
    llama.model.forward(tokens[:1, :7], 0, slots=[1])  # rows at different positions: 7 and 5
    ragged = llama.model.forward(torch.stack([tokens[1, 7:10], tokens[0, 5:8]]), [7, 5], slots=[1, 0])
    assert torch.equal(ragged[1], steps[0, :3])


def test_rows_that_do_not_fit_the_caches_are_refused(llama):
    with pytest.raises(ValueError, match=r"needs 2 start positions and 2 distinct cache rows, found \[0, 0\] and \[1, 1\]"):
        llama.model.forward(torch.zeros(2, 1, dtype=torch.long), 0, slots=[1, 1])
    with pytest.raises(ValueError, match=r"at cache rows \[3\], 1 tokens from positions \[0\], does not fit the caches \(3 x 64\)"):
        llama.model.forward(torch.zeros(1, 1, dtype=torch.long), 0, slots=[3])
    with pytest.raises(ValueError, match="does not fit the caches"):
        llama.model.forward(torch.zeros(2, 2, dtype=torch.long), [10, 63], slots=[0, 1])


def test_greedy_generation_extends_the_argmax_chain(llama):
    prompt = [1, 450, 4996, 17354]
    tokens, _ = llama.generate([prompt], max_gen_len=6, temperature=0)
    sequence = prompt + tokens[0]
    logits = llama.model.forward(torch.tensor([sequence[:-1]]), 0)[0]
    assert logits[len(prompt) - 1 :].argmax(-1).tolist() == tokens[0]


def test_ragged_batch_equals_each_prompt_alone(llama):
    prompts = [[1, 450], [1, 450, 4996, 17354, 1701], [1, 306, 4658]]
    batched, batched_logprobs = llama.generate(prompts, max_gen_len=5, temperature=0, logprobs=True)
    for prompt, tokens, logprobs in zip(prompts, batched, batched_logprobs):
        alone, alone_logprobs = llama.generate([prompt], max_gen_len=5, temperature=0, logprobs=True)
        assert alone[0] == tokens
        assert alone_logprobs[0] == pytest.approx(logprobs, abs=1e-4)


def test_more_prompts_than_the_batch_run_in_batches(llama):
    prompts = [[1, 100 + i] for i in range(7)]
    tokens, _ = llama.generate(prompts, max_gen_len=3, temperature=0)
    assert tokens == [llama.generate([p], max_gen_len=3, temperature=0)[0][0] for p in prompts]


def test_logprobs_and_echo(llama):
    prompt = [1, 450, 4996, 17354]
    tokens, logprobs = llama.generate([prompt], max_gen_len=4, temperature=0, logprobs=True, echo=True)
    sequence = tokens[0]
    assert sequence[:4] == prompt and len(sequence) == 8 and len(logprobs[0]) == 8
    log_softmax = torch.log_softmax(llama.model.forward(torch.tensor([sequence[:-1]]), 0)[0], dim=-1)
    expected = [0.0] + [log_softmax[i, sequence[i + 1]].item() for i in range(7)]
    assert logprobs[0] == pytest.approx(expected, abs=1e-4)


def test_generation_stops_at_a_stop_token_and_cuts_there(llama):
    prompt = [1, 450, 4996]
    free, _ = llama.generate([prompt], max_gen_len=6, temperature=0)
    stop = free[0][2]
    llama.tokenizer.stop_tokens = {stop}
    try:
        cut, _ = llama.generate([prompt], max_gen_len=6, temperature=0)
    finally:
        llama.tokenizer.stop_tokens = {llama.tokenizer.eos_id}
    assert cut[0] == free[0][: free[0].index(stop)]


def test_sampling_is_reproducible_from_the_seed(llama):
    torch.manual_seed(5)
    first, _ = llama.generate([[1, 450]], max_gen_len=8, temperature=1.0, top_p=0.95)
    torch.manual_seed(5)
    second, _ = llama.generate([[1, 450]], max_gen_len=8, temperature=1.0, top_p=0.95)
    assert first == second


def test_text_and_chat_completion_shapes(llama):
    texts = llama.text_completion(["Hello", "The capital of France is"], max_gen_len=4, temperature=0, logprobs=True)
    assert [sorted(t) for t in texts] == [["generation", "logprobs", "tokens"]] * 2
    assert len(texts[0]["tokens"]) == len(texts[0]["logprobs"]) <= 4
    chats = llama.chat_completion(
        [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "say [INST]"}]], max_gen_len=4
    )
    assert chats[0]["generation"]["role"] == "assistant" and isinstance(chats[0]["generation"]["content"], str)
    assert chats[1]["generation"]["content"] == "Error: special tags are not allowed as part of the prompt."


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"prompt_tokens": [[1] * 65], "max_gen_len": 4}, "65 tokens but max_seq_len is 64"),
        ({"prompt_tokens": [[]], "max_gen_len": 4}, "prompt 0 is empty"),
        ({"prompt_tokens": [[1, 40000]], "max_gen_len": 4}, "token id outside"),
        ({"prompt_tokens": [[1]], "max_gen_len": 0}, "max_gen_len must be a positive"),
        ({"prompt_tokens": [[1]], "max_gen_len": 4, "temperature": -1}, "temperature must be"),
        ({"prompt_tokens": [[1]], "max_gen_len": 4, "top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"prompt_tokens": [[1]], "max_gen_len": 4, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_generation_arguments_are_clear_errors(llama, kwargs, words):
    with pytest.raises(ValueError, match=words):
        llama.generate(**kwargs)
