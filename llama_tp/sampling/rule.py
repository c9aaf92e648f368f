"""The rule for one set of options: what distribution a row's next token is drawn from (greedy,
temperature, top-k, min-p and nucleus sampling, Hugging Face's repetition penalty, the stop-token
ban before a minimum length), and the API's one-row helpers. sampler.py samples a whole step's
rows, each with its own options, in one call, by this rule."""

import math
from typing import Optional

import torch

from .options import SamplingOptions
from .sampler import choose


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
