"""The Llama transformer, with each rank holding its slice of every weight matrix.

The math is Meta's reference; parallel layers come from `parallel`, and the model never talks
to other processes itself.
"""

import itertools
import time
from functools import partial
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_kernels
from ..logs import logger
from ..parallel import EmbeddingLayout, all_gather_last_dim, column_parallel_linear, gather_objects, parallel_embedding
from .args import ModelArgs
from .attention import Attention
from .block_attention import MIN_HEAD_DIM, StepMasks
from .feed_forward import FeedForward, MixtureOfExperts
from .kv_cache import (BLOCK_POSITIONS, BlockTables, CacheRows, KVCache, block_positions, blocks_for, places,
                       step_through_kernel)
from .layer_step import quantized_layers_step
from .norm import RMSNorm
from .prefix_cache import PrefixCache
from .rotary import rotary_table
from .step_graphs import StepGraphs

__all__ = ["FeedForward", "MixtureOfExperts", "Transformer"]


# The most layers one compiled decoding call runs (see Transformer.compile_decoding).
MAX_LAYERS_PER_CALL = 10
# The most rows of a verifying step's graphs (speculation's k + 1 tokens a row); a round of more
# rows verifies in steps of this many (StepGraphs.run). A graph keeps its output for each rung and
# head: [rows, k + 1, vocab] fp32, 3.6 MB a row for Llama 3's vocabulary and k = 6, seven times a
# one-token step's.
VERIFY_MAX_ROWS = 16
# The prompt rows (of BLOCK_POSITIONS tokens) a whole step takes in beside its decoding rows
# (mixed_step): the server's 256 prompt tokens a step (launch/serve.py's max_prefill_tokens) as
# one prompt's chunk, or two prompts' sharing them. Chunks that need more rows go on in whole
# steps of prompt rows alone, a row's whole step padded to this many.
MIXED_PROMPT_ROWS = 5
# The most versions of a compiled decoding function kept (rungs of the ladder x heads x step widths, with room).
RECOMPILE_LIMIT = 64


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, model_parallel_size: int, layer: int = 0):
        super().__init__()
        self.attention = Attention(args, model_parallel_size, layer)
        if args.has_experts(layer):
            self.feed_forward = MixtureOfExperts(args, model_parallel_size)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim, model_parallel_size)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, rows: CacheRows) -> torch.Tensor:
        """x [bsz, seqlen, dim] placed in the caches as rows says."""
        if rows.kernel_starts is not None and not torch.compiler.is_compiling():
            return self._step_through_kernels(x, rows)
        h = x + self.attention(self.attention_norm(x), rows)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward_segments(self, x: torch.Tensor, segments: list[tuple[int, int, CacheRows]]) -> torch.Tensor:
        """x [1, tokens, dim]: several batches' tokens one after another (Transformer.forward_segments),
        each segment's (bsz, seqlen, rows) saying how many are its and where they sit. Every product
        takes all the tokens at once; each segment attends on its own."""
        attention = self.attention
        qkv = attention.project(self.attention_norm(x))[0]  # tokens, sum(local_widths)
        outs, first = [], 0
        for bsz, seqlen, rows in segments:
            part = qkv[first : first + bsz * seqlen].view(bsz, seqlen, -1)
            first += bsz * seqlen
            outs.append(attention.attend_projected(part, rows).flatten(0, 1))
        h = x + attention.wo(torch.cat(outs)[None])
        return h + self.feed_forward(self.ffn_norm(h))

    def _step_through_kernels(self, x: torch.Tensor, rows: CacheRows) -> torch.Tensor:
        """Eagerly, a step of a few tokens a row where our CPU kernels attend (fp32): the same
        operations, with our kernels' norms and attention (Attention.attend_projected), and the
        layer's parts called as functions rather than through their modules: 0.8-1.0 ms less
        Python in a 6 ms step of the demo model in int4. Forward hooks on the parts do not run here."""
        attention, feed_forward = self.attention, self.feed_forward
        norm = self.attention_norm
        x_normed = cpu_kernels.rms_norm(x, norm.weight, norm.eps)
        plain = attention.qkv_bias is None and attention.q_norm is None
        qkv = attention.wqkv.forward(x_normed) if plain else attention.project(x_normed)
        h = x + attention.wo.forward(attention.attend_projected(qkv, rows))
        norm = self.ffn_norm
        h_normed = cpu_kernels.rms_norm(h, norm.weight, norm.eps)
        if not isinstance(feed_forward, FeedForward):
            return h + feed_forward(h_normed)
        gate, up = feed_forward.w13.forward(h_normed).split(feed_forward.local_widths, dim=-1)
        return h + feed_forward.w2.forward(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, model_parallel_size: int, embedding_layout: EmbeddingLayout):
        super().__init__()
        if args.vocab_size < 1:
            raise ValueError("ModelArgs.vocab_size must be known (fill it from the tokenizer) before building")
        self.args = args
        self.tok_embeddings = parallel_embedding(args.vocab_size, args.dim, embedding_layout)
        self.layers = nn.ModuleList(TransformerBlock(args, model_parallel_size, layer) for layer in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        # Each rank's slice of the vocabulary, gathered in run_head unless the caller picks from slices.
        self.output = column_parallel_linear(args.dim, args.vocab_size, gather_output=False)
        self.max_batch_size = 0
        self.max_seq_len = 0
        self.cache_blocks = 0
        self.window: Optional[int] = None  # the sliding window where it hides positions (setup_caches)
        self.chunk: Optional[int] = None  # Llama 4's attention chunk where it hides positions (setup_caches)
        # One new token per row: eager, or compile_decoding's (which runs the layers in groups).
        self.decode_eagerly()

    def checkpoint_layout(self) -> dict[str, list[tuple[str, torch.Size]]]:
        """Each tensor of this model as the checkpoint tensors it is made of, stacked along dim 0,
        with the shape each has on this rank."""
        layout = {name: [(name, tensor.shape)] for name, tensor in self.state_dict().items()}
        for prefix, module in self.named_modules():
            if isinstance(module, (Attention, FeedForward)):
                fused, parts = module.FUSED
                for tensor in getattr(module, fused).state_dict():  # weight; an int8 layer's scales, zeros too
                    name = f"{prefix}.{fused}.{tensor}"
                    columns = layout[name][0][1][1]
                    layout[name] = [(f"{prefix}.{part}.{tensor}", torch.Size([rows, columns]))
                                    for part, rows in zip(parts, module.local_widths)]
            if isinstance(module, Attention) and module.qkv_bias is not None:
                layout[f"{prefix}.qkv_bias"] = [(f"{prefix}.{part}.bias", torch.Size([rows]))
                                                for part, rows in zip(module.FUSED[1], module.local_widths)]
        return layout

    def setup_caches(self, max_batch_size: int, max_seq_len: int, device: torch.device, dtype: torch.dtype,
                     cache_positions: Optional[int] = None) -> None:
        """Allocate the KV caches (kv_cache.py: a pool of blocks holding cache_positions positions,
        by default every row's max_seq_len, and a scratch block) and the rotary table for these
        runtime limits: max_batch_size rows a step, each up to max_seq_len positions long. Where
        decoding steps run at the sizes of a ladder (compile_decoding's graphs), one cache row
        more, which the padding rows write (spare_slot), its every position in the scratch block."""
        blocks_per_row = blocks_for(max_seq_len)
        if cache_positions is None:
            cache_positions = max_batch_size * blocks_per_row * BLOCK_POSITIONS
        if cache_positions < max_seq_len:
            raise ValueError(f"a KV cache of {cache_positions} positions cannot hold one sequence of max_seq_len "
                             f"{max_seq_len}; give it more memory or lower max_seq_len")
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.cache_blocks = blocks_for(cache_positions)  # the blocks the engine hands out (engine/blocks.py)
        blocks = self.cache_blocks + 1
        # A sliding window as long as the caches hides nothing: then attention runs as without one.
        window, chunk = self.args.sliding_window, self.args.attention_chunk_size
        self.window = window if window is not None and window < max_seq_len else None
        self.chunk = chunk if chunk is not None and chunk < max_seq_len else None
        # Our CPU attention kernel reads each row from position 0, rotating every layer's queries.
        kernel_fits = self.window is None and self.chunk is None and self.args.nope_layer_interval is None
        self.register_buffer("rotary", rotary_table(self.args, max_seq_len).to(device), persistent=False)
        self.register_buffer("positions", torch.arange(max_seq_len, device=device), persistent=False)
        self.register_buffer("slot_ids", torch.arange(max_batch_size, device=device), persistent=False)
        self.prefix_cache = PrefixCache(max_batch_size)
        self.block_tables = BlockTables(max_batch_size + self.whole_steps, blocks_per_row, blocks, device)
        for layer in self.layers:
            attention = layer.attention
            attention.cache = KVCache(blocks, attention.n_local_kv_heads, attention.head_dim, device, dtype,
                                      kernel_fits)
        if self.whole_steps:
            self.block_tables.give(self.spare_slot, [])
            self.step_masks = StepMasks(max_batch_size, blocks * BLOCK_POSITIONS, device, self.chunk)
            # A mixture of experts reads back its experts' token counts in every step, which a
            # CUDA graph cannot hold (feed_forward.py): its steps run at the ladder's sizes unrecorded.
            record = device.type == "cuda" and self.args.n_experts is None
            if device.type == "cuda" and not record:
                logger.info("a mixture of experts decodes without CUDA graphs: its routing reads back token counts")
            most_rows = {width: max_batch_size if width == 1 else min(max_batch_size, VERIFY_MAX_ROWS)
                         for width in self.step_widths}
            self.graphs = {width: StepGraphs(self.decode_step, rows, self.spare_slot, device, record=record,
                                             after_compiling=self._agree_on_compiling, width=width)
                           for width, rows in most_rows.items()}
            self.mixed_graphs = None
            if self.mixed_prompt_rows:
                self.prompt_masks = StepMasks(self.mixed_prompt_rows, blocks * BLOCK_POSITIONS, device, self.chunk)
                self.mixed_graphs = StepGraphs(self.mixed_step, max_batch_size, self.spare_slot, device, record=record,
                                               after_compiling=self._agree_on_compiling,
                                               prompt_rows=self.mixed_prompt_rows, prompt_width=BLOCK_POSITIONS)

    @property
    def spare_slot(self) -> int:
        """The cache row that decode_step's padding rows write and no row reads."""
        return self.max_batch_size

    @property
    def exact_steps(self) -> bool:
        """Whether a step of up to MAX_KERNEL_STEP_TOKENS tokens a row gives each token the bits of a
        one-token step of its row alone, whatever shares the batch: where our kernels take every
        product and the attention. With AVX2 alone, fp32 weights only: its int4 passes of one or
        two rows split their sums (avx2_kernels.cpp)."""
        if not self.layers[0].attention.cache.kernel_attends:
            return False
        weights = (self.layers[0].attention.wqkv.weight, self.output.weight)
        return cpu_kernels.runs_on(self.positions.device) or all(weight.dtype == torch.float32 for weight in weights)

    def compile_decoding(self, graphs: bool, verify_width: Optional[int] = None, mix_prompts: bool = False,
                         **compile_options) -> None:
        """Run one-token steps through torch.compile, in equal groups of consecutive layers, then
        the output head.

        Every group shares one compiled graph, so compiling costs one group's time: about 1 s a
        layer when nothing is cached. Each call of a compiled function costs 100-200 us of checks
        before it runs, which is 15% of a step of the demo model at one layer per call, and 2% in
        three groups of ten (MAX_LAYERS_PER_CALL).

        graphs: run each step whole (decode_step) at the batch sizes of a ladder, as CUDA graphs
        on a GPU (step_graphs.py), each row reading its cache up to its own position
        (block_attention.py); otherwise each step at its own size, attending to the positions
        filled so far. Call before setup_caches (else the caches are made again). Heads narrower
        than the block masks' kernels take (tests' tiny models) compile without graphs.

        verify_width: with graphs, steps of this many tokens a row run whole too (speculation's
        verifying passes: a row's last token and its guesses, padded to it: padded_width).

        mix_prompts: with graphs, steps that take in prompt chunks beside the decoding rows run
        whole too (forward_segments, mixed_step), up to MIXED_PROMPT_ROWS rows of BLOCK_POSITIONS
        prompt tokens a step: one pass reads the weights for both, with no launch of its own.
        """
        size = layers_per_call(len(self.layers))
        self.decode_layer_groups = [self.layers[first : first + size] for first in range(0, len(self.layers), size)]
        # Before each call, skip checking the parameters of modules whose attributes are unchanged
        # since the call before: a group's checks take half the time. A compiled function is kept
        # for each rung of the ladder, each head (gathered or not) and each width: more than the compiler's 8.
        fewer_checks = torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True,
                                                   recompile_limit=RECOMPILE_LIMIT)
        self.compile_failure: Optional[Exception] = None
        self.run_decode_layers = fewer_checks(torch.compile(run_layers, **compile_options))
        self.run_decode_head = fewer_checks(torch.compile(run_head, **compile_options))
        self.run_mixed_layers = fewer_checks(torch.compile(run_layer_segments, **compile_options))
        self.whole_steps = graphs and self.args.head_dim >= MIN_HEAD_DIM and self.args.sliding_window is None
        verifying = (verify_width,) if verify_width is not None else ()
        self.step_widths = (1, *verifying) if self.whole_steps else ()
        self.mixed_prompt_rows = MIXED_PROMPT_ROWS if self.whole_steps and mix_prompts else 0
        if graphs and not self.whole_steps:
            logger.info(f"heads of {self.args.head_dim} channels (FlexAttention takes {MIN_HEAD_DIM} or more) or a "
                        f"sliding window ({self.args.sliding_window}): decoding steps compile without CUDA graphs")
        if self.whole_steps and self.max_batch_size:
            self.setup_caches(self.max_batch_size, self.max_seq_len, self.rotary.device,
                              self.layers[0].attention.cache.k.dtype, self.cache_blocks * BLOCK_POSITIONS)

    @torch.inference_mode()
    def warm_up_decoding(self) -> None:
        """Compile the one-token step now (and record its CUDA graphs), for greedy steps (this
        rank's vocabulary slice) and sampled ones (the whole vocabulary), rather than in the first
        requests' steps: compiling takes seconds (11 s for a 7B on an H200), which a server's
        first clients would wait. So too speculation's verifying step and the step that takes in
        prompt chunks, where they run whole. Every rank calls it together; only the spare cache row
        is written."""
        if self.run_decode_layers is run_layers:  # not compiled
            return
        start = time.perf_counter()
        if self.graphs:
            mixed = [self.mixed_graphs] if self.mixed_graphs is not None else []
            for graphs in [*self.graphs.values(), *mixed]:
                graphs.prepare(keys=(True, False))
        else:
            token = torch.zeros(1, 1, dtype=torch.long, device=self.rotary.device)
            for vocab_slice in (True, False):
                self.forward(token, 0, last_only=True, vocab_slice=vocab_slice, slots=[0])
        logger.info(f"compiled the decoding step in {time.perf_counter() - start:.1f} seconds")

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: "int | Sequence[int]", last_only: bool = False,
                vocab_slice: bool = False, slots: Optional[Sequence[int]] = None,
                lengths: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Logits [bsz, seqlen, vocab] in fp32 for tokens [bsz, seqlen] (on the host or the model's
        device), row r placed in cache row slots[r] (by default r) from position start_pos: one for
        every row, or one per row.

        last_only: only the last position's logits, [bsz, 1, vocab]: all that picking the next
        token needs, and it spares a prompt's worth of the largest matrix product.
        lengths: rows padded on the right to seqlen (several prompts' chunks in one pass): row r's
        own tokens are its first lengths[r], and last_only takes each row's logits at its own last
        token. The padding's keys and values land in the cache after the row's tokens, where
        nothing reads them before the row's next tokens overwrite them.
        vocab_slice: only this rank's slice of the vocabulary, [..., vocab // world size] from
        column rank * vocab // world size, not gathered from the other ranks (parallel.vocab_argmax).
        """
        bsz, seqlen = tokens.shape
        starts, slots = self.checked_rows(bsz, seqlen, start_pos, slots)
        self._overwrite(slots, starts)
        graphs = self.graphs.get(seqlen) if lengths is None else None
        if graphs is not None:
            logits = graphs.run(tokens, slots, starts, vocab_slice)
            self._fall_back_if_compiling_failed()
            return logits[:, -1:] if last_only else logits
        rows = self.cache_rows(bsz, seqlen, starts, slots)
        tokens = tokens.to(self.rotary.device)
        last = None if lengths is None else torch.tensor(lengths, device=tokens.device) - 1
        h = self.tok_embeddings(tokens)
        if seqlen == 1 and self.run_decode_layers is not run_layers:
            logits = self._run(h, rows, compiled=True, last_only=last_only, vocab_slice=vocab_slice)
            self._fall_back_if_compiling_failed()
            return logits
        return self._run(h, rows, compiled=False, last_only=last_only, vocab_slice=vocab_slice, last=last)

    @torch.inference_mode()
    def forward_segments(self, batches: Sequence[tuple[torch.Tensor, Sequence[int], Sequence[int]]],
                         vocab_slice: bool = False) -> torch.Tensor:
        """One pass over several batches, each (tokens [bsz, seqlen], start positions, cache rows)
        as forward takes them (a step's generating rows, and each prompt chunk on its own): the
        logits of every row's last token, [rows, 1, vocab] in the batches' order.

        Every product reads the weights once for all their tokens, where a pass a batch would read
        them once a batch: a continuous batch that takes in a prompt does it in the pass that
        decodes the others. Eagerly, or where steps run whole and take in prompts (mixed_step)."""
        if self.mixed_graphs is not None:
            return self._whole_mixed_pass(batches, vocab_slice)
        segments, last, first = [], [], 0
        for tokens, starts, slots in batches:
            bsz, seqlen = tokens.shape
            segments.append((bsz, seqlen, self.cache_rows(bsz, seqlen, starts, slots)))
            self._overwrite(slots, starts)
            last += range(first + seqlen - 1, first + bsz * seqlen, seqlen)
            first += bsz * seqlen
        tokens = torch.cat([tokens.flatten() for tokens, _, _ in batches]).to(self.rotary.device)
        h = self.tok_embeddings(tokens)[None]  # 1, tokens, dim
        for layer in self.layers:
            h = layer.forward_segments(h, segments)
        h = h[0, torch.tensor(last, device=h.device)][:, None]  # rows, 1, dim
        return run_head(self.norm, self.output, h, gather=not vocab_slice)

    def _whole_mixed_pass(self, batches: Sequence[tuple[torch.Tensor, Sequence[int], Sequence[int]]],
                          vocab_slice: bool) -> torch.Tensor:
        """forward_segments as whole steps (mixed_step): the rows of one token (decoding, or a
        prompt's last token alone) as its rows, every longer row as prompt rows of BLOCK_POSITIONS
        tokens, as many as a step takes, the rest in further steps of prompt rows alone (a prompt's
        later rows after its earlier ones, whose keys and values are then in the cache)."""
        single_tokens, single_starts, single_slots = [], [], []  # the one-token rows, batch by batch
        prompts: list[tuple[torch.Tensor, int, int]] = []  # (tokens, start, cache row)
        order = []  # each row's output, in the batches' order: ("single" or "prompt", its index there)
        for tokens, starts, slots in batches:
            starts, slots = self.checked_rows(*tokens.shape, starts, slots)
            self._overwrite(slots, starts)
            if tokens.shape[1] == 1:  # the generating rows: one batch, kept a tensor
                order += [("single", len(single_starts) + row) for row in range(len(slots))]
                single_tokens.append(tokens)
                single_starts += starts
                single_slots += slots
            else:
                order += [("prompt", len(prompts) + row) for row in range(len(slots))]
                prompts += [(row_tokens, start, slot) for row_tokens, start, slot in zip(tokens.cpu(), starts, slots)]
        prompt = prompt_rows(prompts)
        singles = torch.cat(single_tokens) if single_tokens else torch.zeros(0, 1, dtype=torch.long)
        logits, most = [], self.mixed_prompt_rows
        for first in range(0, max(len(prompt), 1), most):
            rows = len(single_slots) if first == 0 else 0  # the one-token rows ride in the first step
            logits.append(self.mixed_graphs.run(singles[:rows], single_slots[:rows], single_starts[:rows], vocab_slice,
                                                prompt[first : first + most]))
        self._fall_back_if_compiling_failed()
        logits = torch.cat(logits)  # the one-token rows', then every prompt row's
        # Each prompt's logits are its last row's, at its last token.
        last_rows = itertools.accumulate(blocks_for(len(tokens)) for tokens, _, _ in prompts)
        outputs = {"single": list(range(len(single_slots))),
                   "prompt": [len(single_slots) + last - 1 for last in last_rows]}
        return logits[torch.tensor([outputs[kind][index] for kind, index in order], device=logits.device)]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Each (source, target) block's keys and values copied in every layer's cache, before a
        pass writes the target (a prompt's start shorter than a block; copy-on-write: a beam's own
        copy of a block its siblings share)."""
        if not copies:
            return
        sources, targets = zip(*copies)
        device = self.positions.device
        sources, targets = block_positions(sources, device), block_positions(targets, device)
        for layer in self.layers:
            layer.attention.cache.copy_positions(sources, targets)

    def _overwrite(self, slots: Sequence[int], starts: Sequence[int]) -> None:
        """Tell the prefix cache that each cache row in slots is written from its start on."""
        for slot, start in zip(slots, starts):
            self.prefix_cache.keep(slot, start)

    @property
    def can_mix_batches(self) -> bool:
        """Whether forward_segments serves one-token steps as forward would: where they run
        eagerly, or whole with prompts mixed in (compile_decoding's mix_prompts)."""
        return self.run_decode_layers is run_layers or self.mixed_graphs is not None

    def padded_width(self, seqlen: int, starts: Sequence[int]) -> int:
        """The tokens a row to feed rows of up to seqlen tokens from starts: a whole step's width
        (the rest padding) where one takes that many and every row has room for it; else seqlen."""
        for width in sorted(self.graphs):
            if seqlen <= width and max(starts) + width <= self.max_seq_len:
                return width
        return seqlen

    def decode_step(self, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                    vocab_slice: bool) -> torch.Tensor:
        """A few tokens a row (one, or a verifying pass's), tokens [rows, width] fed from each row's
        position in positions [rows], on the device (StepGraphs records it whole): the logits
        [rows, width, vocab] in fp32, or this rank's slice of them."""
        rows = self._step_rows(self.step_masks, tokens.shape[1], slots, positions)
        h = self.tok_embeddings(tokens)  # rows, width, dim
        for layers in self.decode_layer_groups:
            h = self._compiled_or_eager(self.run_decode_layers, run_layers, layers, h, rows)
        return self._compiled_or_eager(self.run_decode_head, run_head, self.norm, self.output, h, not vocab_slice)

    def mixed_step(self, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, vocab_slice: bool,
                   prompt: torch.Tensor) -> torch.Tensor:
        """decode_step's one-token rows together with prompt rows, in one pass on the device
        (StepGraphs records it whole): prompt [prompt rows, BLOCK_POSITIONS + 3] holds each prompt
        row's tokens, its cache row, its first token's position and how many of its tokens are its
        own (the rest padding, whose keys and values go to the scratch block). A prompt's rows are
        consecutive pieces of it, in the same cache row: each row writes its keys and values before
        any row attends, so a row's tokens see the rows before it. The logits [rows + prompt rows,
        1, vocab] of each one-token row, then of each prompt row's last own token."""
        width = BLOCK_POSITIONS
        prompt_tokens, own = prompt[:, :width], prompt[:, width + 2]
        decoding = self._step_rows(self.step_masks, 1, slots, positions)
        prompting = self._step_rows(self.prompt_masks, width, prompt[:, width], prompt[:, width + 1], own)
        h = self.tok_embeddings(torch.cat((tokens.flatten(), prompt_tokens.flatten())))[None]  # 1, tokens, dim
        segments = [(len(tokens), 1, decoding), (len(prompt), width, prompting)]
        for layers in self.decode_layer_groups:
            h = self._compiled_or_eager(self.run_mixed_layers, run_layer_segments, layers, h, segments)
        device = tokens.device
        last = torch.cat((torch.arange(len(tokens), device=device),
                          len(tokens) + torch.arange(len(prompt), device=device) * width + own - 1))
        h = h[0, last][:, None]  # rows + prompt rows, 1, dim
        return self._compiled_or_eager(self.run_decode_head, run_head, self.norm, self.output, h, not vocab_slice)

    def _step_rows(self, masks: StepMasks, width: int, slots: torch.Tensor, positions: torch.Tensor,
                   own: Optional[torch.Tensor] = None) -> CacheRows:
        """Where a whole step's rows of width tokens from positions [rows] sit in the caches, and
        what each token sees (masks' block masks). own [rows]: each row's own tokens, the rest
        padding, which may run past max_seq_len and writes the scratch block; None: all of them."""
        tables = self.block_tables.tables.index_select(0, slots)
        block_mask = masks.block_mask(tables, positions, width, own)
        chunk_block_mask = masks.chunk_block_mask(tables, positions, width, own) if self.chunk is not None else None
        in_row = torch.arange(width, device=positions.device)
        token_positions = positions[:, None] + in_row  # rows, width
        write_places = None
        if own is not None:
            token_positions = token_positions.clamp(max=self.max_seq_len - 1)  # the padding's rotation is never read
            scratch = self.block_tables.scratch * BLOCK_POSITIONS + in_row % BLOCK_POSITIONS
            write_places = torch.where(in_row < own[:, None], places(tables, token_positions), scratch)
        return CacheRows(slots, token_positions, self.rotary[token_positions], self.max_seq_len, None, tables,
                         None, None, block_mask, chunk_block_mask=chunk_block_mask, write_places=write_places)

    def _compiled_or_eager(self, compiled: Callable, eager: Callable, *args) -> torch.Tensor:
        """compiled(*args), or eager(*args) where compiling has failed on this rank: this call's
        part of the step runs all the same, with the same exchanges between ranks as the compiled
        code's, so that ranks whose compiling went otherwise stay in step (the failure is dealt
        with after the step: _fall_back_if_compiling_failed)."""
        if self.compile_failure is None:
            try:
                return compiled(*args)
            except torch._dynamo.exc.TorchDynamoException as error:
                self.compile_failure = error
        return eager(*args)

    def _fall_back_if_compiling_failed(self) -> None:
        """After a compiled step: if compiling failed on this rank, say so once and decode eagerly
        from now on."""
        error = self.compile_failure
        if error is not None and self.run_decode_layers is not run_layers:
            self._fall_back(f"{type(error).__name__}: {' '.join(str(error).split())[:400]}")

    def _agree_on_compiling(self) -> bool:
        """After every rank compiled and recorded a step for a new rung (StepGraphs, at the same
        step on every rank): if compiling failed on any rank, every rank decodes eagerly from now
        on, rather than ranks running different code. Whether compiled steps go on."""
        cause = None if self.compile_failure is None else f"{type(self.compile_failure).__name__}: {self.compile_failure}"
        failed = [f"on rank {rank}: {cause}" for rank, cause in enumerate(gather_objects(cause)) if cause]
        if failed:
            self._fall_back(" ".join(failed[0].split())[:400])
        return not failed

    def _fall_back(self, cause: str) -> None:
        """After compiling failed (cause: one line): say so once, and decode eagerly from now on."""
        logger.warning(f"compiling the decoding step failed, decoding eagerly instead: {cause}")
        self.decode_eagerly()

    def _run(self, h: torch.Tensor, rows: CacheRows, compiled: bool, last_only: bool, vocab_slice: bool,
             last: Optional[torch.Tensor] = None) -> torch.Tensor:
        """forward's layers and head on the embedded tokens h, through compile_decoding's functions
        or eagerly."""
        run, groups, head = run_layers, [self.layers], run_head
        if compiled:
            run = partial(self._compiled_or_eager, self.run_decode_layers, run_layers)
            groups, head = self.decode_layer_groups, partial(self._compiled_or_eager, self.run_decode_head, run_head)
        for layers in groups:
            h = run(layers, h, rows)
        if last_only:  # bsz, 1, dim
            h = h[:, -1:] if last is None else h[torch.arange(h.shape[0], device=h.device), last][:, None]
        return head(self.norm, self.output, h, not vocab_slice)

    def decode_eagerly(self) -> None:
        """Undo compile_decoding: one-token steps run eagerly again."""
        self.run_decode_layers, self.run_decode_head = run_layers, run_head
        self.decode_layer_groups = [self.layers]
        self.whole_steps = False  # whether one-token steps run as decode_step, through self.graphs
        self.step_widths: tuple[int, ...] = ()  # the tokens a row of the steps that run whole
        self.graphs: dict[int, StepGraphs] = {}  # by the tokens a row
        self.mixed_prompt_rows = 0  # the prompt rows a whole step takes in (mixed_step), if any
        self.mixed_graphs: Optional[StepGraphs] = None

    def checked_rows(self, bsz: int, seqlen: int, start_pos: "int | Sequence[int]",
                     slots: Optional[Sequence[int]]) -> tuple[list[int], list[int]]:
        """Each row's start position and cache row for tokens [bsz, seqlen] from start_pos (see
        forward), checked against the caches."""
        starts = [start_pos] * bsz if isinstance(start_pos, int) else list(start_pos)
        slots = list(range(bsz)) if slots is None else list(slots)
        if len(starts) != bsz or len(slots) != bsz or len(set(slots)) != bsz:
            raise ValueError(f"a batch of {bsz} rows needs {bsz} start positions and {bsz} distinct cache rows, "
                             f"found {starts} and {slots}")
        end = max(starts) + seqlen
        if min(starts) < 0 or min(slots) < 0 or max(slots) >= self.max_batch_size or end > self.max_seq_len:
            raise ValueError(
                f"a batch of {bsz} rows at cache rows {slots}, {seqlen} tokens from positions {starts}, does "
                f"not fit the caches ({self.max_batch_size} x {self.max_seq_len}); raise max_batch_size/max_seq_len"
            )
        return starts, slots

    def cache_rows(self, bsz: int, seqlen: int, start_pos: "int | Sequence[int]",
                   slots: Optional[Sequence[int]]) -> CacheRows:
        """Where tokens [bsz, seqlen] from start_pos go in the caches (see forward), checked."""
        starts, slots = self.checked_rows(bsz, seqlen, start_pos, slots)
        end = max(starts) + seqlen
        device = self.positions.device
        first = slots[0] if slots == list(range(slots[0], slots[0] + bsz)) else None
        slot_ids = self.slot_ids[first : first + bsz] if first is not None else torch.tensor(slots, device=device)
        tables = self.block_tables.of(slots, slot_ids)
        one_start = len(set(starts)) == 1
        if one_start:  # views
            positions = self.positions[starts[0] : starts[0] + seqlen][None]  # 1, seqlen
            rotary = self.rotary[starts[0] : starts[0] + seqlen][None]  # 1, seqlen, head_dim // 2, 2
        else:
            positions = torch.tensor(starts, device=device)[:, None] + self.positions[None, :seqlen]  # bsz, seqlen
            rotary = self.rotary[positions]  # bsz, seqlen, head_dim // 2, 2
        # Our kernel reads each row up to each token's own position: no mask (compiled one-token steps too).
        kernel_attends = step_through_kernel(seqlen, self.layers[0].attention.cache)
        mask = None
        if self.window is not None or not kernel_attends and not (one_start and (starts[0] == 0 or seqlen == 1)):
            mask = self.attention_mask(positions, end)  # 1 or bsz, 1, seqlen, end
        chunk_mask = self.attention_mask(positions, end, chunked=True) if self.chunk is not None else None
        kernel_starts = None
        if kernel_attends:
            rotary = rotary.contiguous()
            kernel_starts = positions[:, 0].expand(bsz)
        return CacheRows(slot_ids, positions, rotary, end, mask, tables, self.block_tables.run_start(slots),
                         kernel_starts, chunk_mask=chunk_mask)

    def attention_mask(self, positions: torch.Tensor, end: int, chunked: bool = False) -> torch.Tensor:
        """Which of the cached positions [0, end) each query at positions [1 or bsz, seqlen] sees,
        [1 or bsz, 1, seqlen, end]: those of its row up to itself, within the sliding window, and
        with chunked, within its own chunk (Llama 4's chunked layers, as transformers masks them
        when decoding too; Meta's reference masks by chunk only within a prompt)."""
        keys, queries = self.positions[None, None, None, :end], positions[:, None, :, None]
        mask = keys <= queries
        if self.window is not None:
            mask &= keys > queries - self.window
        if chunked:
            mask &= keys // self.chunk == queries // self.chunk
        return mask


def layers_per_call(n_layers: int) -> int:
    """The most layers, up to MAX_LAYERS_PER_CALL, that split n_layers into equal groups."""
    return max(n for n in range(1, MAX_LAYERS_PER_CALL + 1) if n_layers % n == 0)


def run_layers(layers: nn.ModuleList, h: torch.Tensor, rows: CacheRows) -> torch.Tensor:
    """Consecutive layers' step, as a function of the layers: what compile_decoding compiles.
    Eagerly through our kernels, plain int4 or int8 layers step in one C++ call (layer_step.py)."""
    if rows.kernel_starts is not None and not torch.compiler.is_compiling():
        step = quantized_layers_step(layers)
        stepped = step(h, rows) if step is not None else None
        if stepped is not None:
            return stepped
    for layer in layers:
        h = layer(h, rows)
    return h


def prompt_rows(prompts: Sequence[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
    """Prompt chunks, each (tokens, first position, cache row), in rows of BLOCK_POSITIONS tokens as
    mixed_step takes them: [rows, BLOCK_POSITIONS + 3], each row's tokens (a chunk's last row padded
    with zeros), its cache row, its first token's position and how many of its tokens are its own."""
    width = BLOCK_POSITIONS
    pieces = [(tokens[first : first + width], start + first, slot)
              for tokens, start, slot in prompts for first in range(0, len(tokens), width)]
    rows = torch.zeros(len(pieces), width + 3, dtype=torch.long)
    for row, (tokens, start, slot) in enumerate(pieces):
        rows[row, : len(tokens)] = tokens
        rows[row, width:] = torch.tensor([slot, start, len(tokens)])
    return rows


def run_layer_segments(layers: nn.ModuleList, h: torch.Tensor, segments: list[tuple[int, int, CacheRows]]) -> torch.Tensor:
    """Consecutive layers' pass over several segments' tokens one after another (TransformerBlock.forward_segments)."""
    for layer in layers:
        h = layer.forward_segments(h, segments)
    return h


def run_head(norm: RMSNorm, output: nn.Module, h: torch.Tensor, gather: bool = True) -> torch.Tensor:
    """The last norm and the vocabulary projection: logits in fp32, of the whole vocabulary
    (gathered from every rank) or of this rank's slice."""
    logits = output(norm(h))
    return (all_gather_last_dim(logits) if gather else logits).float()
