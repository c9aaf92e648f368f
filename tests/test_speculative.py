"""Speculative decoding through the API and the serving engine: greedy tokens exactly as without it
(ragged batches, streams, every option), rows that accept different numbers of guesses, seeded
sampling that repeats and follows the target's distribution, and mistakes refused by name."""

import itertools

import pytest
import torch

from distributed import run_world
from llama_tp import Llama
from llama_tp.engine.speculative import check_speculation
from llama_tp.sampling import SamplingOptions, distribution
from serve_harness import Harness, request, tokens_of
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, successor_weights, write_checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

# Ragged: Meta's schedule starts from the shortest, the others feed their own tokens meanwhile.
PROMPTS = [[1, 450, 4996, 17354, 1701, 306, 4658, 29892, 920], [1, 450], [1, 306, 4658],
           [1, 18637, 29892, 920, 29871, 13] * 3]
SPECULATIONS = {
    "lookup": dict(speculate="lookup"),
    "int8 copy": dict(speculate="draft", draft_quantize="int8"),
    "int4 copy": dict(speculate="draft", draft_quantize="int4"),
    "other model": dict(speculate="draft"),  # draft_ckpt_dir: the perturbed checkpoint
}


@pytest.fixture(scope="module")
def folders(checkpoints, tmp_path_factory) -> dict[str, str]:
    """The tiny Llama 2 and Llama 3 (whose 8-wide heads attend through torch, not our kernel), and
    a draft for the Llama 2 that agrees with it only in part: its weights, perturbed."""
    target = full_weights(TINY_LLAMA2, 32000)
    noise = full_weights(TINY_LLAMA2, 32000, seed=1)
    perturbed = {name: (weight.float() + 0.05 * noise[name].float()).to(weight.dtype)
                 for name, weight in target.items()}
    draft = write_checkpoint(tmp_path_factory.mktemp("draft"), TINY_LLAMA2, perturbed, 1, "dim")
    return {"llama2": str(checkpoints["llama2", 1]), "llama3": str(checkpoints["llama3", 1]), "draft": str(draft)}


def build(folders: dict[str, str], family: str, speculation: str = "", max_batch_size: int = 4, **options) -> Llama:
    if speculation:
        options |= SPECULATIONS[speculation]
        if speculation == "other model":
            options["draft_ckpt_dir"] = folders["draft"]
    return Llama.build(folders[family], str(LLAMA2_TOKENIZER), max_seq_len=96, max_batch_size=max_batch_size,
                       **options)


@pytest.fixture(scope="module")
def plain(folders) -> dict[str, Llama]:
    return {family: build(folders, family) for family in ("llama2", "llama3")}


@pytest.fixture(scope="module")
def speculating(folders) -> dict[tuple[str, str], Llama]:
    return {(family, speculation): build(folders, family, speculation)
            for family, speculation in itertools.product(("llama2", "llama3"), SPECULATIONS)
            if family == "llama2" or speculation != "other model"}


@pytest.mark.parametrize("family, speculation", [("llama2", s) for s in SPECULATIONS] + [("llama3", "lookup"),
                                                                                        ("llama3", "int8 copy")])
def test_greedy_tokens_and_logprobs_are_those_of_plain_decoding(plain, speculating, family, speculation):
    """A ragged batch, greedy: the same tokens, and the same log probabilities (prompts' too, with echo)."""
    llama, expected = speculating[family, speculation], plain[family]
    tokens, _ = llama.generate(PROMPTS, max_gen_len=30, temperature=0)
    assert tokens == expected.generate(PROMPTS, max_gen_len=30, temperature=0)[0]
    echoed, logprobs = llama.generate(PROMPTS, max_gen_len=12, temperature=0, logprobs=True, echo=True)
    expected_echoed, expected_logprobs = expected.generate(PROMPTS, max_gen_len=12, temperature=0, logprobs=True,
                                                           echo=True)
    assert echoed == expected_echoed
    for row, expected_row in zip(logprobs, expected_logprobs):
        assert row == pytest.approx(expected_row, abs=1e-5)
    if speculation != "lookup":  # a random model's text rarely repeats: test_lookup_guesses_... covers lookup's
        assert llama.speculator.stats.accepted > 0


