"""generate's answers in the cases that Meta's static loop once ran alone (one prompt, show_top,
echo with log probabilities, a JSON schema, sampled speculation), recorded from main on
2026-11-28, before issue 49 ran them through the engine, in tests/golden/generate.json.

    python tests/generate_goldens.py            # record again (this checkout's answers)

Recorded at world sizes 1 and 2, with our CPU kernels (AVX-512) and without them
(LLAMA_TP_CPU_KERNELS=0): the four gave the same answers (log probabilities to 5 places), which
the file holds once. Only cases whose random stream the engine keeps are here: greedy ones, and
seeded sampling of a single prompt (its generator is seeded with the call's seed either way).
docs/batch_jobs.md ("Seeds") says which streams changed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from llama_tp import Llama
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint

GOLDEN = Path(__file__).parent / "golden" / "generate.json"

PROMPTS = [[1, 450, 4996, 17354, 1701, 29916], [1, 306, 4658], [1, 15043, 29892, 920, 526, 366, 29973, 13]]
REPEATING = [1, 450, 4996, 17354, 1701, 29916, 450, 4996, 17354, 1701, 29916, 450, 4996]  # for prompt lookup
TEXTS = ["The quick brown fox", "Once upon a time, in a land far away"]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "pet", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}}}
SAMPLED = dict(temperature=1.0, top_p=0.95, top_k=50)
BUILD = dict(max_seq_len=96, max_batch_size=3)


def plain_cases(llama: Llama) -> dict[str, Any]:
    """Every case of a Llama without speculation, each a JSON value."""
    def rounded(values):
        return [round(value, 5) for value in values]

    cases: dict[str, Any] = {}
    cases["one prompt, greedy"] = llama.generate(PROMPTS[:1], 24, temperature=0)[0]
    cases["one prompt, seeded sampling"] = llama.generate(PROMPTS[:1], 24, seed=11, **SAMPLED)[0]
    cases["one prompt, seeded sampling, penalty and min_gen_len"] = llama.generate(
        PROMPTS[:1], 24, seed=12, repetition_penalty=1.3, min_gen_len=5, **SAMPLED)[0]
    tokens, logprobs = llama.generate(PROMPTS[:1], 12, temperature=0, logprobs=True)
    cases["one prompt, logprobs"] = {"tokens": tokens, "logprobs": [rounded(row) for row in logprobs]}
    stream = llama.stream_text_completion(TEXTS[0], max_gen_len=16, temperature=0)
    cases["stream, greedy"] = {"pieces": "".join(stream), "tokens": stream.tokens}
    stream = llama.stream_text_completion(TEXTS[1], max_gen_len=16, seed=4, **SAMPLED)
    cases["stream, seeded sampling"] = {"pieces": "".join(stream), "tokens": stream.tokens}
    for name, texts in (("show_top, one prompt", TEXTS[:1]), ("show_top, two prompts", TEXTS)):
        results = llama.text_completion(texts, temperature=0, max_gen_len=8, show_top=3, logprobs=True, token_ids=True)
        cases[name] = [{"token_ids": result["token_ids"], "logprobs": rounded(result["logprobs"]),
                        "top": [[[text, round(p, 5)] for text, p in step] for step in result["top"]]}
                       for result in results]
    tokens, logprobs = llama.generate(PROMPTS, 8, temperature=0, logprobs=True, echo=True)
    cases["echo with logprobs, ragged prompts"] = {"tokens": tokens, "logprobs": [rounded(row) for row in logprobs]}
    tokens, logprobs = llama.generate(PROMPTS[:1], 8, temperature=0, logprobs=True, echo=True)
    cases["echo with logprobs, one prompt"] = {"tokens": tokens, "logprobs": [rounded(row) for row in logprobs]}
    results = llama.text_completion(TEXTS, temperature=0, max_gen_len=40, response_format=SCHEMA, token_ids=True)
    cases["JSON schema, greedy, two prompts"] = [result["token_ids"] for result in results]
    results = llama.text_completion(TEXTS[:1], max_gen_len=40, response_format=SCHEMA, token_ids=True, seed=3,
                                    **SAMPLED)
    cases["JSON schema, one prompt, seeded sampling"] = [result["token_ids"] for result in results]
    dialogs = [[{"role": "user", "content": "Name a pet."}]]
    results = llama.chat_completion(dialogs, temperature=0, max_gen_len=40, response_format=SCHEMA, token_ids=True)
    cases["JSON schema, chat, greedy"] = [result["token_ids"] for result in results]
    return cases


def speculating_cases(llama: Llama) -> dict[str, Any]:
    return {
        "one prompt, seeded sampling": llama.generate([REPEATING], 24, seed=5, **SAMPLED)[0],
        "one prompt, greedy": llama.generate([REPEATING], 24, temperature=0)[0],
        "ragged prompts, greedy, echo with logprobs": llama.generate(PROMPTS, 12, temperature=0, echo=True,
                                                                     logprobs=True)[0],
    }


def answers(directory: str) -> dict[str, Any]:
    """Every case's answers, from the checkpoint in directory (as many shards as ranks)."""
    torch.set_num_threads(1)
    tokenizer = str(LLAMA2_TOKENIZER)
    result = {"plain": plain_cases(Llama.build(directory, tokenizer, **BUILD))}
    result["lookup"] = speculating_cases(Llama.build(directory, tokenizer, speculate="lookup", **BUILD))
    result["draft"] = speculating_cases(Llama.build(directory, tokenizer, speculate="draft", draft_quantize="int8",
                                                    speculate_k=3, **BUILD))
    return result


def checkpoint(directory: Path, shards: int) -> str:
    write_checkpoint(directory, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), shards, "dim")
    return str(directory)


def record(world_size: int, root: Path) -> dict[str, Any]:
    """This checkout's answers at world_size, in a fresh process (the kernels' choice is made once a process)."""
    from distributed import run_world

    return run_world(world_size, answers, checkpoint(root / f"mp{world_size}", world_size))[0]


def main() -> None:
    import tempfile

    if len(sys.argv) > 1:  # a child: one kernel set
        root = Path(sys.argv[1])
        found = [record(world_size, root) for world_size in (1, 2)]
        (root / "answers.json").write_text(json.dumps(found))
        return
    found = []
    for kernels in ("1", "0"):
        with tempfile.TemporaryDirectory() as root:
            subprocess.run([sys.executable, __file__, root], check=True,
                           env=os.environ | {"LLAMA_TP_CPU_KERNELS": kernels, "LLAMA_TP_DEVICE": "cpu"})
            found += json.loads((Path(root) / "answers.json").read_text())
    if any(answers != found[0] for answers in found):
        raise SystemExit("world sizes 1 and 2, with our kernels and without, gave different answers: record each")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(found[0], indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
