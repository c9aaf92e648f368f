"""python -m llama_tp.convert {hf,gguf} SOURCE DEST --mp N [--dtype bf16|fp16|fp32] [--quantize int8|int4]"""

import shlex
from pathlib import Path
from typing import Optional

from ...checkpoint.quantized import check_storable
from ..cli import run

FORMATS = ("hf", "gguf")


def main(kind: str, source: str, dest: str, mp: int = 1, dtype: Optional[str] = None, quantize: Optional[str] = None):
    """Convert Llama weights into a Meta-layout checkpoint folder that llama_tp loads.

    Args:
        kind: "hf" for a Hugging Face folder (config.json, *.safetensors, tokenizer files) or
            "gguf" for a llama.cpp GGUF file.
        source: the folder (hf) or the .gguf file.
        dest: the new checkpoint folder; must not exist or be empty.
        mp: model-parallel shards to write: run the result with torchrun --nproc_per_node mp.
        dtype: bf16, fp16 or fp32; by default the source's own precision for hf, fp32 for gguf.
        quantize: "int8" stores the linear layers as grouped int8 (1.25 bytes per weight), "int4"
            as grouped 4-bit (0.625 bytes per weight; the output head int8), which llama_tp loads
            as they are; embedding and norms stay in dtype. A GGUF's Q4_0 and Q4_1 layers come
            into int4 and its Q8_0 ones into int8 exactly as the file stores them.
    """
    check_storable(quantize)
    if kind == "hf":
        from .hf import convert_hf
        written = convert_hf(source, dest, mp, dtype, quantize)
    elif kind == "gguf":
        from .gguf import convert_gguf
        written = convert_gguf(source, dest, mp, dtype or "fp32", quantize)
    else:
        raise ValueError(f"unknown source kind {kind!r}; use one of {', '.join(FORMATS)}: "
                         "python -m llama_tp.convert hf SRC_DIR DST_DIR --mp N")
    print(next_commands(written, mp))


def next_commands(checkpoint: Path, mp: int) -> str:
    """What to run with a checkpoint written for mp processes (its tokenizer is in its folder)."""
    launch = f"llama-tp --nproc_per_node {mp} launch"
    folder = shlex.quote(str(checkpoint))
    return (f"converted into {checkpoint}; chat with it, or serve it:\n"
            f"  {launch}/chat.py --ckpt_dir {folder}\n"
            f"  {launch}/serve.py --ckpt_dir {folder}")


if __name__ == "__main__":
    run(main)