@pytest.mark.parametrize("speculation", list(SPECULATIONS))
def test_every_option_and_the_streams_give_what_plain_decoding_gives(plain, speculating, speculation):
    """Greedy with a repetition penalty, a minimum length, stop tokens and strings and top
    candidates (the per-row path: logits gathered, each position's options applied), and a stream."""
    llama, expected = speculating["llama2", speculation], plain["llama2"]
    if speculation != "lookup" and not llama.model.exact_steps:
        pytest.skip("bit for bit only where our kernels take every product: elsewhere a draft's verifying pass may "
                    "round a near-tie of this random model differently from a one-token step (docs/speculative.md)")
    free = expected.generate(PROMPTS[:2], max_gen_len=20, temperature=0)[0]
    options = dict(temperature=0, repetition_penalty=1.3, min_gen_len=4, max_gen_len=20,
                   stop=[expected.tokenizer.decode(free[1][8:10])], show_top=2, token_ids=True)
    texts = ["The quick brown fox", "Über den Wolken"]
    for tokenizer in (llama.tokenizer, expected.tokenizer):
        tokenizer.stop_tokens = {free[0][6]}  # a token the first row meets before its end
    try:
        assert llama.text_completion(texts, **options) == expected.text_completion(texts, **options)
        cut = llama.generate(PROMPTS[:2], max_gen_len=20, temperature=0)[0]
        assert cut == expected.generate(PROMPTS[:2], max_gen_len=20, temperature=0)[0] and len(cut[0]) == 6
    finally:
        for tokenizer in (llama.tokenizer, expected.tokenizer):
            tokenizer.stop_tokens = {tokenizer.eos_id}
    stream = llama.stream_text_completion(texts[0], temperature=0, max_gen_len=25)
    pieces = list(stream)
    expected_stream = expected.stream_text_completion(texts[0], temperature=0, max_gen_len=25)
    assert "".join(pieces) == "".join(expected_stream) == stream.text
    assert stream.tokens == expected_stream.tokens


@pytest.fixture(scope="module")
def successors(tmp_path_factory) -> dict[str, str]:
    """A target whose greedy choice after t is t + 1 (for t in 100..159), and a draft that agrees
    but after 110 (it guesses 200) and 125 (201)."""
    root = tmp_path_factory.mktemp("successors")
    chain = {t: t + 1 for t in range(100, 160)}
    target = write_checkpoint(root / "target", TINY_LLAMA2, successor_weights(TINY_LLAMA2, 32000, chain), 1, "dim")
    wrong = chain | {110: 200, 125: 201}
    draft = write_checkpoint(root / "draft", TINY_LLAMA2, successor_weights(TINY_LLAMA2, 32000, wrong), 1, "dim")
    return {"target": str(target), "draft": str(draft)}


def test_rows_of_a_batch_accept_different_numbers_of_guesses(successors):
    """From 101 the draft's 6 guesses (102..107) are all right; from 108 two are (109, 110),
    then it says 200 where the target says 111; each row gets the target's chain all the same."""
    llama = Llama.build(successors["target"], str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=2,
                        speculate="draft", speculate_k=6, draft_ckpt_dir=successors["draft"])
    round_, outcomes = llama.speculator.round, []

    def noting(*args, **kwargs):
        result = round_(*args, **kwargs)
        outcomes.append([o.tokens for o in result])
        return result

    llama.speculator.round = noting
    tokens, _ = llama.generate([[1, 100], [1, 107]], max_gen_len=20, temperature=0)
    assert tokens == [list(range(101, 121)), list(range(108, 128))]
    assert outcomes[0] == [list(range(102, 109)), [109, 110, 111]]  # 6 accepted and a bonus; 2 and the target's own
    stats = llama.speculator.stats
    assert stats.proposed > stats.accepted > 0 and stats.tokens == 2 * 19


@pytest.fixture(scope="module")
def cycle(tmp_path_factory) -> str:
    """A target whose greedy text goes round 100, 101, ..., 110, 100, ...: its answer repeats its
    prompt, so prompt lookup's guesses are right."""
    chain = {t: t + 1 for t in range(100, 110)} | {110: 100}
    folder = tmp_path_factory.mktemp("cycle")
    return str(write_checkpoint(folder, TINY_LLAMA2, successor_weights(TINY_LLAMA2, 32000, chain), 1, "dim"))


def test_lookup_guesses_that_the_target_accepts_give_plain_decodings_tokens(cycle):
    """Ragged rows whose answers copy their prompts: lookup guesses, the target accepts most
    guesses, and the tokens and log probabilities are plain decoding's, through the API and the
    serving engine."""
    prompts = [[1, *range(100, 111)], [1, 105, 106, 107, 108, 109, 110, 100, 101]]
    plain = Llama.build(cycle, str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=2)
    llama = Llama.build(cycle, str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=2, speculate="lookup")
    expected, expected_logprobs = plain.generate(prompts, max_gen_len=24, temperature=0, logprobs=True)
    assert expected == [[100 + (n % 11) for n in range(24)], [100 + ((n + 2) % 11) for n in range(24)]]
    tokens, logprobs = llama.generate(prompts, max_gen_len=24, temperature=0, logprobs=True)
    assert tokens == expected
    for row, expected_row in zip(logprobs, expected_logprobs):
        assert row == pytest.approx(expected_row, abs=1e-5)
    stats = llama.speculator.stats
    assert stats.accepted > stats.tokens // 2 and stats.proposed > 0
    accepted_by_the_api = stats.accepted
    harness = Harness(llama)
    try:
        streams = [harness.submit(request(llama, prompt, 24, temperature=0)) for prompt in prompts]
        assert [tokens_of(harness.deltas(stream)) for stream in streams] == expected
    finally:
        harness.close()
    assert llama.speculator.stats.accepted > accepted_by_the_api


