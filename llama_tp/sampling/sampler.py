"""Every row of a step chooses its next token in one call, each row with its own options and its
own random generator (vLLM's sampler and gpt-fast's decode_one_token are the models).

The order is rule.py's for one row, after what the caller has done to the logits
(structured outputs, logit_bias, presence penalties: llama_tp/structured): the repetition penalty
from each row's history (TokenHistory), the stop-token ban; then greedy rows
take their best logit, and the others sample at their temperature from what top-k, min-p and
top-p leave.

Top-p without sorting the vocabulary: each row's NUCLEUS_CANDIDATES best tokens come first
(torch.topk). When they hold the row's top_p mass, the cut is the one a full sort finds; only a
row where they do not (a flat distribution) is sorted in full. Each sampled row draws one
uniform number u from its own generator and takes the token where the running sum of its kept
probabilities, best first, passes u: the same token whichever way its nucleus was found, so the
full sort is needed only for the rows it concerns, and the caller learns which with the tokens
(Draw.unsettled), in the step's one read-back.

On a CPU where our kernels run (AVX-512 or AVX2), the whole rule for every row is one call of
kernels/sampler_kernel.cpp (cpu_kernels.sample_rows): a few passes over each row's logits, which
stay in L2, where torch's ops take a dozen over the whole step's, and no row is left to settle.
It draws from the same distribution with the same uniform number a row, its probabilities in
float64 from the fp32 scaled logits; only a draw that lands within rounding of the boundary
between two tokens can take the other one.

Speculative sampling needs the distributions themselves (distributions: every row's in one
call, exactly rule.distribution's), and draws from them the same way (draw: one uniform
number a row from its own generator, and the inverse CDF in vocabulary order).
"""

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from ..kernels import cpu_kernels
from .options import SamplingOptions

# Candidates taken before any sort: enough for top_p 0.9 on a sharp distribution (a chat model at
# temperature 0.7), a topk of them costs a fraction of a full sort of 49,152 or 128,256 logits.
NUCLEUS_CANDIDATES = 256
# Whether a step on a CPU where our kernels run samples through sampler_kernel.cpp (the tests
# compare it with torch's ops, which every other device runs).
USE_KERNEL = True

Generators = Union[Optional[torch.Generator], Sequence[Optional[torch.Generator]]]


@dataclass(frozen=True)
class StepOptions:
    """A step's per-row options as tensors on the logits' device, built once per set of options."""

    sampled: tuple[int, ...]  # rows that sample (the others are greedy)
    sampled_index: torch.Tensor  # the same, on the device
    temperature: torch.Tensor  # sampled rows, 1
    inverse_temperature: torch.Tensor  # 1 / temperature: multiplying is cheaper than dividing
    top_p: torch.Tensor  # sampled rows, 1; 1 or more: no cut
    top_k: Optional[torch.Tensor]  # sampled rows, 1, 0 for no cut; None when no row cuts
    min_p: Optional[torch.Tensor]  # sampled rows, 1, 0 for no cut; None when no row cuts
    nucleus: "Subset"  # sampled rows with a top-p cut: drawn from their candidates
    whole: "Subset"  # sampled rows without one: drawn from the whole vocabulary, in its order
    candidates: int  # how many best tokens a sampled row looks at first
    penalty: Optional[torch.Tensor]  # rows, 1; None when no row penalises repeats
    # Top-p rows whose top-k cut falls among the candidates, so that their nucleus does too, and
    # the others (distributions sorts the whole vocabulary only for these).
    nucleus_among_candidates: "Subset"
    nucleus_anywhere: "Subset"
    # Every row's options for sampler_kernel.cpp: [rows, 4] fp32 (1 / temperature, 0 for greedy;
    # top_p; min_p; repetition penalty) and top_k [rows] int64 (0: none).
    row_settings: torch.Tensor
    row_top_k: torch.Tensor


@dataclass(frozen=True)
class Subset:
    """Some of the sampled rows, on the host and on the device; all: every sampled row."""

    rows: tuple[int, ...]
    index: torch.Tensor
    all: bool

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.all else tensor[self.index]


