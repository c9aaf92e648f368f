"""Property-based tests: dialogs, tokenizer round trips, top-p sampling and batched generation
over inputs hypothesis makes up, with the real Llama 2 tokenizer."""

from typing import Iterator

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llama_tp import Llama
from llama_tp.text.chat_format import Llama2ChatFormat
from llama_tp.sampling import next_token, sample_top_p
from llama_tp.text.tokenizer import Tokenizer
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint

MAX_SEQ_LEN = 32
MAX_BATCH_SIZE = 3  # below the largest batch drawn, so generate's splitting into batches is covered
# No example database: hypothesis would write one into the project folder.
QUICK = dict(deadline=None, database=None)
# Fixtures are built once; hypothesis would otherwise warn that they are not reset per example.
FIXTURE_OK = dict(QUICK, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Any Unicode text, including control characters, emoji and the chat format's own tags.
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["", " ", "\n\n", "[INST]", "<<SYS>>", "<s>", "</s>", " [/INST] ", "x" * 300]
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(str(LLAMA2_TOKENIZER))


@pytest.fixture(scope="module")
def generator(tmp_path_factory) -> Iterator[Llama]:
    ckpt = write_checkpoint(tmp_path_factory.mktemp("props") / "ckpt", TINY_LLAMA2,
                            full_weights(TINY_LLAMA2, 32000), 1, "dim")
    # A tiny model decodes ten times faster on one thread than on two cores shared with others.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield Llama.build(str(ckpt), str(LLAMA2_TOKENIZER), MAX_SEQ_LEN, MAX_BATCH_SIZE)
    finally:
        torch.set_num_threads(threads)


# --- tokenizer ----------------------------------------------------------------------------------

@settings(max_examples=60, **FIXTURE_OK)
@given(text=texts)
def test_tokenizer_round_trips_any_text(tokenizer: Tokenizer, text: str):
    ids = tokenizer.encode(text, bos=True, eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert all(0 <= i < tokenizer.n_words for i in ids)
    assert tokenizer.decode(ids[1:-1]) == text


@settings(max_examples=20, **FIXTURE_OK)
@given(before=texts, surrogate=st.characters(whitelist_categories=("Cs",)), after=texts)
def test_tokenizer_rejects_lone_surrogates_clearly(tokenizer: Tokenizer, before: str, surrogate: str, after: str):
    with pytest.raises(ValueError, match="not valid Unicode"):
        tokenizer.encode(before + surrogate + after, bos=True, eos=False)


# --- dialogs ------------------------------------------------------------------------------------

def message(role: str) -> st.SearchStrategy:
    return st.builds(lambda content: {"role": role, "content": content}, texts)


@st.composite
def valid_dialogs(draw) -> list[dict]:
    turns = draw(st.integers(0, 3))  # completed user/assistant exchanges before the last question
    dialog = [draw(message("system"))] if draw(st.booleans()) else []
    for _ in range(turns):
        dialog += [draw(message("user")), draw(message("assistant"))]
    return dialog + [draw(message("user"))]


@settings(max_examples=40, **FIXTURE_OK)
@given(dialog=valid_dialogs())
def test_dialog_prompt_is_meta_format(tokenizer: Tokenizer, dialog: list[dict]):
    """One bos-led segment per user turn: '[INST] question [/INST] answer ' eos, and the last
    question open; a system prompt is folded into the first question."""
    tokens = Llama2ChatFormat(tokenizer).encode_dialog_prompt(dialog)
    turns = [dict(m) for m in dialog]
    if turns[0]["role"] == "system":
        system = turns.pop(0)
        turns[0]["content"] = f"<<SYS>>\n{system['content']}\n<</SYS>>\n\n{turns[0]['content']}"
    questions, answers = turns[::2], turns[1::2]
    starts = [i for i, t in enumerate(tokens) if t == tokenizer.bos_id]
    assert starts[0] == 0 and len(starts) == len(questions)
    segments = [tokens[a:b] for a, b in zip(starts, starts[1:] + [len(tokens)])]
    for segment, question, answer in zip(segments, questions, answers):
        assert segment[-1] == tokenizer.eos_id
        expected = f"[INST] {question['content'].strip()} [/INST] {answer['content'].strip()} "
        assert tokenizer.decode(segment[1:-1]) == expected
    assert tokenizer.eos_id not in segments[-1]
    assert tokenizer.decode(segments[-1][1:]) == f"[INST] {questions[-1]['content'].strip()} [/INST]"


def _well_formed(dialog) -> bool:
    """The rules, stated independently: optional system first, then user/assistant alternating,
    ending with a user message; every message a {'role', 'content': str} dict."""
    if not isinstance(dialog, list) or not dialog:
        return False
    if not all(isinstance(m, dict) and set(m) == {"role", "content"} and isinstance(m["content"], str)
               for m in dialog):
        return False
    roles = [m["role"] for m in dialog]
    if roles[0] == "system":
        roles = roles[1:]
    return bool(roles) and len(roles) % 2 == 1 and all(
        role == ("user" if i % 2 == 0 else "assistant") for i, role in enumerate(roles)
    )


any_messages = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", ""]),
                           "content": st.one_of(texts, st.none(), st.integers())}),
    st.fixed_dictionaries({"role": st.just("user")}),
    st.text(max_size=5),
)


