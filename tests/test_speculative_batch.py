"""A round of speculation over rows with different options (issue 32): the draft's draws and the
target's verdicts come in one call for all rows, and each seeded row gets the tokens it gets when
it speculates alone; greedy rows get plain decoding's. On table models whose logits are looked
up, never multiplied, so that the batch cannot change a row's logits (a real model's products
may round otherwise with the number of rows on this CPU: docs/batch_jobs.md)."""

from types import SimpleNamespace

import pytest
import torch

from llama_tp import parallel
from llama_tp.model.prefix_cache import PrefixCache
from llama_tp.sampling import SamplingOptions, choose_next, stop_ban
from llama_tp.engine.speculative import Row, Speculator
from llama_tp.engine.speculative.draft import Draft

VOCAB, K, ROUNDS, STOP = 16, 3, 6, 5


class TableModel:
    """Stands in for a Transformer in a round: a position's logits are looked up from its token and
    the one before it; as a KV cache does, it remembers what each cache row was fed."""

    def __init__(self, table: torch.Tensor, before: torch.Tensor, rows: int):
        self.table, self.before = table, before  # [VOCAB, VOCAB] each: logits by last token, by the one before
        self.held: list[list[int]] = [[] for _ in range(rows)]
        self.prefix_cache = PrefixCache(rows)
        self.max_seq_len = 256
        self.rotary = SimpleNamespace(device=torch.device("cpu"))
        self.exact_steps = False

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """The logits predicting what follows tokens [VOCAB]."""
        return self.table[tokens[-1]] + (self.before[tokens[-2]] if len(tokens) > 1 else 0)

    def forward(self, tokens: torch.Tensor, starts: list[int], last_only: bool = False, vocab_slice: bool = False,
                slots: list[int] = ()) -> torch.Tensor:
        """As Transformer.forward (at world size 1 a vocabulary slice is the whole vocabulary)."""
        logits = []
        for fed, start, slot in zip(tokens.tolist(), starts, slots):
            held = self.held[slot]
            del held[start:]
            held.extend(fed)
            logits.append(torch.stack([self.logits(held[: end + 1]) for end in range(start, len(held))]))
        logits = torch.stack(logits)  # rows, fed, VOCAB
        return logits[:, -1:] if last_only else logits

    def padded_width(self, seqlen: int, starts: list[int]) -> int:
        """As a target whose verifying step runs whole (Transformer.padded_width): K + 1 tokens a
        row where they fit, so that rounds verify padded rows."""
        return K + 1 if seqlen <= K + 1 and max(starts) + K + 1 <= self.max_seq_len else seqlen


def models(rows: int, stop_boost: float = 3.0) -> tuple[TableModel, Speculator]:
    """The target, and a speculator whose draft agrees with it in part; stop_boost makes the stop
    token likelier (so that min_gen_len's ban changes choices)."""
    generator = torch.Generator().manual_seed(0)
    table, before = torch.randn(VOCAB, VOCAB, generator=generator) * 2, torch.randn(VOCAB, VOCAB, generator=generator)
    table[:, STOP] += stop_boost
    noise = torch.randn(VOCAB, VOCAB, generator=generator)
    draft = TableModel(table + noise, before, rows)
    return TableModel(table, before, rows), Speculator("draft", K, Draft(draft, "the target's table, perturbed"))


# Each row: its options, its prompt, and the most tokens it may gain a round (one guess, then the
# target's own token; or plenty).
ROWS = [
    (SamplingOptions(temperature=0), [1, 2], 100),
    (SamplingOptions(temperature=0, repetition_penalty=1.5, min_gen_len=4), [3, 4, 3], 100),
    (SamplingOptions(temperature=0.9, top_p=0.8), [1, 6], 100),
    (SamplingOptions(temperature=1.2, top_p=1.0, top_k=5, repetition_penalty=1.3), [7, 2, 7], 100),
    (SamplingOptions(temperature=0.7, top_p=0.95, min_p=0.1, min_gen_len=3), [9, 9], 100),
    (SamplingOptions(temperature=1.0, top_p=0.9), [2, 11, 4], 100),
    (SamplingOptions(temperature=0.8, top_p=1.0, repetition_penalty=1.2), [6, 3], 2),
]


def speculate(chosen: list[int], stop_boost: float = 3.0) -> tuple[dict[int, list[int]], Speculator]:
    """The tokens the chosen ROWS gain in ROUNDS rounds together, each with its own seeded generator."""
    target, speculator = models(len(chosen), stop_boost)
    rows = []
    for slot, index in enumerate(chosen):
        options, prompt, room = ROWS[index]
        target.held[slot] = prompt[:-1]  # the target's caches hold all but each row's last token
        target.prefix_cache.extend(slot, 0, prompt[:-1])
        rows.append(Row(slot, list(prompt), options, torch.Generator().manual_seed(100 + index), len(prompt), [STOP],
                        room))
    for _ in range(ROUNDS):
        for row, outcome in zip(rows, speculator.round(target, rows)):
            row.tokens = row.tokens + outcome.tokens
    return {index: row.tokens[row.prompt_length:] for index, row in zip(chosen, rows)}, speculator


@pytest.fixture(scope="module", autouse=True)
def world_of_one() -> None:
    parallel.init()  # the choices' read-back asks the model-parallel group its size


@pytest.fixture(scope="module")
def together() -> tuple[dict[int, list[int]], Speculator]:
    return speculate(list(range(len(ROWS))))


def test_each_seeded_row_gains_what_it_gains_alone(together):
    tokens, speculator = together
    for index in range(len(ROWS)):
        assert speculate([index])[0][index] == tokens[index], index
    assert 0 < speculator.stats.accepted < speculator.stats.proposed  # the draft was right and wrong
    assert all(len(gained) > ROUNDS for gained in tokens.values())  # rounds that accepted guesses, everywhere
    for index, (options, _, _) in enumerate(ROWS):
        assert STOP not in tokens[index][: options.min_gen_len], index


def test_greedy_rows_in_a_sampled_batch_gain_plain_decodings_tokens(together):
    tokens, _ = together
    target, _ = models(1)
    for index in (0, 1):
        options, prompt, _ = ROWS[index]
        plain = list(prompt)
        while len(plain) < len(prompt) + len(tokens[index]):
            ban = stop_ban(torch.tensor([len(plain) - len(prompt)]), options.min_gen_len, [STOP], VOCAB)
            plain.append(int(choose_next(target.logits(plain)[None], options, torch.tensor([plain]), ban)))
        assert tokens[index] == plain[len(prompt):], index
        assert STOP in tokens[index][options.min_gen_len:]  # what the ban held back



def test_a_stop_token_the_target_always_prefers_comes_as_soon_as_min_gen_len_allows():
    tokens, _ = speculate(list(range(len(ROWS))), stop_boost=30.0)
    for index, (options, _, _) in enumerate(ROWS):
        first = options.min_gen_len
        assert STOP not in tokens[index][:first] and tokens[index][first] == STOP, index
