"""Complete a few text prompts with a Llama checkpoint split across the torchrun processes.

    torchrun --nproc_per_node N launch/text_completion.py --ckpt_dir DIR --tokenizer_path FILE
    torchrun --nproc_per_node 1 launch/text_completion.py   # the built-in demo model (1 or 3 processes)
"""

from typing import Optional

from llama_tp import Llama, demo
from llama_tp.cli import run
from llama_tp.parallel import print0

EXAMPLE_PROMPTS = [
    # For these prompts, the expected answer is the natural continuation of the prompt
    "I believe the meaning of life is",
    "Simply put, the theory of relativity states that ",
    """A brief message congratulating the team on the launch:

        Hi everyone,

        I just """,
    # Few shot prompt (providing a few examples before asking model to complete more);
    """Translate English to French:

        sea otter => loutre de mer
        peppermint => menthe poivrée
        plush girafe => girafe peluche
        cheese =>""",
]


def main(
    ckpt_dir: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_seq_len: int = 128,
    max_gen_len: int = 64,
    max_batch_size: int = 4,
):
    """Print a completion of each example prompt.

    Args:
        ckpt_dir: folder with params.json and consolidated.XX.pth shards; leave out both paths
            to run the built-in demo model (SmolLM2-135M-Instruct, fetched and converted once).
        tokenizer_path: the tokenizer file that came with the checkpoint.
        temperature: sampling temperature; 0 is greedy.
        top_p: nucleus sampling threshold in (0, 1].
        max_seq_len: longest prompt plus generation, in tokens.
        max_gen_len: most tokens generated per prompt.
        max_batch_size: prompts decoded together.
    """
    ckpt_dir, tokenizer_path = demo.model_paths(ckpt_dir, tokenizer_path)
    generator = Llama.build(ckpt_dir, tokenizer_path, max_seq_len, max_batch_size)
    results = generator.text_completion(
        EXAMPLE_PROMPTS, max_gen_len=max_gen_len, temperature=temperature, top_p=top_p
    )
    for prompt, result in zip(EXAMPLE_PROMPTS, results):
        print0(prompt)
        print0(f"> {result['generation']}")
        print0("\n==================================\n")


if __name__ == "__main__":
    run(main)