@functools.lru_cache(maxsize=256)
def step_options(options: tuple[SamplingOptions, ...], vocab: int, device: torch.device) -> StepOptions:
    """The tensors for a step whose rows have these options (the same set step after step)."""
    sampled = tuple(row for row, o in enumerate(options) if not o.greedy)
    chosen = [options[row] for row in sampled]

    def column(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device).reshape(-1, 1)

    def subset(rows):
        return Subset(tuple(rows), torch.tensor(rows, dtype=torch.long, device=device), len(rows) == len(chosen))

    top_k = [min(o.top_k or 0, vocab) for o in chosen]
    penalties = [o.repetition_penalty for o in options]
    candidates = min(vocab, max([NUCLEUS_CANDIDATES, *top_k]))
    among_candidates = [0 < k < candidates for k in top_k]
    return StepOptions(
        sampled, torch.tensor(sampled, dtype=torch.long, device=device),
        column([o.temperature for o in chosen]), column([1 / o.temperature for o in chosen]),
        column([o.top_p for o in chosen]),
        column(top_k, torch.long) if any(top_k) else None,
        column([o.min_p for o in chosen]) if any(o.min_p for o in chosen) else None,
        subset([i for i, o in enumerate(chosen) if o.top_p < 1]),
        subset([i for i, o in enumerate(chosen) if o.top_p >= 1]),
        candidates,
        column(penalties) if any(p != 1.0 for p in penalties) else None,
        subset([i for i, o in enumerate(chosen) if o.top_p < 1 and among_candidates[i]]),
        subset([i for i, o in enumerate(chosen) if o.top_p < 1 and not among_candidates[i]]),
        torch.tensor([[0.0 if o.greedy else 1 / o.temperature, o.top_p, o.min_p, o.repetition_penalty]
                      for o in options], dtype=torch.float32, device=device).reshape(-1, 4),
        torch.tensor([0 if o.greedy else min(o.top_k or 0, vocab) for o in options], dtype=torch.long, device=device),
    )


