"""Print how much memory each process needs, before anything is loaded.

    python -m llama_tp.plan --params params/llama-2-70b.json --world_size 8 [--max_batch_size 4] [--max_seq_len 4096] [--dtype bf16] [--quantize int8|int4] [--memory_gib 80]

It exits 1, after the figures, when the world size cannot split the model or the weights and KV
cache exceed --memory_gib. See llama_tp/memory.py for what the figures count.
"""

from typing import Optional

from ..args import ModelArgs
from ..memory import GIB, plan, report
from .cli import run

LLAMA2_VOCAB_SIZE = 32000  # what params.json's -1 becomes with Llama 2's tokenizer


def main(params: str, world_size: int = 1, max_batch_size: int = 4, max_seq_len: int = 512, dtype: str = "bf16",
         vocab_size: Optional[int] = None, quantize: Optional[str] = None,
         memory_gib: Optional[float] = None) -> None:
    """Print the memory each process needs for a model's params.json.

    Args:
        params: a params.json (e.g. params/llama-2-70b.json or a checkpoint's own).
        world_size: the number of processes the model is split over.
        max_batch_size: prompts decoded together (default: the chat scripts', 4).
        max_seq_len: longest prompt plus generation, in tokens (default: the chat scripts', 512).
        dtype: bf16, fp16 or fp32.
        vocab_size: the tokenizer's size, for params.json files that say -1 (default: Llama 2's 32000).
        quantize: int8, int4 or int8_dynamic linear layers (int8 and int4 are also what checkpoints
            stored so load as).
        memory_gib: the memory each process has (a GPU's, or its share of a machine's), in GiB:
            exit 1 if the weights and KV cache need more.
    """
    args = ModelArgs.load(params)
    if args.vocab_size == -1:
        args = args.with_vocab_size(vocab_size or LLAMA2_VOCAB_SIZE)
    elif vocab_size is not None:
        args = args.with_vocab_size(vocab_size)  # refuses a disagreement
    memory = plan(args, world_size, max_batch_size, max_seq_len, dtype, quantize)
    print(report(memory))
    args.check_model_parallel_size(world_size)
    needed = (memory.weight_bytes + memory.kv_cache_bytes) / GIB
    if memory_gib is not None and needed > memory_gib:
        raise ValueError(f"the weights and KV cache need {needed:.2f} GiB a process, more than --memory_gib "
                         f"{memory_gib:g}; use more processes, --quantize int8 or int4, or a smaller "
                         "--max_seq_len or --max_batch_size")


if __name__ == "__main__":
    run(main)
