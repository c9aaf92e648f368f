"""generate's loops: continuous batching through the serving engine (continuous.py), and Meta's
static batches, decoded step by step (or in rounds of speculation), for the cases the engine does
not keep (see GenerateLoops._generate). Llama inherits them; they read its model, tokenizer and
speculator."""

import dataclasses
from typing import Callable, Iterator, Optional

import torch

from . import parallel
from .batch import Batch, Generated, logprobs_of
from .choices import agreed_tokens
from .continuous import Finished, prompt_seeds, run_continuously
from .logs import logger
from .sampler import sample
from .sampling import SamplingOptions, stop_ban, top_candidates
from .speculative.decoding import decode_rounds
from .structured.constraint import Constraint
from .text.reasoning import Thinking


class GenerateLoops:
    def _generate(self, prompt_tokens: list[list[int]], max_gen_len: int, options: SamplingOptions,
                  stop: tuple[str, ...], logprobs: bool = False, echo: bool = False,
                  show_top: int = 0, stop_tokens: Optional[set[int]] = None, seed: "int | list[int] | None" = None,
                  on_row: Optional[Callable[[int, Generated], None]] = None,
                  constraint: Optional[Constraint] = None,
                  thinking: Optional[list[Optional[Thinking]]] = None) -> Generated:
        """generate's work, through continuous batching (continuous.py); on_row(i, generated) is
        called as prompt i's result is in generated. In static batches of max_batch_size, sharing
        one generator: one prompt (the same thing, and its conversation's cache row stays row 0);
        where each step's top candidates (show_top) or the prompts' own log probabilities (echo
        with logprobs) are wanted, which the engine does not keep; and sampling with speculation,
        whose rounds guess fewer tokens a row the more rows share them (Speculator.guesses_for),
        so that a sampled answer would change with what runs beside it; and structured outputs
        (constraint), whose grammars the API applies in its own decoding loop (after each prompt's
        thinking, where a reasoning model thinks)."""
        sampled_rounds = self.speculator is not None and not options.greedy
        if len(prompt_tokens) == 1 or show_top or (logprobs and echo) or sampled_rounds or constraint is not None:
            if isinstance(seed, list):
                options = dataclasses.replace(options, seed=seed[0])
            result = self._generate_static(prompt_tokens, max_gen_len, options, stop, logprobs, echo, show_top,
                                           stop_tokens, constraint, thinking)
            for row in range(len(prompt_tokens)) if on_row is not None else ():
                on_row(row, result)
            return result
        result = Generated([[] for _ in prompt_tokens], [[] for _ in prompt_tokens], [])

        def finished(answer: Finished) -> None:
            result.tokens[answer.index] = (prompt_tokens[answer.index] if echo else []) + answer.tokens
            result.logprobs[answer.index] = answer.logprobs
            if on_row is not None:
                on_row(answer.index, result)

        run_continuously(self, prompt_tokens, max_gen_len, options, stop, stop_tokens or self.tokenizer.stop_tokens,
                         logprobs, prompt_seeds(seed, len(prompt_tokens)), finished)
        return result

    def _generate_static(self, prompt_tokens: list[list[int]], max_gen_len: int, options: SamplingOptions,
                         stop: tuple[str, ...], logprobs: bool, echo: bool, show_top: int,
                         stop_tokens: Optional[set[int]], constraint: Optional[Constraint] = None,
                         thinking: Optional[list[Optional[Thinking]]] = None) -> Generated:
        """Consecutive batches of max_batch_size under Meta's schedule, keeping what _decode keeps."""
        size = self.model.max_batch_size
        result = Generated([], [], [])
        generator = options.generator(self.model.rotary.device)  # one per call: batches continue it
        for first in range(0, len(prompt_tokens), size):
            # Run every step; keep the last state.
            *_, batch = self._decode(prompt_tokens[first : first + size], max_gen_len, options, stop,
                                     generator, logprobs, show_top, stop_tokens, reuse=not (logprobs and echo),
                                     constraint=constraint, thinking=thinking and thinking[first : first + size])
            batch.collect(result, echo)
        return result

    @torch.inference_mode()
    def _decode(self, prompts: list[list[int]], max_gen_len: int, options: SamplingOptions,
                stop: tuple[str, ...], generator: Optional[torch.Generator], logprobs: bool = False,
                show_top: int = 0, stop_tokens: Optional[set[int]] = None, reuse: bool = True,
                constraint: Optional[Constraint] = None,
                thinking: Optional[list[Optional[Thinking]]] = None) -> Iterator[Batch]:
        """Meta's schedule: decode from the shortest prompt; longer prompts feed their own tokens.

        Rows end at stop_tokens (by default the tokenizer's; a chat format may add its end of turn).
        Yields the batch before the first step and after every step, for streaming. With a
        speculator, the steps after the first are rounds of guesses (speculative/decoding.py).
        reuse: skip the start that every prompt shares with what its cache row holds from the
        call before (the conversation so far): the same results, less prefill. Not where the
        prompts' own log probabilities are wanted, which need their logits.
        constraint: every row's answer follows this grammar (structured outputs), and ends at
        one of the grammar's stop tokens too; no speculation then. thinking: each row's, where a
        reasoning model's grammar waits for the end of its thinking.
        """
        batch = Batch.start(prompts, max_gen_len, self.model.max_seq_len, self.model.rotary.device, show_top)
        stop_tokens = set(stop_tokens or self.tokenizer.stop_tokens)
        adjustments = None
        if constraint is not None:  # structured outputs (llama_tp/structured; xgrammar, imported when asked)
            from .structured.grammars import grammars_for
            from .structured.rows import make_adjustment

            adjustments = [make_adjustment(self, constraint, thinking=thinking[row] if thinking else None)
                           for row in range(len(prompts))]
            stop_tokens |= grammars_for(self).stop_tokens
        yield batch
        cache = self.model.prefix_cache
        prev_pos = min(cache.reusable(row, prompt) for row, prompt in enumerate(prompts)) if reuse else 0
        if prev_pos:
            logger.debug(f"reusing the cache: {prev_pos} of {min(batch.lengths)} prompt tokens held from the call before")
        min_len = min(batch.lengths)
        if min_len == batch.total_len > 1 and logprobs:  # nothing to generate: score the prompts
            logits = self.model.forward(batch.tokens[:, :-1], 0)
            batch.token_logprobs[:, 1:] = logprobs_of(logits, batch.tokens[:, 1:])
        # Plain greedy decoding needs no logits gathered: each rank offers the best of its slice
        # of the vocabulary (parallel.vocab_argmax).
        on_slices = options.takes_best_logit and not logprobs and batch.top_ids is None and adjustments is None
        # Rounds of guesses once the prompts are in; not for a batch so large that it leaves no
        # room for guesses (Speculator.guesses_for), whose rounds would only drop ended rows.
        speculator = self.speculator
        if speculator is not None and (adjustments is not None or not speculator.guesses_for(self.model, len(prompts))):
            speculator = None
        ban_tokens = torch.tensor(sorted(stop_tokens), device=batch.tokens.device) if options.min_gen_len else None
        for cur_pos in range(min_len, batch.total_len):
            logits = self.model.forward(batch.tokens[:, prev_pos:cur_pos], prev_pos, last_only=not logprobs,
                                        vocab_slice=on_slices)
            for row, tokens in enumerate(batch.rows):
                cache.extend(row, prev_pos, tokens[prev_pos:cur_pos])
            # The step's one read-back: every row's token at cur_pos, as rank 0 chose it.
            if on_slices:  # every rank picks the winner from the same gathered pairs: they agree
                sampled = parallel.vocab_argmax(logits[:, -1])
                chosen = sampled.tolist()
            else:
                last = logits[:, -1] if adjustments is None else adjustments_applied(adjustments, logits[:, -1])
                sampled, chosen = self._sample(batch, last, cur_pos, options, ban_tokens, generator)
            batch.tokens[:, cur_pos] = torch.where(batch.is_prompt[:, cur_pos], batch.tokens[:, cur_pos], sampled)
            column = [row[cur_pos] if cur_pos < length else token
                      for row, length, token in zip(batch.rows, batch.lengths, chosen)]
            if adjustments is not None:  # the rows that generated at cur_pos advance their grammars
                for row, token in enumerate(column):
                    if cur_pos >= batch.lengths[row] and not adjustments[row].accept(token):
                        raise ValueError(f"response_format: the answer of prompt {row} cannot go on: its grammar "
                                         f"allows no token after {cur_pos - batch.lengths[row]} tokens; loosen it")
            if logprobs:
                batch.token_logprobs[:, prev_pos + 1 : cur_pos + 1] = logprobs_of(
                    logits, batch.tokens[:, prev_pos + 1 : cur_pos + 1]
                )
            batch.end_rows(cur_pos, column, stop_tokens, stop, self.tokenizer)
            prev_pos = cur_pos
            yield batch
            if batch.all_ended:
                break
            if speculator is not None:  # every row has its first token: the rest in rounds of guesses
                yield from decode_rounds(speculator, self.model, batch, options, stop, stop_tokens,
                                         generator, logprobs, self.tokenizer)
                break

    def _sample(self, batch: Batch, logits: torch.Tensor, cur_pos: int, options: SamplingOptions,
                stop_tokens: Optional[torch.Tensor], generator: Optional[torch.Generator]) -> tuple[torch.Tensor, list[int]]:
        """A token for cur_pos of every row, from the last logits [bsz, vocab], with all options
        applied: every row in one call of the batched sampler (the repetition penalty reads the
        rows' tokens on the device, batch.tokens), as rank 0 chose them (choices.py): on the
        device [bsz] and on the host, read back once. stop_tokens: those min_gen_len bans."""
        vocab = logits.shape[-1]
        history = batch.tokens[:, :cur_pos] if options.repetition_penalty != 1.0 else None
        suppress = None
        # Decided from the host-side lengths: no mask, and no device sync, once every row is past
        # min_gen_len (or without one: a row still reading its prompt needs no mask either).
        if options.min_gen_len and any(cur_pos - length < options.min_gen_len for length in batch.lengths):
            suppress = stop_ban(cur_pos - batch.lengths_tensor, options.min_gen_len, stop_tokens, vocab)
        draw = sample(logits, [options] * len(batch.lengths), generator, history, suppress)
        sampled, rows = agreed_tokens(draw)
        if batch.top_ids is not None:
            batch.top_ids[:, cur_pos], batch.top_probs[:, cur_pos] = top_candidates(
                logits, options, batch.top_ids.shape[-1], history, suppress
            )
        return sampled, [int(row[0]) for row in rows]


def adjustments_applied(adjustments: list, logits: torch.Tensor) -> torch.Tensor:
    """structured/rows.py's adjust_rows, imported only where a constraint was asked for."""
    from .structured.rows import adjust_rows

    return adjust_rows(adjustments, logits)