class TokenHistory:
    """Each cache row's tokens so far, for the repetition penalty: kept on the device and
    appended to with each new token, never rebuilt from a Python list. [rows, capacity] ids,
    -1 past a row's end."""

    def __init__(self, rows: int, capacity: int, device: torch.device):
        self.ids = torch.full((rows, capacity), -1, dtype=torch.long, device=device)

    def reset(self, row: int, tokens: Sequence[int]) -> None:
        """Row now holds exactly tokens (a new request's prompt)."""
        self.ids[row] = -1
        self.write(row, 0, tokens)

    def write(self, row: int, start: int, tokens: Sequence[int]) -> None:
        """Row's tokens from position start are these (host ids)."""
        self.ids[row, start : start + len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=self.ids.device)

    def append(self, rows: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each of rows [n] holds its token [n] at its position [n], all on the device: a step's new tokens."""
        self.ids[rows, positions] = tokens


@dataclass
class Draw:
    """A step's choices, still on the device. tokens [rows]; unsettled [rows] bool: rows whose
    nucleus reaches past their candidates, whose token settle() finds with a full sort."""

    tokens: torch.Tensor
    unsettled: Optional[torch.Tensor] = None  # None: every row is settled
    _scaled: Optional[torch.Tensor] = None  # sampled rows' cut logits at their temperature, [sampled, vocab]
    _uniform: Optional[torch.Tensor] = None  # sampled rows' draws, [sampled]
    _step: Optional[StepOptions] = None

    def settle(self, unsettled: Optional[Sequence[bool]] = None) -> torch.Tensor:
        """The final tokens [rows]. unsettled: the host's copy of self.unsettled if the caller read
        it back with the tokens; otherwise it is read here."""
        if self.unsettled is None:
            return self.tokens
        if unsettled is None:
            unsettled = self.unsettled.tolist()
        redo = [index for index, row in enumerate(self._step.sampled) if unsettled[row]]
        if not redo:
            return self.tokens
        at = torch.tensor(redo, device=self.tokens.device)
        weights, order = _nucleus(self._scaled[at], self._step.top_p[at])
        drawn = order.gather(-1, inverse_cdf(weights, self._uniform[at])[:, None]).squeeze(-1)
        return self.tokens.index_put((self._step.sampled_index[at],), drawn)


def sample(logits: torch.Tensor, options: Sequence[SamplingOptions], generators: Generators = None,
           history: Optional[torch.Tensor] = None, ban: Optional[torch.Tensor] = None) -> Draw:
    """The next token of every row: logits [rows, vocab] -> Draw, with row r's options[r] applied.

    generators: one for every row (or None: torch's global one), or one per row.
    history [rows, n]: each row's tokens so far, which the repetition penalty discourages
    (negative ids are padding).
    ban [rows, vocab] bool: tokens that must not be chosen (stop tokens before min_gen_len).
    """
    step = step_options(tuple(options), logits.shape[-1], logits.device)
    if USE_KERNEL and cpu_kernels.decoding_kernels_run_on(logits.device):
        return Draw(_sample_in_kernel(logits, step, generators, history, ban))
    logits = adjusted(logits, step, history, ban)
    if not step.sampled:  # the first of equal best, as argmax picks, in a third of argmax's time on CPU
        return Draw(logits.max(dim=-1).indices)
    greedy = len(step.sampled) < len(options)
    tokens = logits.max(dim=-1).indices if greedy else torch.empty(len(options), dtype=torch.long,
                                                                       device=logits.device)
    scaled = _at_temperature(logits, step)
    uniform = _uniforms(step.sampled, generators, logits.device)
    best = torch.topk(scaled, step.candidates, dim=-1) if step.nucleus.rows or step.top_k is not None else None
    scaled, values = _cut(scaled, best, step)
    drawn = torch.empty(len(step.sampled), dtype=torch.long, device=logits.device)
    held = torch.ones(len(step.sampled), dtype=torch.bool, device=logits.device)
    if step.nucleus.rows:
        rows = step.nucleus
        weights, rows_held = _candidate_weights(rows.of(values), rows.of(scaled), rows.of(step.top_p))
        ids = rows.of(best.indices)
        drawn[rows.index] = ids.gather(-1, inverse_cdf(weights, rows.of(uniform))[:, None]).squeeze(-1)
        held[rows.index] = rows_held
    if step.whole.rows:
        rows = step.whole
        drawn[rows.index] = inverse_cdf(torch.softmax(rows.of(scaled), dim=-1), rows.of(uniform))
    tokens = tokens.index_put((step.sampled_index,), drawn)
    unsettled = torch.zeros(len(options), dtype=torch.bool, device=logits.device)
    unsettled = unsettled.index_put((step.sampled_index,), ~held)
    return Draw(tokens, unsettled, scaled, uniform, step)


def _sample_in_kernel(logits: torch.Tensor, step: StepOptions, generators: Generators,
                      history: Optional[torch.Tensor], ban: Optional[torch.Tensor]) -> torch.Tensor:
    """sample's tokens [rows] from sampler_kernel.cpp, with the same uniform numbers."""
    rows = len(logits)
    logits = logits.float()
    if ban is not None:
        logits = logits.masked_fill(ban, float("-inf"))
    if history is None or step.penalty is None:
        history = torch.empty(rows, 0, dtype=torch.long)
    uniform = torch.zeros(rows, dtype=torch.float64)
    if step.sampled:
        uniform.index_copy_(0, step.sampled_index, _uniforms(step.sampled, generators, logits.device))
    return cpu_kernels.sample_rows(logits, history, step.row_settings, step.row_top_k, uniform, step.candidates)


def distributions(logits: torch.Tensor, options: Sequence[SamplingOptions], history: Optional[torch.Tensor] = None,
                  ban: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The probabilities each row's next token is drawn from: logits [rows, vocab] -> [rows, vocab],
    row r exactly rule.distribution's for options[r] (greedy rows: all on the best token),
    all rows in one call. history and ban: as sample takes them. Speculative sampling compares
    the draft's and the target's. A row whose top-p cuts sorts its whole vocabulary, unless its
    top-k leaves fewer tokens than the candidates."""
    step = step_options(tuple(options), logits.shape[-1], logits.device)
    logits = adjusted(logits, step, history, ban)
    # All on each row's best token: the greedy rows' answer, and the sampled rows' are written over.
    probs = torch.zeros_like(logits).scatter_(-1, logits.max(dim=-1, keepdim=True).indices, 1.0)
    if not step.sampled:
        return probs
    scaled = _at_temperature(logits, step)
    best = torch.topk(scaled, step.candidates, dim=-1) if step.top_k is not None else None
    scaled, values = _cut(scaled, best, step)
    probs.index_fill_(0, step.sampled_index, 0.0)
    if step.whole.rows:
        rows = step.whole
        probs.index_put_((step.sampled_index[rows.index],), torch.softmax(rows.of(scaled), dim=-1))
    if step.nucleus_among_candidates.rows:  # every token outside the candidates is cut: they are the vocabulary
        rows = step.nucleus_among_candidates
        kept, _ = _candidate_weights(rows.of(values), rows.of(values), rows.of(step.top_p))
        _put(probs, step.sampled_index[rows.index], kept, rows.of(best.indices))
    if step.nucleus_anywhere.rows:
        rows = step.nucleus_anywhere
        _put(probs, step.sampled_index[rows.index], *_nucleus(rows.of(scaled), rows.of(step.top_p)))
    return probs


def draw(probs: torch.Tensor, rows: Sequence[int], generators: Generators = None) -> torch.Tensor:
    """A token for each of rows from its probabilities probs[row] [vocab], with one uniform number
    from its own generator (generators as sample takes them): [len(rows)]."""
    index = torch.tensor(rows, dtype=torch.long, device=probs.device)
    return inverse_cdf(probs[index], _uniforms(rows, generators, probs.device))


def choose(logits: torch.Tensor, options: Sequence[SamplingOptions], generators: Generators = None,
           history: Optional[torch.Tensor] = None, ban: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sample's tokens [rows], settled here (a read-back when some row sampled)."""
    return sample(logits, options, generators, history, ban).settle()


def adjusted(logits: torch.Tensor, step: StepOptions, history: Optional[torch.Tensor],
             ban: Optional[torch.Tensor]) -> torch.Tensor:
    """The logits after the repetition penalty and the ban."""
    logits = logits.float()
    if step.penalty is not None and history is not None and history.shape[-1]:
        logits = penalised(logits, history, step.penalty)
    if ban is not None:
        logits = logits.masked_fill(ban, float("-inf"))
    return logits


def penalised(logits: torch.Tensor, history: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019), as in transformers: the logits [rows, vocab]
    of the tokens in each row's history [rows, n] (negative ids: padding) shrink if positive and
    grow if negative, by the row's penalty [rows, 1] (1: unchanged). Only the history's tokens are
    read and written: rows x n values, not four passes over rows x vocab."""
    # Padding reads and writes one of the row's own tokens (its largest id), so that every write
    # to a column carries the same value; a row with no token at all keeps its logits.
    fill = history.max(dim=-1, keepdim=True).values
    ids = torch.where(history < 0, fill, history).clamp(min=0)
    values = logits.gather(-1, ids)
    changed = torch.where(values > 0, values / penalty, values * penalty)
    return logits.scatter(-1, ids, torch.where(fill >= 0, changed, values))


def _at_temperature(logits: torch.Tensor, step: StepOptions) -> torch.Tensor:
    """The sampled rows' logits [sampled, vocab], their best at 0, at their temperature."""
    scaled = logits[step.sampled_index] if len(step.sampled) < len(logits) else logits
    # Shift first: for a tiny temperature logits / temperature overflows to inf (softmax: NaN),
    # while values <= 0 divided by it only reach -inf.
    return (scaled - scaled.max(dim=-1, keepdim=True).values).mul_(step.inverse_temperature)


def _cut(scaled: torch.Tensor, best, step: StepOptions) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Top-k's and min-p's cuts, at -inf: in the scaled logits [sampled, vocab] (best at 0) and in
    the best candidates' values (best: their topk, or None)."""
    values = None if best is None else best.values
    if step.top_k is None and step.min_p is None:
        return scaled, values
    # min-p keeps tokens whose probability is at least min_p times the best's: exp(scaled) >= min_p.
    floor = torch.full_like(step.temperature, float("-inf")) if step.min_p is None else torch.log(step.min_p)
    if step.top_k is not None:
        kth = values.gather(-1, (step.top_k - 1).clamp(min=0))
        floor = torch.maximum(floor, torch.where(step.top_k > 0, kth, float("-inf")))
    scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    return scaled, (None if values is None else values.masked_fill(values < floor, float("-inf")))


def _candidate_weights(values: torch.Tensor, scaled: torch.Tensor,
                       top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept probabilities of each row's candidates (values [rows, n], best first; 0 for those
    top-p cuts), and whether the candidates held the row's whole nucleus [rows]."""
    # The best scaled logit is 0: the sum of exp cannot overflow, so no logsumexp's extra passes.
    probs = torch.exp(values - torch.exp(scaled).sum(dim=-1, keepdim=True).log())
    mass_before = torch.cumsum(probs, dim=-1) - probs
    # A token stays if the tokens ranked above it have not reached p yet; the first always stays.
    keep = mass_before < top_p
    # Held: the last candidate is cut (by top-p, or already by top-k or min-p), or there is no other token.
    held = ~keep[:, -1] | (values[:, -1] == float("-inf")) | (values.shape[-1] == scaled.shape[-1])
    return probs * keep, held


def _put(probs: torch.Tensor, rows: torch.Tensor, kept: torch.Tensor, tokens: torch.Tensor) -> None:
    """Rows [n] of probs [rows, vocab] take what their nucleus keeps, kept [n, m] (0 for the tokens
    it cuts) of tokens [n, m], renormalised."""
    probs.index_put_((rows[:, None].expand_as(tokens), tokens), kept / kept.sum(dim=-1, keepdim=True))


def _nucleus(scaled: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The full sort's answer to _candidate_weights: kept probabilities best first [rows, vocab],
    and the tokens in that order."""
    probs, order = torch.sort(torch.softmax(scaled, dim=-1), dim=-1, descending=True)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    return probs.masked_fill(mass_before >= top_p, 0.0), order


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """For each row, the index where the running sum of weights [rows, n] (not normalised) first
    passes uniform [rows] times their total: index i with probability weights[i] / total."""
    running = torch.cumsum(weights.double(), dim=-1)
    chosen = (running <= uniform[:, None] * running[:, -1:]).sum(dim=-1)
    # Rounding can carry u * total up to the total: then the last token with any weight.
    last = (weights > 0).cumsum(dim=-1).argmax(dim=-1)
    return torch.minimum(chosen, last)


def _uniforms(rows: Sequence[int], generators: Generators, device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) for each sampled row, from its own generator: [rows] float64."""
    if generators is None or isinstance(generators, torch.Generator):
        return torch.rand(len(rows), dtype=torch.float64, device=device, generator=generators)
    return on_device(torch.cat([uniforms(1, generators[row], device) for row in rows]), device)


def uniforms(count: int, generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
    """count uniform numbers from generator, where it is (None: device's global one): [count] float64."""
    where = device if generator is None else generator.device
    return torch.rand(count, dtype=torch.float64, device=where, generator=generator)


def on_device(drawn: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Numbers drawn where their generators are (the engine's are the host's, each a row's) on
    device: one copy, which on a GPU waits for nothing, where a GPU's own generators would launch
    a kernel a row."""
    if drawn.device == device:
        return drawn
    return drawn.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else drawn.to(device)
