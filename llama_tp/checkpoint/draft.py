"""Speculation's draft model loaded on this rank (engine/speculative/ runs it): a smaller
checkpoint that shares the target's tokenizer, or the target's own checkpoint quantized."""

from pathlib import Path
from typing import Optional

import torch

from .. import parallel
from ..model.args import ModelArgs
from ..kernels import matmul
from ..logs import logger
from ..model.memory import GIB, plan
from ..model.transformer import Transformer
from ..parallel import Placement
from .loading import load_model, open_checkpoint


def load_draft(draft_ckpt_dir: Optional[str], draft_quantize: Optional[str], compile: bool, ckpt_dir: Path,
               args: ModelArgs, placement: Placement, dtype: torch.dtype, max_batch_size: int, max_seq_len: int,
               k: int) -> tuple[Transformer, str]:
    """The draft the checked options ask for, and what it is (for people): the checkpoint in
    draft_ckpt_dir (by default the target's own, ckpt_dir) quantized as draft_quantize says, its
    one-token steps compiled with compile, its caches made. args: the target's, with the
    tokenizer's vocabulary; k: the guesses a round, for the log."""
    draft_dir = Path(draft_ckpt_dir) if draft_ckpt_dir is not None else Path(ckpt_dir)
    if not draft_dir.is_dir():
        raise FileNotFoundError(f"draft_ckpt_dir {draft_dir} does not exist; pass the folder that holds the "
                                "draft model's params.json and consolidated.XX.pth")
    description = (f"{draft_quantize} copy of the target" if draft_ckpt_dir is None
                   else f"{draft_dir}" + (f" as {draft_quantize}" if draft_quantize else ""))
    try:
        draft_args = ModelArgs.load(draft_dir / "params.json")
        if draft_args.vocab_size not in (-1, args.vocab_size):
            raise ValueError(f"its params.json says vocab_size {draft_args.vocab_size}")
        checkpoint = open_checkpoint(draft_dir, draft_args.with_vocab_size(args.vocab_size))
    except ValueError as error:
        raise ValueError(f"the draft model in {draft_dir} does not fit the target, whose tokenizer has "
                         f"{args.vocab_size} tokens: {error}. A draft must share the target's tokenizer") from None
    draft_args = checkpoint.args
    draft_args.check_model_parallel_size(placement.world_size)
    memory = plan(draft_args, placement.world_size, max_batch_size, max_seq_len, dtype,
                  draft_quantize or checkpoint.quantization)
    logger.info(f"Speculation: the draft ({description}, {k} guesses a round) adds "
                f"{memory.weight_bytes / GIB:.2f} GiB of weights and {memory.kv_cache_bytes / GIB:.2f} GiB of "
                "KV cache a process")
    model = load_model(draft_dir, draft_args, placement, dtype, draft_quantize,
                       pack=matmul.packing_pays(max_batch_size, False, dtype), opened=checkpoint)
    if compile:  # as generation.compile_decoding does for a target without speculation
        compilation = parallel.decode_compilation(placement.device)
        model.compile_decoding(compilation.graphs, **compilation.options)
    model.setup_caches(max_batch_size, max_seq_len, placement.device, dtype)
    return model, description