def test_seeded_sampling_repeats(folders):
    llama = build(folders, "llama2", "other model")
    options = dict(temperature=1.0, top_p=0.95, max_gen_len=16)
    first = llama.generate(PROMPTS[:2], seed=5, **options)[0]
    assert first == llama.generate(PROMPTS[:2], seed=5, **options)[0]
    assert first != llama.generate(PROMPTS[:2], seed=6, **options)[0]
    assert llama.speculator.stats.accepted > 0


# Chi-square's 99.9% quantile with 26 degrees of freedom (27 sequences of 3 tokens, top_k=3).
CHI_SQUARE_26_DOF_999 = 54.05


@pytest.mark.slow  # 2400 samples on tiny models: about 10 s
def test_speculative_sampling_follows_the_target_not_the_draft(folders):
    """The first 3 tokens after a prompt, sampled (temperature 1, top_k 3) with a draft that
    agrees only in part: their 27 possible sequences come as often as the target's own
    distribution says (chi-square at 99.9%), far from the draft's."""
    llama = build(folders, "llama2", "other model", max_batch_size=16)
    options = dict(temperature=1.0, top_k=3, top_p=1.0)
    counts: dict[tuple, int] = {}
    for seed in range(150):  # 16 samples a call; the second token comes from a round's guess
        for row in llama.generate([PROMPTS[1]] * 16, max_gen_len=3, seed=seed, **options)[0]:
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    target, draft = joint(llama.model, PROMPTS[1], options), joint(llama.speculator.draft.model, PROMPTS[1], options)
    assert len(target) == 27 and set(counts) <= set(target)
    assert chi_square(counts, target) < CHI_SQUARE_26_DOF_999
    assert chi_square(counts, draft) > 10 * CHI_SQUARE_26_DOF_999
    assert 0.2 < llama.speculator.stats.acceptance_rate < 0.95


def joint(model, prompt: list[int], options: dict) -> dict[tuple, float]:
    """The probability of each sequence of 3 tokens after prompt, under model's sampling distribution."""
    options = SamplingOptions(**options)
    probabilities = {(): 1.0}
    for _ in range(3):
        longer = {}
        for sequence, probability in probabilities.items():
            logits = model.forward(torch.tensor([prompt + list(sequence)]), 0, slots=[0])[0, -1:]
            for token, p in enumerate(distribution(logits, options)[0].tolist()):
                if p > 0:
                    longer[sequence + (token,)] = probability * p
        probabilities = longer
    return probabilities


def chi_square(counts: dict[tuple, int], probabilities: dict[tuple, float]) -> float:
    """Pearson's statistic of counts against probabilities (an outcome they deem impossible: infinite)."""
    total = sum(counts.values())
    if any(key not in probabilities for key in counts):
        return float("inf")
    return sum((counts.get(key, 0) - total * p) ** 2 / (total * p) for key, p in probabilities.items())


