"""Choosing the next token from logits: greedy, temperature, top-k, min-p and nucleus (top-p)
sampling, with Hugging Face's repetition penalty and a minimum length before stop tokens are
allowed. The options, and the definition for one set of options (distribution, sample_top_p);
sampler.py samples a whole step's rows, each with its own options, in one call."""

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .sampler import choose

# The ranges past which an option stops meaning what it says: the sampler takes 1 / temperature
# and the penalty in fp32, where 1 / 1e308 is 0 (greedy) and a penalty of 1e-300 is 0 (every
# repeated token infinitely likely). Past 100, a temperature flattens every distribution alike.
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class SamplingOptions:
    """How the next token is chosen; the defaults are Meta's reference behaviour."""

    temperature: float = 0.6  # 0 is greedy
    top_p: float = 0.9
    top_k: Optional[int] = None  # None or 0: no top-k cut
    repetition_penalty: float = 1.0  # 1: none; >1 discourages tokens already in the row (CTRL's rule)
    min_p: float = 0.0  # 0: none; else tokens less likely than min_p times the best one are cut
    min_gen_len: int = 0  # stop tokens are impossible before this many tokens are generated
    seed: Optional[int] = None  # None: the global generator seeded by Llama.build

    def check(self) -> None:
        """Raise ValueError naming the first option out of range."""
        for name in ("temperature", "top_p", "repetition_penalty", "min_p"):
            value = getattr(self, name)
            # fire hands over whatever the user typed, e.g. the str 'hot'
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, found {value!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0: greedy), found {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], found {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1) (0 for no cut, e.g. 0.05), found {self.min_p}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be a positive integer (or 0/None for no cut), found {self.top_k!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(
                f"repetition_penalty must be in [{low:g}, {high:g}] (1 for none, e.g. 1.2 to discourage "
                f"repeats), found {self.repetition_penalty}"
            )
        if not isinstance(self.min_gen_len, int) or self.min_gen_len < 0:
            raise ValueError(f"min_gen_len must be a non-negative integer, found {self.min_gen_len!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, found {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """Whether the best token (after any penalty) is chosen: a temperature that rounds to 0 in
        the logits' fp32, as choose_next decides."""
        return self.temperature < torch.finfo(torch.float32).tiny

    @property
    def takes_best_logit(self) -> bool:
        """Whether the next token is simply the model's best logit: greedy, with no repetition
        penalty and no minimum length."""
        return self.greedy and self.repetition_penalty == 1.0 and not self.min_gen_len

    def generator(self, device: torch.device) -> Optional[torch.Generator]:
        """A private random generator for a per-call seed, or None for the global one."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def check_given(**settings) -> None:
    """Refuse a bad value among the settings given; None is one left to the model's or Meta's default."""
    SamplingOptions(**{name: value for name, value in settings.items() if value is not None}).check()


def stop_ban(generated: torch.Tensor, min_gen_len: int, stop_tokens, vocab: int) -> torch.Tensor:
    """The tokens that cannot be chosen: the stop tokens, while fewer than min_gen_len were
    generated. generated [rows]: tokens generated before each choice -> [rows, vocab] bool."""
    ban = torch.zeros(len(generated), vocab, dtype=torch.bool, device=generated.device)
    ban[:, stop_tokens] = (generated < min_gen_len)[:, None]
    return ban


def sample_top_p(probs: torch.Tensor, p: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Sample from the smallest set of most likely tokens whose probability reaches p.

    probs [bsz, vocab] -> token ids [bsz, 1].
    """
    probs_sorted, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
    # A token stays if the tokens ranked above it have not reached p yet; the first always stays.
    probs_sorted = probs_sorted.masked_fill(mass_before >= p, 0.0)
    probs_sorted.div_(probs_sorted.sum(dim=-1, keepdim=True))
    choice = torch.multinomial(probs_sorted, num_samples=1, generator=generator)
    return torch.gather(order, -1, choice)


def next_token(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits [bsz, vocab] -> token ids [bsz]; temperature 0 is greedy."""
    return choose_next(logits, SamplingOptions(temperature=temperature, top_p=top_p))


def adjust_logits(logits: torch.Tensor, options: SamplingOptions, history: Optional[torch.Tensor] = None,
                  suppress: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Apply the repetition penalty and the stop-token ban to logits [bsz, vocab].

    history [bsz, n]: each row's tokens so far (negative ids are ignored).
    suppress [bsz, vocab] bool: tokens that must not be chosen (stop tokens before min_gen_len).
    """
    if options.repetition_penalty != 1.0 and history is not None and history.numel():
        seen = seen_in(history, logits.shape[-1])
        # CTRL (Keskar et al. 2019), as in transformers: shrink positive logits, grow negative ones.
        penalised = torch.where(logits > 0, logits / options.repetition_penalty, logits * options.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if suppress is not None:
        logits = logits.masked_fill(suppress, float("-inf"))
    return logits


def seen_in(history: torch.Tensor, vocab: int) -> torch.Tensor:
    """Which tokens each row of history [rows, n] holds (negative ids are padding): [rows, vocab] bool."""
    # Padding goes to a column past the vocabulary, dropped after: clamping it to token 0 would
    # write column 0 both True and False, and which write wins is up to the device.
    seen = torch.zeros(history.shape[0], vocab + 1, dtype=torch.bool, device=history.device)
    seen.scatter_(1, history.masked_fill(history < 0, vocab), True)
    return seen[:, :vocab]


def choose_next(logits: torch.Tensor, options: SamplingOptions, history: Optional[torch.Tensor] = None,
                suppress: Optional[torch.Tensor] = None,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The next token of each row: logits [bsz, vocab] -> token ids [bsz], with every option
    applied; every row sampled at once (sampler.py), from the distribution `distribution` gives."""
    return choose(logits, [options] * logits.shape[0], generator, history, suppress)


def _tempered(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """Probabilities [rows, vocab] of adjusted logits at the temperature, cut to the top k."""
    # Shift the best logit to 0 first: for a tiny temperature, logits / temperature overflows to
    # inf (and softmax to NaN), while values <= 0 divided by it only reach -inf.
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / options.temperature
    if options.top_k:
        kth_best = torch.topk(logits, min(options.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if options.min_p:  # the best is at 0: a token's probability over the best's is exp(logit)
        logits = logits.masked_fill(logits < math.log(options.min_p), float("-inf"))
    return torch.softmax(logits, dim=-1)


def distribution(logits: torch.Tensor, options: SamplingOptions, history: Optional[torch.Tensor] = None,
                 suppress: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The probabilities choose_next samples each row's next token from: logits [rows, vocab] ->
    [rows, vocab], every option applied (greedy: all on the best token). Speculative sampling
    compares the draft's and the target's."""
    logits = adjust_logits(logits, options, history, suppress)
    if options.temperature < torch.finfo(logits.dtype).tiny:
        return torch.nn.functional.one_hot(logits.max(dim=-1).indices, logits.shape[-1]).to(logits.dtype)
    probs = _tempered(logits, options)
    # sample_top_p's cut, kept in vocabulary order.
    probs_sorted, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
    probs_sorted = probs_sorted.masked_fill(mass_before >= options.top_p, 0.0)
    probs_sorted.div_(probs_sorted.sum(dim=-1, keepdim=True))
    return torch.zeros_like(probs).scatter_(-1, order, probs_sorted)


def top_candidates(logits: torch.Tensor, options: SamplingOptions, n: int, history: Optional[torch.Tensor] = None,
                   suppress: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The n most likely next tokens and their probabilities, [bsz, n] each, as the sampler saw them
    (after penalties and temperature; at temperature 0, the plain softmax)."""
    logits = adjust_logits(logits, options, history, suppress)
    probs = torch.softmax(logits / (options.temperature or 1.0), dim=-1)
    values, ids = torch.topk(probs, min(n, probs.shape[-1]), dim=-1)
    return ids, values
