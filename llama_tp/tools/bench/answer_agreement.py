"""Does quantization change the model's answers? Ten everyday chat questions answered greedily by
the full-precision model and by a quantized copy, compared token for token.

    python -m llama_tp.tools.bench.answer_agreement --quantize int8        # the demo model (or int4)
    torchrun --nproc_per_node 2 -m llama_tp.tools.bench.answer_agreement --ckpt_dir DIR --tokenizer_path FILE

Prints each question with whether the two answers agree, and where they part if not; then how
many of the ten agree. --json_path writes both answers of each question.
"""

import json
from pathlib import Path
from typing import Optional

from ... import parallel
from ...generation import Llama
from ...model.quantize import QUANTIZATIONS, check_quantize
from .. import demo
from ..cli import run

QUESTIONS = (
    "What is the capital of France?",
    "How do I boil an egg?",
    "Give me three tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Write a short poem about the sea.",
    "Why is the sky blue?",
    "How many legs does a spider have?",
    "Suggest a name for a pet cat.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a computer virus is in one sentence.",
)


def first_difference(a: list[int], b: list[int]) -> Optional[int]:
    """The first position where two token sequences differ (one ending early counts), or None."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_answers(llama: Llama, questions: tuple[str, ...], max_gen_len: int) -> list[dict]:
    """Each question's greedy answer: its text and token ids."""
    dialogs = [[{"role": "user", "content": question}] for question in questions]
    replies = llama.chat_completion(dialogs, temperature=0, max_gen_len=max_gen_len, token_ids=True)
    return [{"text": reply["generation"]["content"], "token_ids": reply["token_ids"]} for reply in replies]


def main(
    ckpt_dir: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    quantize: str = "int8",
    max_gen_len: int = 48,
    max_seq_len: int = 256,
    dtype: Optional[str] = None,
    compile: bool = False,
    json_path: Optional[str] = None,
):
    """Answer QUESTIONS with the model as it is and quantized; print and count the agreements.

    Args:
        ckpt_dir: Meta-layout checkpoint folder; leave out both paths for the demo model.
        tokenizer_path: its tokenizer.
        quantize: the quantization to judge: int8, int4 or int8_dynamic.
        max_gen_len: tokens per answer.
        max_seq_len: context of both models.
        dtype: compute dtype of both models (default: fp32 on CPU, bf16/fp16 on GPU).
        compile: compile both models' decoding steps.
        json_path: where to write both answers of every question.
    """
    if quantize is None:
        raise ValueError(f"--quantize is needed: one of {', '.join(QUANTIZATIONS)}")
    check_quantize(quantize)
    ckpt_dir, tokenizer_path = demo.model_paths(ckpt_dir, tokenizer_path)
    answers = {}
    for name, quantization in (("full", None), (quantize, quantize)):
        llama = Llama.build(ckpt_dir, tokenizer_path, max_seq_len, len(QUESTIONS), dtype=dtype,
                            quantize=quantization, compile=compile)
        answers[name] = greedy_answers(llama, QUESTIONS, max_gen_len)
        del llama  # one model in memory at a time
    records = []
    for question, full, quantized in zip(QUESTIONS, answers["full"], answers[quantize]):
        parted = first_difference(full["token_ids"], quantized["token_ids"])
        records.append({"question": question, "same": parted is None, "first_difference": parted,
                        "full": full, quantize: quantized})
        verdict = "same" if parted is None else f"differs from token {parted}"
        parallel.print0(f"{question}\n  full:   {full['text']!r}\n  {quantize}: {quantized['text']!r}\n  -> {verdict}")
    same = sum(record["same"] for record in records)
    parallel.print0(f"{same} of {len(records)} greedy answers unchanged by {quantize} "
                    f"({max_gen_len} tokens each)")
    if json_path is not None and parallel.global_rank() == 0:
        Path(json_path).write_text(json.dumps(records, indent=2, ensure_ascii=False), encoding="utf-8")


if __name__ == "__main__":
    run(main)
