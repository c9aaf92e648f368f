"""The public API: build a tensor-parallel Llama, then generate, complete text or chat.

Every rank calls the same methods with the same arguments in lockstep and gets the same result.
"""

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional, TypedDict

import torch

from . import parallel
from .model.args import ModelArgs
from .checkpoint import load_model, open_checkpoint
from .checkpoint.draft import load_draft
from .checkpoint.record import read_record
from .context import check_max_seq_len, trained_context
from .decoding import Decoding, decoding
from .engine import JOB_PREFILL_TOKENS, Engine, GenerationRequest, Observer, prompt_seeds, run_job
from .engine.blocks import BlockPool
from .engine.speculative import Speculator, check_speculation, guesses_a_round, make_speculator
from .kernels import matmul
from .logs import logger
from .model.memory import (KV_CACHE_FRACTION, cache_in_free_memory, check_fits, check_fraction, free_memory, plan,
                           report, sizes_cache_from_free_memory)
from .model.transformer import Transformer
from .model.quantize import check_quantize_on
from .sampling import SamplingOptions
from .structured.constraint import Constraint, from_response_format
from .text.chat_format import UNSAFE_ERROR, Dialog, Message, chat_format_for, encode_dialog
from .text.hf_tokenizer import HFTokenizer
from .text.reasoning import ReasoningParser, Split, Thinking, check_parser_name, parser_for
from .text.streaming import TextStream, check_stop, cut_at_stop
from .text.tokenizer import load_tokenizer

class CompletionPrediction(TypedDict, total=False):
    generation: str
    tokens: list[str]  # not required
    logprobs: list[float]  # not required
    top: list[list[tuple[str, float]]]  # with show_top: each step's most likely candidates
    token_ids: list[int]  # with token_ids=True


class ChatPrediction(TypedDict, total=False):
    generation: Message
    tokens: list[str]  # not required
    logprobs: list[float]  # not required
    token_ids: list[int]  # with token_ids=True


@dataclass
class Answer:
    """One prompt's answer as the engine ended it: the returned tokens (the prompt's first, with
    echo), their log probabilities where asked, and each generated token's likeliest candidates."""

    tokens: list[int]
    logprobs: list[float]
    top: list[tuple[tuple[int, float], ...]]


