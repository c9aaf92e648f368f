"""The state of a batch being decoded: the token grid, where each row starts and ends, and what is
kept for the caller (log probabilities, top candidates)."""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from . import parallel

# Fills the not-yet-generated positions; never a real token id, ignored by the logprob loss.
NO_TOKEN = -1


@dataclass
class Generated:
    """Per prompt: the returned tokens, their log probabilities and each step's top candidates."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    top: list[list[list[tuple[int, float]]]]


@dataclass
class Batch:
    """The state of one batch under Meta's schedule: row r generates from lengths[r] to ends[r].

    The token grid lives on the device (the model reads it, and the log probabilities and the
    repetition penalty); the host keeps its own copy of each row (rows), appended to from each
    step's one read-back, so that deciding where rows end never waits on the device."""

    tokens: torch.Tensor  # bsz, total_len; NO_TOKEN where nothing is generated yet
    rows: list[list[int]]  # the host's copy of each row's tokens so far (at least its prompt)
    lengths: list[int]
    lengths_tensor: torch.Tensor  # bsz
    is_prompt: torch.Tensor  # bsz, total_len
    token_logprobs: torch.Tensor  # bsz, total_len
    # Where each row's output ends (exclusive): the prompt plus max_gen_len, or earlier at a
    # stop token (excluded) or the token that completed a stop string (included).
    ends: list[int]
    top_ids: Optional[torch.Tensor]  # bsz, total_len, show_top
    top_probs: Optional[torch.Tensor]
    cur_pos: int = -1  # the last position filled
    # With speculation rows advance unevenly: how many positions each row has filled (else every
    # row up to cur_pos). See fill.
    reached: Optional[list[int]] = None

    @staticmethod
    def start(prompts: list[list[int]], max_gen_len: int, max_seq_len: int, device: torch.device,
              show_top: int) -> "Batch":
        bsz = len(prompts)
        lengths = [len(p) for p in prompts]
        total_len = min(max_seq_len, max_gen_len + max(lengths))
        tokens = torch.full((bsz, total_len), NO_TOKEN, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=device)
        lengths_tensor = torch.tensor(lengths, device=device)
        is_prompt = torch.arange(total_len, device=device)[None, :] < lengths_tensor[:, None]
        ends = [min(length + max_gen_len, total_len) for length in lengths]
        top_ids = top_probs = None
        if show_top:
            top_ids = torch.zeros(bsz, total_len, show_top, dtype=torch.long, device=device)
            top_probs = torch.zeros(bsz, total_len, show_top, device=device)
        return Batch(tokens, [list(p) for p in prompts], lengths, lengths_tensor, is_prompt,
                     torch.zeros(bsz, total_len, device=device), ends, top_ids, top_probs)

    @property
    def total_len(self) -> int:
        return self.tokens.shape[1]

    @property
    def all_ended(self) -> bool:
        if self.reached is not None:
            return all(end <= reached for end, reached in zip(self.ends, self.reached))
        return all(end <= self.cur_pos + 1 for end in self.ends)

    def end_rows(self, cur_pos: int, column: Sequence[int], stop_tokens: "set[int]", stop: tuple[str, ...],
                 tokenizer) -> None:
        """Note the position cur_pos just filled with column (the host's copy of every row's token
        there, prompt or chosen) and end the rows it finished."""
        self.cur_pos = cur_pos
        for row, token in enumerate(column):
            self.rows[row][cur_pos : cur_pos + 1] = [token]
            if not self.lengths[row] <= cur_pos < self.ends[row]:
                continue
            if token in stop_tokens:
                self.ends[row] = cur_pos
            elif stop and self._completes_stop(row, cur_pos, stop, tokenizer):
                self.ends[row] = cur_pos + 1

    def fill(self, row: int, tokens: Sequence[int], stop_tokens: "set[int]", stop: tuple[str, ...],
             tokenizer) -> None:
        """Write tokens into row from the first position it has not reached (speculation: a
        round's tokens), ending the row where one of them ends it, as end_rows does."""
        first = self.reached[row]
        self.tokens[row, first : first + len(tokens)] = torch.tensor(tokens, device=self.tokens.device)
        self.rows[row][first : first + len(tokens)] = tokens
        end = self.ends[row]
        for pos, token in enumerate(tokens, start=first):
            self.reached[row] = pos + 1
            if pos >= self.lengths[row]:
                if token in stop_tokens:
                    end = pos
                elif stop and self._completes_stop(row, pos, stop, tokenizer):
                    end = pos + 1
            if self.reached[row] >= end:
                break
        self.ends[row] = end

    def _completes_stop(self, row: int, pos: int, stop: tuple[str, ...], tokenizer) -> bool:
        """Whether the token at pos completes one of the stop strings in row's generated text."""
        # A stop string that ended earlier already ended its row, so only one ending at this
        # token can be new: decode just enough tail to hold it (up to 4 byte tokens a
        # character) instead of the whole row at every step.
        window = 4 * max(map(len, stop)) + 2
        first = max(self.lengths[row], pos + 1 - window)
        text = tokenizer.decode(self.rows[row][first : pos + 1])
        return any(s in text for s in stop)

    def generated(self, row: int) -> list[int]:
        """Row's generated tokens so far, without a stop token or anything after its end."""
        filled = self.cur_pos + 1 if self.reached is None else self.reached[row]
        end = min(self.ends[row], filled)
        return self.rows[row][self.lengths[row] : max(end, self.lengths[row])]

    def collect(self, result: Generated, echo: bool) -> None:
        """Append each row's final tokens, log probabilities and top candidates to result: the
        numbers as rank 0 computed them, so that every rank returns the same."""
        rows = zip(self.rows, parallel.from_first_rank(self.token_logprobs).tolist(), self.lengths, self.ends)
        top_ids = top_probs = None
        if self.top_ids is not None:
            top_ids, top_probs = parallel.from_first_rank(self.top_ids), parallel.from_first_rank(self.top_probs)
        for row, (row_tokens, row_logprobs, length, end) in enumerate(rows):
            start = 0 if echo else length
            result.tokens.append(row_tokens[start:end])
            result.logprobs.append(row_logprobs[start:end])
            if top_ids is not None:
                ids, probs = top_ids[row, length:end].tolist(), top_probs[row, length:end].tolist()
                result.top.append([list(zip(i, p)) for i, p in zip(ids, probs)])


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) under logits [bsz, seqlen, vocab] for targets [bsz, seqlen]; 0 where no token yet."""
    return -F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=NO_TOKEN)
