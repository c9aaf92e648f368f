"""What a step reads back beside its tokens, built on the device for all rows at once: each row's
stop-token ban, the log probabilities and likeliest alternatives asked for, the sampler's top
candidates (show_top), a prompt's own log probabilities; and a step's rows as one batch."""

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..sampling import top_candidates
from .progress import Candidates
from .requests import GenerationRequest, TokenLogprob
from .scheduler import Chunk
from .speculative import Outcome
from .speculative.rows import Row, histories, suppressed

# Fills the not-yet-known targets of a prompt's log probabilities; ignored by the loss.
NO_TOKEN = -1


def batch_tensors(chunks: list[Chunk]) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
    """chunks' tokens as one batch [rows, longest] on the host (the model moves them: a step replayed
    as a CUDA graph takes them in its one copy of inputs), the shorter padded on the right; their
    start positions, cache rows and lengths."""
    lengths = [len(chunk.tokens) for chunk in chunks]
    width = max(lengths)
    tokens = torch.tensor([chunk.tokens + [0] * (width - len(chunk.tokens)) for chunk in chunks])
    return tokens, [chunk.start for chunk in chunks], [c.sequence.slot.index for c in chunks], lengths


def stop_bans(requests: Sequence[GenerationRequest], generated: Sequence[int], vocab: int,
              device: torch.device) -> Optional[torch.Tensor]:
    """Each row's stop tokens, banned while it has generated fewer than its min_gen_len:
    [rows, vocab] bool, or None when no row bans any."""
    rows, tokens = [], []
    for row, (request, count) in enumerate(zip(requests, generated)):
        if count < request.options.min_gen_len:  # no end of answer yet
            stop_tokens = sorted(request.stop_tokens)
            rows += [row] * len(stop_tokens)
            tokens += stop_tokens
    if not rows:
        return None
    ban = torch.zeros(len(requests), vocab, dtype=torch.bool, device=device)
    ban[torch.tensor(rows, device=device), torch.tensor(tokens, device=device)] = True
    return ban


def logprob_columns(tokens: torch.Tensor, logprobs: Optional[torch.Tensor], top: int) -> list[torch.Tensor]:
    """What a step reads back beside its tokens [rows], with logprobs [rows, vocab]: each token's
    log probability, then the `top` likeliest ids and their log probabilities."""
    if logprobs is None:
        return []
    columns = [logprobs.gather(-1, tokens[:, None])]
    if top:
        values, ids = logprobs.topk(top, dim=-1)
        columns += [ids, values]
    return columns


def candidate_columns(requests: Sequence[GenerationRequest], logits: torch.Tensor, history: Optional[torch.Tensor],
                      ban: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """The sampler's likeliest tokens and their probabilities for the rows that ask (show_top):
    [rows, most asked] ids and [rows, most asked] probabilities (zeros for the others), each row's
    as sampling.top_candidates sees it, with its own options, history and ban."""
    most = max(request.top_candidates for request in requests)
    if not most:
        return []
    ids = torch.zeros(len(requests), most, dtype=torch.long, device=logits.device)
    probs = torch.zeros(len(requests), most, device=logits.device)
    for row, request in enumerate(requests):
        if request.top_candidates:
            picked = slice(row, row + 1)
            row_ids, row_probs = top_candidates(logits[picked], request.options, most,
                                                None if history is None else history[picked],
                                                None if ban is None else ban[picked])
            ids[row, : row_ids.shape[-1]], probs[row, : row_probs.shape[-1]] = row_ids[0], row_probs[0]
    return [ids, probs]


def read_logprob(line: Sequence[float], token: int, top: int, n: int) -> TokenLogprob:
    """A row's TokenLogprob from its read-back columns after the token (logprob_columns' with
    `top` alternatives), keeping n of them."""
    ids, values = line[1 : 1 + top][:n], line[1 + top :][:n]
    return TokenLogprob(token, line[0], tuple((int(i), v) for i, v in zip(ids, values)))


def read_candidates(line: Sequence[float], most: int, n: int) -> Candidates:
    """A row's candidates from candidate_columns' read-back columns, keeping n of them."""
    return tuple((int(i), p) for i, p in zip(line[:most][:n], line[most:][:n]))


def prompt_targets(chunk: Chunk) -> list[int]:
    """The prompt tokens that chunk's logits predict (each position's next, within the prompt)."""
    prompt = chunk.sequence.request.prompt_tokens
    return list(prompt[chunk.start + 1 : chunk.start + len(chunk.tokens) + 1])


def prompt_logprobs(logits: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """log p(target) under each of logits [n, vocab] for the first len(targets) positions: [len(targets)]."""
    chosen = torch.tensor(targets, device=logits.device)
    return -F.cross_entropy(logits[: len(targets)].float(), chosen, reduction="none")


def round_extras(requests: Sequence[GenerationRequest], rows: Sequence[Row],
                 outcomes: Sequence[Outcome]) -> list[Optional[list[tuple[Optional[TokenLogprob], Candidates]]]]:
    """What a speculation round's rows ask for beside their tokens, read back once for all rows
    that ask: per token gained, its TokenLogprob (under the model's logits, before any sampling
    option; None where not asked) and its candidates (as the sampler saw them: show_top). None
    for the rows that ask for neither."""
    asking = [index for index, request in enumerate(requests) if request.logprobs or request.top_candidates]
    if not asking:
        return [None] * len(requests)
    top = max(requests[index].top_logprobs for index in asking)
    most = max(requests[index].top_candidates for index in asking)
    logits = torch.cat([outcomes[index].logits[: len(outcomes[index].tokens)] for index in asking])
    tokens = torch.tensor([token for index in asking for token in outcomes[index].tokens], device=logits.device)
    columns = logprob_columns(tokens, F.log_softmax(logits.float(), dim=-1), top)
    if most:
        ids, probs = [], []
        for index in asking:
            row, outcome = rows[index], outcomes[index]
            positions, vocab = outcome.logits.shape
            history = histories(row.tokens + outcome.tokens[:-1], positions, row.options, logits.device)
            ban = suppressed(row, len(row.tokens), positions, vocab, logits.device)
            found_ids, found_probs = top_candidates(outcome.logits, row.options, most, history, ban)
            ids.append(found_ids[: len(outcome.tokens)])
            probs.append(found_probs[: len(outcome.tokens)])
        columns += [torch.cat(ids), torch.cat(probs)]
    lines = iter(torch.cat([column.double().reshape(len(tokens), -1) for column in columns], dim=-1).tolist())
    result: list[Optional[list[tuple[Optional[TokenLogprob], Candidates]]]] = [None] * len(requests)
    for index in asking:
        request, gained = requests[index], []
        for token in outcomes[index].tokens:
            line = next(lines)
            logprob = read_logprob(line, token, top, request.top_logprobs) if request.logprobs else None
            gained.append((logprob, read_candidates(line[1 + 2 * top :], most, request.top_candidates)))
        result[index] = gained
    return result