class Llama:
    @staticmethod
    def build(
        ckpt_dir: Optional[str] = None,
        tokenizer_path: Optional[str] = None,
        max_seq_len: int = 512,
        max_batch_size: int = 4,
        model_parallel_size: Optional[int] = None,
        seed: int = 1,
        dtype: "str | torch.dtype | None" = None,
        quantize: Optional[str] = None,
        compile: Optional[bool] = None,
        speculate: Optional[str] = None,
        speculate_k: Optional[int] = None,
        draft_ckpt_dir: Optional[str] = None,
        draft_quantize: Optional[str] = None,
        reasoning_parser: Optional[str] = None,
        kv_cache_memory: Optional[float] = None,
        kv_cache_fraction: float = KV_CACHE_FRACTION,
    ) -> "Llama":
        """Join the process group, load this rank's slice of the checkpoint, and return a generator.

        Without paths, the built-in demo model (fetched and converted on first use); without a
        tokenizer_path, the tokenizer in the checkpoint folder.

        dtype: "bf16", "fp16" or "fp32"; by default bf16 (or fp16) on GPU and fp32 on CPU.
        quantize: "int8" (weight-only) or "int8_dynamic" (fbgemm, CPU fp32) linear layers; see model/quantize.py.
        compile: run decoding steps through torch.compile (CUDA graphs on GPUs). By default on GPUs,
            where eager steps are bound by launching some 25 kernels a layer; a failure to compile
            is one warning and eager decoding. Off by default on CPUs: on this project's CPUs
            with AVX-512 eager steps call our kernels for the products and for each layer's
            attention step, and compiled ones (the rest fused) ran 1.07x as fast at batch 1 and
            level at batch 8 on the AMD Zen 4 machine, after 7-26 s of compiling. With
            speculation, a draft's steps are compiled (1.24x faster for the demo's int8 copy on a
            CPU); the target's verifying passes are compiled where its steps run whole (CUDA
            graphs), and elsewhere stay eager, through our kernels, whose several-token passes
            give each token exactly a one-token step's logits (with speculate="lookup", which has
            no draft, compile=True then compiles nothing and is refused).
        speculate: guess a few tokens a step and verify them in one pass (docs/speculative.md):
            "draft" (a draft model guesses: draft_quantize and/or draft_ckpt_dir) or "lookup"
            (guesses copied from where the last tokens appeared before in the prompt or output).
            Greedy tokens are those of decoding without it (exactly, where our CPU kernels run);
            sampled ones follow the same distribution.
        speculate_k: guesses a round, 1 to 15 (default: the mode's, tuned on the demo model).
        draft_ckpt_dir: the draft's checkpoint, sharing the tokenizer (default: the target's own).
        draft_quantize: the draft's linear layers, as quantize: "int8" alone makes the draft an
            int8 copy of the target.
        reasoning_parser: how the model marks its thinking, told apart from its answer in chat
            answers (docs/serving.md, "Reasoning"): "qwen3" or "deepseek_r1" (both
            `<think>...</think>`), "none"; by default the one the chat template clearly calls for.
        kv_cache_memory: GiB of keys and values a process holds, handed out to sequences by the
            block as they grow (engine/blocks.py); by default max_batch_size x max_seq_len
            positions' worth on a CPU; on a GPU, kv_cache_fraction of the memory free after loading.
            max_batch_size is then the most sequences that run at once, and max_seq_len each one's limit.
        kv_cache_fraction: on a GPU without kv_cache_memory, the share of the memory free once the
            weights (and a draft's) are loaded that the KV cache takes, less a pass's activations
            (vLLM's --gpu-memory-utilization, but of what is free); the smallest GPU's on every rank.
        """
        # First, so that every later mistake is found with the process group up (see cli.run).
        placement = parallel.init(model_parallel_size)
        check_quantize_on(quantize, placement.device)  # int4 without a kernel there: refused before loading
        if compile is None:
            compile = placement.device.type == "cuda" and (speculate != "lookup"
                                                           or parallel.steps_run_whole(placement.device))
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be True or False, found {compile!r}")
        check_speculation(speculate, speculate_k, draft_ckpt_dir, draft_quantize, compile,
                          compile and parallel.steps_run_whole(placement.device))
        check_quantize_on(draft_quantize, placement.device)
        check_parser_name(reasoning_parser)
        check_fraction(kv_cache_fraction)
        for name, value in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, found {value!r}")
        if ckpt_dir is None or tokenizer_path is None:
            from .tools.demo import model_paths  # the demo's download and conversion: only when asked for

            ckpt_dir, tokenizer_path = model_paths(ckpt_dir, tokenizer_path)
        ckpt_dir = Path(ckpt_dir)
        start = time.perf_counter()
        # Each rank reads its own files: a mistake seen by one rank must stop them all.
        with parallel.agreement("loading the model"):
            args = ModelArgs.load(ckpt_dir / "params.json")
            tokenizer = load_tokenizer(tokenizer_path)
            record = read_record(ckpt_dir)  # a converted model's chat format, stop tokens, sampling
            reasoning = parser_for(reasoning_parser, tokenizer, record.chat_template)
            tokenizer.stop_tokens = tokenizer.stop_tokens | set(record.stop_tokens)
            args = args.with_vocab_size(tokenizer.n_words, padded=isinstance(tokenizer, HFTokenizer))
            args.check_model_parallel_size(placement.world_size)
            check_max_seq_len(max_seq_len, trained_context(args, tokenizer, record))
            dtype = parallel.resolve_dtype(dtype, placement.device)
            checkpoint = open_checkpoint(ckpt_dir, args)  # an int8 checkpoint loads as int8
            memory = plan(args, placement.world_size, max_batch_size, max_seq_len, dtype,
                          quantize or checkpoint.quantization)
            sized_after_loading = kv_cache_memory is None and sizes_cache_from_free_memory(placement.device)
            if kv_cache_memory is not None:
                memory = replace(memory, cache_positions=memory.positions_in(kv_cache_memory))
            elif sized_after_loading:  # checked before loading with the least it may be: one sequence
                memory = replace(memory, cache_positions=max_seq_len)
            if not sized_after_loading:
                logger.info(report(memory))
                logger.info(memory.describe_cache())
            check_fits(memory, placement.device, placement.processes_here)
            model = load_model(ckpt_dir, args, placement, dtype, quantize,
                               pack=matmul.packing_pays(max_batch_size, compile, dtype), opened=checkpoint)
            k = guesses_a_round(speculate, speculate_k) if speculate is not None else 0
            if compile:
                compile_decoding(model, placement.device, verify_width=k + 1 if speculate is not None else None)
            draft, description = (load_draft(draft_ckpt_dir, draft_quantize, compile, ckpt_dir, checkpoint.args,
                                             placement, dtype, max_batch_size, max_seq_len, k)
                                  if speculate == "draft" else (None, ""))
            if sized_after_loading:  # every rank's cache as large as the fullest GPU's allows
                free, where = min(parallel.gather_objects(free_memory(placement.device)))
                memory = cache_in_free_memory(memory, free, where, kv_cache_fraction)
                logger.info(report(memory))
                logger.info(memory.describe_cache())
            model.setup_caches(max_batch_size, max_seq_len, placement.device, dtype, memory.kv_cache_positions)
            speculator = make_speculator(speculate, k, draft, description)
        torch.manual_seed(seed)  # the same on every rank, so sampling agrees without talking
        logger.info(f"Loaded in {time.perf_counter() - start:.2f} seconds")
        formatter = chat_format_for(tokenizer, record.chat_format, record.default_system_prompt, record.chat_template)
        return Llama(model, tokenizer, formatter, record.sampling, speculator, reasoning)

    def __init__(self, model: Transformer, tokenizer, formatter=None, sampling_defaults: Optional[dict] = None,
                 speculator: Optional[Speculator] = None, reasoning: Optional[ReasoningParser] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.formatter = formatter or chat_format_for(tokenizer)
        # The model's recommended temperature, top_p, top_k, repetition_penalty (checkpoint/record.py)
        self.sampling_defaults = dict(sampling_defaults or {})
        self.speculator = speculator  # None: one token a step
        # The KV cache's blocks, and the prefixes they hold for later prompts: every engine's in turn.
        self.block_pool: Optional[BlockPool] = None
        self.reasoning = reasoning  # None: the model does not think, or its thinking is left in its answers

    def warm_up(self) -> None:
        """Compile the model's decoding steps now (and a draft's), recording their CUDA graphs,
        rather than in the first requests' steps (Transformer.warm_up_decoding). Every rank calls it together."""
        self.model.warm_up_decoding()
        if self.speculator is not None and self.speculator.draft is not None:
            self.speculator.draft.model.warm_up_decoding()

    def engine(self, max_prefill_tokens: int = JOB_PREFILL_TOKENS, observer: Optional[Observer] = None,
               text: bool = False) -> Engine:
        """A fresh engine over this model, its cache rows and their record of what they hold, its
        speculator and grammars: what every door runs through. max_prefill_tokens: prompt tokens
        fed a step beside the generating rows; observer: told of what it does (a server's metrics);
        text: every request's deltas carry text (a server's, a stream's)."""
        if self.block_pool is None or self.block_pool.size != self.model.cache_blocks:
            self.block_pool = BlockPool(self.model.cache_blocks)
        self.block_pool.release_all()  # one engine at a time: what the one before held (unfinished) is free
        return Engine(self.model, self.tokenizer, max_prefill_tokens, self.speculator, self.grammars, observer, text,
                      self.block_pool)

    def forget_prefixes(self) -> None:
        """Prompts from now on are prefilled whole, sharing no blocks that earlier ones filled (a
        chat's /reset; a benchmark's cold prompts)."""
        self.model.prefix_cache.forget()
        if self.block_pool is not None:
            self.block_pool.forget()

    def grammars(self):
        """This model's compiled grammars (structured outputs), made on first use."""
        from .structured.grammars import grammars_for  # xgrammar (the serve extra), only when asked for

        return grammars_for(self)

    def sampling_options(self, temperature: Optional[float] = None, top_p: Optional[float] = None,
                         top_k: Optional[int] = None, repetition_penalty: Optional[float] = None,
                         min_gen_len: int = 0, seed: Optional[int] = None) -> SamplingOptions:
        """The options for these arguments: each one left at None is the model's recommended
        setting if its llama_tp.json has one, else Meta's default (SamplingOptions')."""
        given = dict(temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty)
        chosen = self.sampling_defaults | {name: value for name, value in given.items() if value is not None}
        return SamplingOptions(**chosen, min_gen_len=min_gen_len, seed=seed)

    @torch.inference_mode()
    def generate(
        self,
        prompt_tokens: list[list[int]],
        max_gen_len: int,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        logprobs: bool = False,
        echo: bool = False,
        top_k: Optional[int] = None,
        repetition_penalty: Optional[float] = None,
        stop: Optional[list[str]] = None,
        min_gen_len: int = 0,
        seed: "int | list[int] | None" = None,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        early_stopping: "bool | str" = False,
        num_return_sequences: int = 1,
        bad_words: Optional[list[str]] = None,
        logits_processors: Optional[list[Callable]] = None,
    ) -> tuple[list[list[int]], Optional[list[list[float]]]]:
        """Continue each prompt by up to max_gen_len tokens, stopping at the tokenizer's stop tokens.

        The prompts run through continuous batching on max_batch_size cache rows: a row whose
        answer ends takes the next prompt at the next step. Each prompt gets the answer it gets
        alone: greedy, the same tokens; sampled, its own generator, seeded for prompt i from
        seed (engine.prompt_seed: prompt 0 gets seed itself), or from a list of one seed per
        prompt (with speculation, a sampled answer depends on the rows beside it: engine/jobs.py).
        Sampling settings left at None are the model's recommended ones (its llama_tp.json), else
        Meta's: temperature 0.6, top_p 0.9, no top-k cut, no repetition penalty (see
        sampling_options).
        Returns the generated tokens (prompt included with echo) and, with logprobs, the log
        probability of each returned token. A row that produces one of the `stop` strings ends
        with the token that completed it (text_completion then cuts the text before the string).

        num_beams > 1: beam search, as transformers' generate(num_beams=..., length_penalty=...,
        early_stopping=..., num_return_sequences=...) runs it (temperature, top_p and top_k play
        no part); each prompt then has num_return_sequences answers, best first, prompt i's at
        i * num_return_sequences onwards. bad_words: words no answer may hold (every way each is
        tokenized, with and without a leading space). logits_processors: callables (generated
        token ids, logits [vocab]) -> logits, or (prompt ids, generated ids, logits) -> logits,
        run on rank 0 before each token is chosen (sampling/processors.py; docs/serving.md,
        "Decoding").
        """
        options = self.sampling_options(temperature, top_p, top_k, repetition_penalty, min_gen_len, _call_seed(seed))
        stop = check_stop(stop)
        asked = decoding(self.tokenizer, self.model.max_batch_size, num_beams, length_penalty, early_stopping,
                         num_return_sequences, bad_words, logits_processors, stop)
        self._check_generate_args(prompt_tokens, max_gen_len, options, (stop, logprobs, echo, asked.digest()), seed)
        answers = [Answer([], [], []) for _ in range(len(prompt_tokens) * asked.returned)]
        seeds = prompt_seeds(seed, len(prompt_tokens))
        for index, answer in self._generate(prompt_tokens, max_gen_len, options, stop, seeds, logprobs, echo,
                                            decoding=asked):
            answers[index] = answer
        return [answer.tokens for answer in answers], ([answer.logprobs for answer in answers] if logprobs else None)

    def text_completion(
        self,
        prompts: list[str],
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        echo: bool = False,
        top_k: Optional[int] = None,
        repetition_penalty: Optional[float] = None,
        stop: Optional[list[str]] = None,
        min_gen_len: int = 0,
        seed: "int | list[int] | None" = None,
        show_top: int = 0,
        token_ids: bool = False,
        on_result: Optional[Callable[[int, CompletionPrediction], None]] = None,
        response_format: Optional[dict] = None,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        early_stopping: "bool | str" = False,
        num_return_sequences: int = 1,
        bad_words: Optional[list[str]] = None,
        logits_processors: Optional[list[Callable]] = None,
    ) -> list[CompletionPrediction]:
        """Continue each text prompt; max_gen_len defaults to the whole context.

        The text ends before the first `stop` string. With show_top N, each result's "top" lists,
        for every generated token, the N most likely candidates and their probabilities; with
        token_ids, "token_ids" holds the generated token ids. seed as in generate. on_result(i,
        result) is called on every rank as prompt i's result is in (for writing results as they
        come); the list returned holds them all in the prompts' order. response_format: OpenAI's
        ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}).
        num_beams, length_penalty, early_stopping, num_return_sequences, bad_words and
        logits_processors as in generate (prompt i's num_return_sequences results at i *
        num_return_sequences onwards, row in on_result counting them).
        """
        if max_gen_len is None:
            max_gen_len = self.model.max_seq_len - 1
        options = self.sampling_options(temperature, top_p, top_k, repetition_penalty, min_gen_len, _call_seed(seed))
        stop = check_stop(stop)
        asked = decoding(self.tokenizer, self.model.max_batch_size, num_beams, length_penalty, early_stopping,
                         num_return_sequences, bad_words, logits_processors, stop, show_top, response_format)
        prompt_tokens = [self.tokenizer.encode(x, bos=True, eos=False) for x in prompts]
        constraint = self._constraint(response_format)
        self._check_generate_args(prompt_tokens, max_gen_len, options, (constraint, asked.digest()), seed=seed)
        results: list[CompletionPrediction] = [{} for _ in range(len(prompts) * asked.returned)]
        answers = self._generate(prompt_tokens, max_gen_len, options, stop, prompt_seeds(seed, len(prompts)),
                                 logprobs=logprobs, echo=echo, show_top=show_top, constraint=constraint,
                                 decoding=asked)
        for row, answer in answers:
            tokens = answer.tokens
            # With echo, a stop string inside the prompt does not count.
            start = len(self.tokenizer.decode(prompt_tokens[row // asked.returned])) if echo else 0
            result: CompletionPrediction = {"generation": cut_at_stop(self.tokenizer.decode(tokens), stop, start)}
            if logprobs:
                result["tokens"] = [self.tokenizer.decode([t]) for t in tokens]
                result["logprobs"] = answer.logprobs
            if token_ids:
                result["token_ids"] = tokens
            if show_top:
                result["top"] = [[(self.tokenizer.decode([t]), p) for t, p in step] for step in answer.top]
            results[row] = result
            if on_result is not None:
                on_result(row, result)
        return results

    def chat_completion(
        self,
        dialogs: list[Dialog],
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        top_k: Optional[int] = None,
        repetition_penalty: Optional[float] = None,
        stop: Optional[list[str]] = None,
        min_gen_len: int = 0,
        seed: "int | list[int] | None" = None,
        token_ids: bool = False,
        on_result: Optional[Callable[[int, ChatPrediction], None]] = None,
        response_format: Optional[dict] = None,
        chat_template_kwargs: Optional[dict] = None,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        early_stopping: "bool | str" = False,
        num_return_sequences: int = 1,
        bad_words: Optional[list[str]] = None,
        logits_processors: Optional[list[Callable]] = None,
    ) -> list[ChatPrediction]:
        """The assistant's next message for each dialog, in the chat format the tokenizer implies.

        With token_ids, "token_ids" holds the generated token ids (none for a refused dialog).
        seed and on_result as in text_completion (a refused dialog's result comes first).
        response_format: OpenAI's ({"type": "json_object"} or {"type": "json_schema",
        "json_schema": {"schema": ...}}): every answer follows it (a reasoning model's answer
        after its thinking). chat_template_kwargs: variables for the model's chat template, such
        as Qwen3's {"enable_thinking": False}. A reasoning model's message (Llama.reasoning) holds
        its thinking apart, in "reasoning_content". num_beams, length_penalty, early_stopping,
        num_return_sequences, bad_words and logits_processors as in generate (dialog i's
        num_return_sequences results at i * num_return_sequences onwards).
        """
        if max_gen_len is None:
            max_gen_len = self.model.max_seq_len - 1
        options = self.sampling_options(temperature, top_p, top_k, repetition_penalty, min_gen_len, _call_seed(seed))
        stop = check_stop(stop)
        asked = decoding(self.tokenizer, self.model.max_batch_size, num_beams, length_penalty, early_stopping,
                         num_return_sequences, bad_words, logits_processors, stop, response_format=response_format)
        returned = asked.returned
        prompt_tokens = [self._encode_dialog(dialog, index, chat_template_kwargs) for index, dialog in enumerate(dialogs)]
        safe = [row for row, dialog in enumerate(dialogs) if not self.formatter.is_unsafe(dialog)]
        safe_tokens = [prompt_tokens[row] for row in safe]
        constraint = self._constraint(response_format)
        self._check_generate_args(safe_tokens, max_gen_len, options, (constraint, asked.digest()), seed=seed,
                                  prompts=len(dialogs))
        results: list[ChatPrediction] = [{} for _ in range(len(dialogs) * returned)]
        thinking = [self.reasoning.thinking(prompt) for prompt in safe_tokens] if self.reasoning else None

        def answered(row: int, tokens: list[int], token_logprobs: list[float], text: str,
                     answer_thinking: Optional[Thinking] = None) -> None:
            message: Message = {"role": "assistant", "content": text}
            if self.reasoning is not None:
                split = answer_thinking.split(text) if answer_thinking else Split(content=text)
                message = {"role": "assistant", "content": split.content, "reasoning_content": split.reasoning}
            result: ChatPrediction = {"generation": message}
            if token_ids:
                result["token_ids"] = tokens
            if logprobs:
                result["tokens"] = [self.tokenizer.decode([t]) for t in tokens]
                result["logprobs"] = token_logprobs
            results[row] = result
            if on_result is not None:
                on_result(row, result)

        for row in sorted(set(range(len(dialogs))) - set(safe)):
            for place in range(row * returned, (row + 1) * returned):
                answered(place, [], [], UNSAFE_ERROR)

        if safe:  # each dialog keeps the seed of its place in the call
            seeds = prompt_seeds(seed, len(dialogs)) if seed is not None else None
            seeds = [seeds[row] for row in safe] if seeds else prompt_seeds(None, len(safe))
            answers = self._generate(safe_tokens, max_gen_len, options, stop, seeds, logprobs=logprobs,
                                     stop_tokens=self.formatter.stop_tokens, constraint=constraint, thinking=thinking,
                                     decoding=asked)
            for index, answer in answers:
                prompt, beam = divmod(index, returned)
                answered(safe[prompt] * returned + beam, answer.tokens, answer.logprobs,
                         cut_at_stop(self.tokenizer.decode(answer.tokens), stop), thinking[prompt] if thinking else None)
        return results

    def stream_text_completion(
        self,
        prompt: str,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        max_gen_len: Optional[int] = None,
        top_k: Optional[int] = None,
        repetition_penalty: Optional[float] = None,
        stop: Optional[list[str]] = None,
        min_gen_len: int = 0,
        seed: Optional[int] = None,
        bad_words: Optional[list[str]] = None,
    ) -> TextStream:
        """text_completion of one prompt as a stream of text pieces (see TextStream); bad_words as in generate."""
        prompt_tokens = self.tokenizer.encode(prompt, bos=True, eos=False)
        options = self.sampling_options(temperature, top_p, top_k, repetition_penalty, min_gen_len, seed)
        return self._stream(prompt_tokens, max_gen_len, options, stop, bad_words=bad_words)

    def stream_chat_completion(
        self,
        dialog: Dialog,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        max_gen_len: Optional[int] = None,
        top_k: Optional[int] = None,
        repetition_penalty: Optional[float] = None,
        stop: Optional[list[str]] = None,
        min_gen_len: int = 0,
        seed: Optional[int] = None,
        bad_words: Optional[list[str]] = None,
    ) -> TextStream:
        """The assistant's reply to one dialog as a stream of text pieces (see TextStream); bad_words as in generate."""
        prompt_tokens = self.formatter.encode_dialog_prompt(dialog)
        options = self.sampling_options(temperature, top_p, top_k, repetition_penalty, min_gen_len, seed)
        if self.formatter.is_unsafe(dialog):
            options.check()
            return TextStream(_refusal)
        return self._stream(prompt_tokens, max_gen_len, options, stop, self.formatter.stop_tokens, bad_words)

    def _stream(self, prompt_tokens: list[int], max_gen_len: Optional[int], options: SamplingOptions,
                stop: Optional[list[str]], stop_tokens: Optional[set[int]] = None,
                bad_words: Optional[list[str]] = None) -> TextStream:
        """Check the arguments now, then generate lazily, one piece per step that completes text."""
        if max_gen_len is None:
            max_gen_len = self.model.max_seq_len - 1
        stop = check_stop(stop)
        asked = decoding(self.tokenizer, self.model.max_batch_size, bad_words=bad_words)
        self._check_generate_args([prompt_tokens], max_gen_len, options, (asked.digest(),))

        def run(stream: TextStream) -> Iterator[str]:
            requests = self._requests([prompt_tokens], max_gen_len, options, stop, prompt_seeds(options.seed, 1),
                                      stop_tokens=stop_tokens, decoding=asked)
            for updates in run_job(self.engine(text=True), requests):
                for update in updates:
                    if update.delta.text:
                        yield update.delta.text
                    if update.delta.finished:
                        stream.tokens = update.sequence.sampling.answer
            stream.text = cut_at_stop(self.tokenizer.decode(stream.tokens), stop)

        return TextStream(run)

    def _generate(self, prompts: list[list[int]], max_gen_len: int, options: SamplingOptions, stop: tuple[str, ...],
                  seeds: list[int], logprobs: bool = False, echo: bool = False, show_top: int = 0,
                  stop_tokens: Optional[set[int]] = None, constraint: Optional[Constraint] = None,
                  thinking: Optional[list[Optional[Thinking]]] = None,
                  decoding: Decoding = Decoding()) -> Iterator[tuple[int, Answer]]:
        """Each prompt's answer through the engine, as it ends (prompt i's as (i, answer); with
        beam search's R answers a prompt, its j-th best as (i * R + j, answer)); a prompt that
        fills the context answers nothing (its own tokens, with echo)."""
        requests = self._requests(prompts, max_gen_len, options, stop, seeds, logprobs, echo, show_top, stop_tokens,
                                  constraint, thinking, decoding)
        held = {request.id for request, _ in requests}
        returned = decoding.returned
        for index, prompt in enumerate(prompts):
            if str(index) not in held:
                for place in range(index * returned, (index + 1) * returned):
                    yield place, Answer(list(prompt) if echo else [], [], [])
        dead_ends = []  # prompts whose grammar allowed no next token: refused once the others are answered
        for updates in run_job(self.engine(), requests):
            for update in updates:
                if update.delta.finished:
                    index = int(update.sequence.request.id)
                    if update.delta.finish_reason == "error":
                        dead_ends.append((index, update.sequence.generated))
                    elif decoding.beams is not None:
                        for beam in range(returned):
                            yield index * returned + beam, _beam_answer(prompts[index], update, beam, echo)
                    else:
                        yield index, _answer(prompts[index], update.sequence.sampling, echo)
        if dead_ends:
            index, generated = dead_ends[0]
            raise ValueError(f"response_format: the answer of prompt {index} cannot go on: its grammar allows no "
                             f"token after {generated} tokens; loosen it")

    def _requests(self, prompts: list[list[int]], max_gen_len: int, options: SamplingOptions, stop: tuple[str, ...],
                  seeds: list[int], logprobs: bool = False, echo: bool = False, show_top: int = 0,
                  stop_tokens: Optional[set[int]] = None, constraint: Optional[Constraint] = None,
                  thinking: Optional[list[Optional[Thinking]]] = None,
                  decoding: Decoding = Decoding()) -> list[tuple[GenerationRequest, int]]:
        """The engine's request for each prompt (its id, the prompt's place), with its seed. The
        answer ends at stop_tokens (by default the tokenizer's; a chat format may add its end of
        turn), and at a constraint's own. A prompt that leaves no room to generate has none,
        unless its own log probabilities are asked for (echo with logprobs)."""
        stop_tokens = set(stop_tokens or self.tokenizer.stop_tokens)
        if constraint is not None:  # a finished grammar allows only these
            stop_tokens |= self.grammars().stop_tokens
        requests = []
        for index, (prompt, seed) in enumerate(zip(prompts, seeds)):
            room = min(max_gen_len, self.model.max_seq_len - len(prompt))
            decoding.check_fits(index, len(prompt), room, self.model.cache_blocks)
            if room > 0 or (logprobs and echo):
                request = GenerationRequest(str(index), tuple(prompt), room, options, frozenset(stop_tokens), stop,
                                            logprobs, top_candidates=show_top, prompt_logprobs=logprobs and echo,
                                            constraint=constraint, thinking=thinking[index] if thinking else None,
                                            bad_words=decoding.bad_words, beams=decoding.beams,
                                            logits_processors=decoding.processors)
                requests.append((request, seed))
        return requests

    def _constraint(self, response_format: Optional[dict]) -> Optional[Constraint]:
        """response_format as a compiled Constraint (None for plain text); ValueError if it is not one."""
        if response_format is not None and not isinstance(response_format, dict):
            raise ValueError(f"response_format must be a dict such as {{'type': 'json_object'}}, found {response_format!r}")
        try:
            constraint = from_response_format(response_format)
            if constraint is not None:
                from .structured.grammars import grammars_for

                grammars_for(self).compile(constraint)
        except ValueError as error:
            raise ValueError(f"response_format {error}") from None
        return constraint

    def _encode_dialog(self, dialog: Dialog, index: int, template_variables: Optional[dict] = None) -> list[int]:
        """The dialog's prompt tokens; a malformed dialog's error names it within the batch."""
        try:
            return encode_dialog(self.formatter, dialog, template_variables)
        except ValueError as error:
            raise ValueError(f"dialog {index}: {error}") from None

    def _check_generate_args(self, prompt_tokens: list[list[int]], max_gen_len: int,
                             options: SamplingOptions, other_args: tuple = (), seed: "int | list[int] | None" = None,
                             prompts: Optional[int] = None) -> None:
        """Refuse bad arguments, and arguments that differ between ranks (the decode would hang).
        prompts: how many seeds a list of them must hold (by default one per prompt_tokens)."""
        parallel.check_same_on_every_rank("the generation arguments",
                                          (prompt_tokens, max_gen_len, options, other_args, seed))
        check_seeds(seed, len(prompt_tokens) if prompts is None else prompts)
        if not isinstance(max_gen_len, int) or max_gen_len < 1:
            raise ValueError(f"max_gen_len must be a positive integer, found {max_gen_len!r}")
        options.check()
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


def compile_decoding(model: Transformer, device: torch.device, verify_width: Optional[int] = None) -> None:
    """Compile the model's one-token steps the way that suits the device. verify_width: the model
    verifies speculation's guesses in passes of up to this many tokens a row, compiled with its
    one-token steps where they run whole; elsewhere the model stays eager (see Llama.build).
    Without speculation, where steps run whole, so do those that take in prompt chunks beside the
    decoding rows (the engine mixes them only then)."""
    compilation = parallel.decode_compilation(device)
    if verify_width is not None and not compilation.graphs:
        return
    model.compile_decoding(compilation.graphs, verify_width, mix_prompts=verify_width is None, **compilation.options)


def _refusal(stream: TextStream) -> Iterator[str]:
    """What stream_chat_completion yields for a dialog that smuggles in control tags."""
    stream.text = UNSAFE_ERROR
    yield UNSAFE_ERROR


def _answer(prompt: list[int], progress, echo: bool) -> Answer:
    """A finished sequence's Answer (progress: its engine.progress.Progress)."""
    logprobs = [entry.logprob for entry in progress.logprobs]
    if echo:
        return Answer(list(prompt) + progress.answer, progress.prompt_logprobs + logprobs, progress.candidates)
    return Answer(list(progress.answer), logprobs, progress.candidates)


def _beam_answer(prompt: list[int], update, beam: int, echo: bool) -> Answer:
    """A beam search's beam-th best answer from its last update (none where fewer came back)."""
    answers = update.delta.beams
    tokens = list(answers[beam].tokens) if beam < len(answers) else []
    logprobs = [entry.logprob for entry in answers[beam].logprobs] if beam < len(answers) else []
    if echo:
        return Answer(list(prompt) + tokens, update.sequence.sampling.prompt_logprobs + logprobs, [])
    return Answer(tokens, logprobs, [])


def _call_seed(seed: "int | list[int] | None") -> Optional[int]:
    """The options' seed: the call's, or None where each prompt's own is given."""
    return None if isinstance(seed, list) else seed


def check_seeds(seed: "int | list[int] | None", count: int) -> None:
    """Refuse a list of seeds that is not one integer per prompt (an int or None is checked with the options)."""
    if not isinstance(seed, list):
        return
    if len(seed) != count or not all(isinstance(s, int) and not isinstance(s, bool) for s in seed):
        raise ValueError(f"seed must be an integer or a list of one integer per prompt ({count}), found {seed!r}")