def test_the_serving_engine_speculates_with_the_same_greedy_tokens(plain, speculating):
    """Requests at once on 4 rows, with a draft: each gets generate()'s tokens for its prompt
    alone, logprobs included; seeded sampling repeats."""
    llama, expected = speculating["llama2", "int8 copy"], plain["llama2"]
    prompts = PROMPTS + [[1, 15043] * 10, [1, 3869, 526]]
    harness = Harness(llama)
    try:
        streams = [harness.submit(request(llama, prompt, 14, temperature=0)) for prompt in prompts]
        answers = [tokens_of(harness.deltas(stream)) for stream in streams]
        deltas = harness.ask(request(llama, prompts[0], 8, temperature=0, logprobs=True, top_logprobs=2))
        sampled = [tokens_of(harness.ask(request(llama, prompts[1], 12, temperature=1.0, top_p=0.95, seed=3)))
                   for _ in range(2)]
    finally:
        harness.close()
    for prompt, answer in zip(prompts, answers):
        assert answer == expected.generate([prompt], max_gen_len=14, temperature=0)[0][0]
    tokens, logprobs = expected.generate([prompts[0]], max_gen_len=8, temperature=0, logprobs=True)
    assert [lp.token for d in deltas for lp in d.logprobs] == tokens[0]
    assert [lp.logprob for d in deltas for lp in d.logprobs] == pytest.approx(logprobs[0], abs=1e-5)
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize("options, words", [
    (dict(draft_quantize="int8"), r"draft_quantize='int8' is given without speculation; add speculate='draft'"),
    (dict(speculate_k=4), r"speculate_k=4 is given without speculation"),
    (dict(speculate="draft"), r"speculate='draft' needs a draft: draft_quantize='int8'"),
    (dict(speculate="medusa"), r"speculate='medusa' is not supported; use 'draft'"),
    (dict(speculate="lookup", draft_quantize="int8"), r"speculate='lookup' does not use"),
    (dict(speculate="draft", draft_quantize="int4x"), r"draft_quantize='int4x' is not supported; use one of int8, int4"),
    (dict(speculate="lookup", speculate_k=16), r"speculate_k must be a whole number of guesses from 1 to 15, "
                                               r"found 16"),
    (dict(speculate="lookup", speculate_k=0), r"from 1 to 15, found 0"),
    (dict(speculate="lookup", compile=True), r"speculate='lookup' has no draft"),
    (dict(speculate="draft", draft_ckpt_dir="/nonexistent/draft"), r"draft_ckpt_dir /nonexistent/draft does not "),
])
def test_mistakes_are_refused_by_name(folders, options, words):
    with pytest.raises((ValueError, FileNotFoundError), match=words):
        build(folders, "llama2", **options)


def test_prompt_lookup_compiles_where_the_targets_steps_compile_whole():
    """compile=True with prompt lookup compiles nothing on a CPU (refused above); where the target's
    steps run whole (CUDA graphs), it compiles the target's verifying step, and is taken."""
    check_speculation("lookup", 4, None, None, compile=True, compiles_target=True)
    with pytest.raises(ValueError, match=r"here \(no CUDA graphs\) the target's passes run eagerly"):
        check_speculation("lookup", 4, None, None, compile=True, compiles_target=False)


def test_a_draft_with_another_vocabulary_is_refused(folders, tmp_path):
    params = TINY_LLAMA2 | {"vocab_size": 512}
    other = write_checkpoint(tmp_path / "other", params, full_weights(params, 512), 1, "dim")
    with pytest.raises(ValueError, match=r"the draft model in .*other does not fit the target, whose tokenizer has "
                                         r"32000 tokens: its params.json says vocab_size 512"):
        build(folders, "llama2", speculate="draft", draft_ckpt_dir=str(other))


def _speculate_on_two_ranks(checkpoint: str, draft: str) -> dict[str, list]:
    """Greedy and seeded sampled tokens with prompt lookup and with an int8 draft, and the serving
    engine's greedy answers, at this world size."""
    results = {}
    for name, options in (("lookup", dict(speculate="lookup")),
                          ("int8 copy", dict(speculate="draft", draft_quantize="int8")),
                          ("other model", dict(speculate="draft", draft_ckpt_dir=draft))):
        llama = Llama.build(checkpoint, str(LLAMA2_TOKENIZER), max_seq_len=96, max_batch_size=4, **options)
        greedy = llama.generate(PROMPTS, max_gen_len=24, temperature=0)[0]
        sampled = llama.generate(PROMPTS, max_gen_len=24, temperature=0.8, top_p=0.9, seed=3)[0]
        results[name] = (greedy, sampled)
    if torch.distributed.get_rank() == 0:
        harness = Harness(llama, start=False)
        streams = [harness.submit(request(llama, prompt, 10, temperature=0)) for prompt in PROMPTS]
        harness.thread.start()
        results["engine"] = [tokens_of(harness.deltas(stream)) for stream in streams]
        harness.close()
    else:
        from llama_tp.serve.server import engine_loop  # the other ranks have no mailbox

        engine_loop(llama, 16, None).run(lambda: False)  # ends when rank 0 stops
    return results


@pytest.mark.slow
def test_two_ranks_speculate_as_one_process_does(checkpoints, folders, plain, speculating):
    per_rank = run_world(2, _speculate_on_two_ranks, str(checkpoints["llama2", 2]), folders["draft"])
    expected = plain["llama2"].generate(PROMPTS, max_gen_len=24, temperature=0)[0]
    for name in ("lookup", "int8 copy", "other model"):
        sampling = dict(max_gen_len=24, temperature=0.8, top_p=0.9, seed=3)
        one_process = speculating["llama2", name].generate(PROMPTS, **sampling)[0]
        for rank, results in enumerate(per_rank):
            greedy, sampled = results[name]
            assert greedy == expected, (name, rank)
            assert sampled == one_process == per_rank[0][name][1], (name, rank)
    alone = [plain["llama2"].generate([prompt], max_gen_len=10, temperature=0)[0][0] for prompt in PROMPTS]
    assert per_rank[0]["engine"] == alone
