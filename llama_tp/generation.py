"""The public API: build a tensor-parallel Llama, then generate, complete text or chat.

Every rank calls the same methods with the same arguments in lockstep and gets the same result.
"""

import time
from pathlib import Path
from typing import Optional, TypedDict

import torch
import torch.nn.functional as F

from . import parallel
from .args import ModelArgs
from .chat_format import UNSAFE_ERROR, Dialog, Message, chat_format_for
from .checkpoint import load_model
from .model import Transformer
from .quantize import check_quantize, quantize_model
from .sampling import next_token
from .tokenizer import load_tokenizer

# Fills the not-yet-generated positions; never a real token id, ignored by the logprob loss.
NO_TOKEN = -1


class CompletionPrediction(TypedDict, total=False):
    generation: str
    tokens: list[str]  # not required
    logprobs: list[float]  # not required


class ChatPrediction(TypedDict, total=False):
    generation: Message
    tokens: list[str]  # not required
    logprobs: list[float]  # not required


class Llama:
    @staticmethod
    def build(
        ckpt_dir: str,
        tokenizer_path: str,
        max_seq_len: int,
        max_batch_size: int,
        model_parallel_size: Optional[int] = None,
        seed: int = 1,
        dtype: "str | torch.dtype | None" = None,
        quantize: Optional[str] = None,
    ) -> "Llama":
        """Join the process group, load this rank's slice of the checkpoint, and return a generator.

        dtype: "bf16", "fp16" or "fp32"; by default bf16 (or fp16) on GPU and fp32 on CPU.
        quantize: "int8" (weight-only) or "int8_dynamic" (fbgemm, CPU fp32) linear layers; see quantize.py.
        """
        check_quantize(quantize)
        for name, value in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, found {value!r}")
        ckpt_dir = Path(ckpt_dir)
        args = ModelArgs.load(ckpt_dir / "params.json")
        tokenizer = load_tokenizer(tokenizer_path)
        args = args.with_vocab_size(tokenizer.n_words)
        placement = parallel.init(model_parallel_size)
        args.check_model_parallel_size(placement.world_size)
        torch.manual_seed(seed)  # the same on every rank, so sampling agrees without talking

        start = time.perf_counter()
        dtype = parallel.resolve_dtype(dtype, placement.device)
        model = quantize_model(load_model(ckpt_dir, args, placement, dtype), quantize)
        model.setup_caches(max_batch_size, max_seq_len, placement.device, dtype)
        parallel.print0(f"Loaded in {time.perf_counter() - start:.2f} seconds")
        return Llama(model, tokenizer)

    def __init__(self, model: Transformer, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.formatter = chat_format_for(tokenizer)

    @torch.inference_mode()
    def generate(
        self,
        prompt_tokens: list[list[int]],
        max_gen_len: int,
        temperature: float = 0.6,
        top_p: float = 0.9,
        logprobs: bool = False,
        echo: bool = False,
    ) -> tuple[list[list[int]], Optional[list[list[float]]]]:
        """Continue each prompt by up to max_gen_len tokens, stopping at the tokenizer's stop tokens.

        More prompts than max_batch_size are run in consecutive batches.
        Returns the generated tokens (prompt included with echo) and, with logprobs, the log
        probability of each returned token.
        """
        self._check_generate_args(prompt_tokens, max_gen_len, temperature, top_p)
        batch = self.model.max_batch_size
        all_tokens, all_logprobs = [], []
        for first in range(0, len(prompt_tokens), batch):
            tokens, token_logprobs = self._generate_batch(
                prompt_tokens[first : first + batch], max_gen_len, temperature, top_p, logprobs, echo
            )
            all_tokens += tokens
            all_logprobs += token_logprobs
        return all_tokens, (all_logprobs if logprobs else None)

    def _generate_batch(self, prompts: list[list[int]], max_gen_len: int, temperature: float,
                        top_p: float, logprobs: bool, echo: bool) -> tuple[list[list[int]], list[list[float]]]:
        """Meta's schedule: decode from the shortest prompt; longer prompts feed their own tokens."""
        device = self.model.rotary.device
        bsz = len(prompts)
        lengths = [len(p) for p in prompts]
        total_len = min(self.model.max_seq_len, max_gen_len + max(lengths))
        tokens = torch.full((bsz, total_len), NO_TOKEN, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=device)
        is_prompt = torch.arange(total_len, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
        token_logprobs = torch.zeros(bsz, total_len, dtype=torch.float, device=device)
        stop_tokens = torch.tensor(sorted(self.tokenizer.stop_tokens), device=device)
        stopped = torch.zeros(bsz, dtype=torch.bool, device=device)

        prev_pos = 0
        min_len = min(lengths)
        if min_len == total_len > 1 and logprobs:  # nothing to generate: score the prompts
            logits = self.model.forward(tokens[:, :-1], 0)
            token_logprobs[:, 1:] = _logprobs_of(logits, tokens[:, 1:])
        for cur_pos in range(min_len, total_len):
            logits = self.model.forward(tokens[:, prev_pos:cur_pos], prev_pos, last_only=not logprobs)
            sampled = next_token(logits[:, -1], temperature, top_p)
            sampled = torch.where(is_prompt[:, cur_pos], tokens[:, cur_pos], sampled)
            tokens[:, cur_pos] = sampled
            if logprobs:
                token_logprobs[:, prev_pos + 1 : cur_pos + 1] = _logprobs_of(logits, tokens[:, prev_pos + 1 : cur_pos + 1])
            stopped |= ~is_prompt[:, cur_pos] & torch.isin(sampled, stop_tokens)
            prev_pos = cur_pos
            if bool(stopped.all()):
                break

        out_tokens, out_logprobs = [], []
        for row, (row_tokens, row_logprobs) in enumerate(zip(tokens.tolist(), token_logprobs.tolist())):
            prompt_len = lengths[row]
            end = prompt_len + max_gen_len
            # Cut at the first stop token among the generated ones (a chat prompt may hold some).
            for position in range(prompt_len, min(end, total_len)):
                if row_tokens[position] in self.tokenizer.stop_tokens:
                    end = position
                    break
            start = 0 if echo else prompt_len
            out_tokens.append(row_tokens[start:end])
            out_logprobs.append(row_logprobs[start:end])
        return out_tokens, out_logprobs

    def text_completion(
        self,
        prompts: list[str],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        echo: bool = False,
    ) -> list[CompletionPrediction]:
        """Continue each text prompt; max_gen_len defaults to the whole context."""
        if max_gen_len is None:
            max_gen_len = self.model.max_seq_len - 1
        prompt_tokens = [self.tokenizer.encode(x, bos=True, eos=False) for x in prompts]
        generation_tokens, generation_logprobs = self.generate(
            prompt_tokens, max_gen_len, temperature, top_p, logprobs, echo
        )
        results = []
        for row, tokens in enumerate(generation_tokens):
            result: CompletionPrediction = {"generation": self.tokenizer.decode(tokens)}
            if logprobs:
                result["tokens"] = [self.tokenizer.decode([t]) for t in tokens]
                result["logprobs"] = generation_logprobs[row]
            results.append(result)
        return results

    def chat_completion(
        self,
        dialogs: list[Dialog],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
    ) -> list[ChatPrediction]:
        """The assistant's next message for each dialog, in the chat format the tokenizer implies."""
        if max_gen_len is None:
            max_gen_len = self.model.max_seq_len - 1
        prompt_tokens = [self.formatter.encode_dialog_prompt(dialog) for dialog in dialogs]
        safe = [row for row, dialog in enumerate(dialogs) if not self.formatter.is_unsafe(dialog)]
        generated, generated_logprobs = self.generate(
            [prompt_tokens[row] for row in safe], max_gen_len, temperature, top_p, logprobs
        ) if safe else ([], [])
        results: list[ChatPrediction] = [
            {"generation": {"role": "assistant", "content": UNSAFE_ERROR}} for _ in dialogs
        ]
        for row, tokens in zip(safe, generated):
            results[row] = {"generation": {"role": "assistant", "content": self.tokenizer.decode(tokens)}}
        if logprobs:
            for result in results:
                result["tokens"], result["logprobs"] = [], []
            for index, (row, tokens) in enumerate(zip(safe, generated)):
                results[row]["tokens"] = [self.tokenizer.decode([t]) for t in tokens]
                results[row]["logprobs"] = generated_logprobs[index]
        return results

    def _check_generate_args(self, prompt_tokens: list[list[int]], max_gen_len: int,
                             temperature: float, top_p: float) -> None:
        if not isinstance(max_gen_len, int) or max_gen_len < 1:
            raise ValueError(f"max_gen_len must be a positive integer, found {max_gen_len!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be 0 (greedy) or more, found {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], found {top_p}")
        vocab = self.model.args.vocab_size
        for row, prompt in enumerate(prompt_tokens):
            if len(prompt) == 0:
                raise ValueError(f"prompt {row} is empty; it needs at least one token (begin with bos)")
            if len(prompt) > self.model.max_seq_len:
                raise ValueError(
                    f"prompt {row} has {len(prompt)} tokens but max_seq_len is "
                    f"{self.model.max_seq_len}; shorten the prompt or raise --max_seq_len"
                )
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {row} holds a token id outside [0, {vocab})")


def _logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) under logits [bsz, seqlen, vocab] for targets [bsz, seqlen]; 0 where no token yet."""
    return -F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=NO_TOKEN)