@settings(max_examples=40, **FIXTURE_OK)
@given(dialog=st.one_of(st.lists(any_messages, max_size=5), st.none(), st.text(max_size=5)))
def test_any_dialog_is_formatted_or_refused_with_value_error(tokenizer: Tokenizer, dialog):
    formatter = Llama2ChatFormat(tokenizer)
    if _well_formed(dialog):
        assert formatter.encode_dialog_prompt(dialog)[0] == tokenizer.bos_id
    else:
        with pytest.raises(ValueError, match="message|dialog"):
            formatter.encode_dialog_prompt(dialog)


# --- sampling -----------------------------------------------------------------------------------

distributions = st.lists(
    st.one_of(st.just(0.0), st.floats(1e-6, 1.0), st.sampled_from([0.25, 0.5])), min_size=1, max_size=12
).filter(lambda weights: sum(weights) > 0)
top_ps = st.one_of(st.floats(1e-6, 1.0), st.sampled_from([1e-9, 0.25, 0.5, 0.9, 1.0]))


@settings(max_examples=80, **QUICK)
@given(rows=st.lists(distributions, min_size=1, max_size=4), p=top_ps, seed=st.integers(0, 2**31))
def test_top_p_sample_is_inside_the_nucleus(rows: list[list[float]], p: float, seed: int):
    """The nucleus always holds the most likely token, and a token belongs to it only if the
    tokens strictly more likely than it have less than p of the mass."""
    width = max(map(len, rows))
    probs = torch.tensor([row + [0.0] * (width - len(row)) for row in rows], dtype=torch.float32)
    probs /= probs.sum(dim=-1, keepdim=True)
    torch.manual_seed(seed)
    chosen = sample_top_p(probs, p)
    assert chosen.shape == (len(rows), 1)
    for row, token in zip(probs, chosen[:, 0].tolist()):
        assert row[token] > 0
        assert row[row > row[token]].sum() < p + 1e-6


@settings(max_examples=60, **QUICK)
@given(logits=st.lists(st.floats(-30, 30), min_size=2, max_size=10), masked=st.integers(0, 9),
       temperature=st.floats(0.0, 3.0) | st.sampled_from([1e-38, 1e-300]), p=top_ps)
def test_next_token_never_picks_a_masked_token(logits: list[float], masked: int, temperature: float, p: float):
    scores = torch.tensor([logits])
    scores[0, masked % len(logits)] = float("-inf")
    token = int(next_token(scores, temperature, p))
    assert token != masked % len(logits)
    if temperature < 1e-30:
        assert scores[0, token] == scores.max()


# --- generation ---------------------------------------------------------------------------------

prompt_lists = st.lists(st.lists(st.integers(3, 31999), min_size=0, max_size=12), min_size=1, max_size=5)


@settings(max_examples=8, **FIXTURE_OK)
@given(prompts=prompt_lists, max_gen_len=st.integers(1, 28), echo=st.booleans())
@example(prompts=[[]], max_gen_len=1, echo=True)  # a one-token prompt: its echo's log probability too
def test_generate_in_batches_equals_each_prompt_alone(generator: Llama, prompts: list[list[int]],
                                                      max_gen_len: int, echo: bool):
    bos = generator.tokenizer.bos_id
    prompts = [[bos] + prompt for prompt in prompts]
    tokens, logprobs = generator.generate(prompts, max_gen_len, temperature=0, logprobs=True, echo=echo)
    assert len(tokens) == len(logprobs) == len(prompts)
    for prompt, out, out_logprobs in zip(prompts, tokens, logprobs):
        generated = out[len(prompt):] if echo else out
        if echo:
            assert out[: len(prompt)] == prompt
        assert len(generated) <= max_gen_len and len(prompt) + len(generated) <= MAX_SEQ_LEN
        assert len(out_logprobs) == len(out)
        assert all(0 <= t < generator.model.args.vocab_size for t in generated)
        alone, _ = generator.generate([prompt], max_gen_len, temperature=0, echo=echo)
        assert alone == [out]


@settings(max_examples=8, **FIXTURE_OK)
@given(prompts=st.lists(texts, min_size=1, max_size=3))
def test_text_completion_takes_any_text_or_says_it_is_too_long(generator: Llama, prompts: list[str]):
    lengths = [len(generator.tokenizer.encode(p, bos=True, eos=False)) for p in prompts]
    if max(lengths) > MAX_SEQ_LEN:
        with pytest.raises(ValueError, match="max_seq_len"):
            generator.text_completion(prompts, max_gen_len=2, temperature=0)
        return
    results = generator.text_completion(prompts, max_gen_len=2, temperature=0)
    tokens = [generator.tokenizer.encode(p, bos=True, eos=False) for p in prompts]
    expected, _ = generator.generate(tokens, max_gen_len=2, temperature=0)
    assert [r["generation"] for r in results] == [generator.tokenizer.decode(t) for t in expected]
