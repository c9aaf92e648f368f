"""Answer a few example dialogs with a Llama chat checkpoint split across the torchrun processes.

    torchrun --nproc_per_node N launch/chat_completion.py --ckpt_dir DIR --tokenizer_path FILE
    torchrun --nproc_per_node 1 launch/chat_completion.py   # the built-in demo model (1 or 3 processes)
"""

from typing import Optional

from llama_tp import Dialog, Llama, demo
from llama_tp.cli import run
from llama_tp.parallel import print0

EXAMPLE_DIALOGS: list[Dialog] = [
    [{"role": "user", "content": "what is the recipe of mayonnaise?"}],
    [
        {"role": "user", "content": "I am going to Paris, what should I see?"},
        {
            "role": "assistant",
            "content": "Paris, the capital of France, is known for its stunning architecture, art "
            "museums, historical landmarks, and romantic atmosphere. The Eiffel Tower, the Louvre "
            "and Notre-Dame are three of the most famous sights.",
        },
        {"role": "user", "content": "What is so great about #1?"},
    ],
    [
        {"role": "system", "content": "Always answer with Haiku"},
        {"role": "user", "content": "I am going to Paris, what should I see?"},
    ],
    [
        {"role": "system", "content": "Always answer with emojis"},
        {"role": "user", "content": "How to go from Beijing to NY?"},
    ],
]


def main(
    ckpt_dir: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_seq_len: int = 512,
    max_batch_size: int = 4,
    max_gen_len: Optional[int] = None,
):
    """Print each example dialog and the model's reply.

    Args:
        ckpt_dir: folder with params.json and consolidated.XX.pth shards; leave out both paths
            to run the built-in demo model (SmolLM2-135M-Instruct, fetched and converted once).
        tokenizer_path: the tokenizer file that came with the checkpoint.
        temperature: sampling temperature; 0 is greedy.
        top_p: nucleus sampling threshold in (0, 1].
        max_seq_len: longest dialog plus reply, in tokens.
        max_batch_size: dialogs decoded together.
        max_gen_len: most tokens per reply; by default up to the end of the context.
    """
    ckpt_dir, tokenizer_path = demo.model_paths(ckpt_dir, tokenizer_path)
    generator = Llama.build(ckpt_dir, tokenizer_path, max_seq_len, max_batch_size)
    results = generator.chat_completion(
        EXAMPLE_DIALOGS, max_gen_len=max_gen_len, temperature=temperature, top_p=top_p
    )
    for dialog, result in zip(EXAMPLE_DIALOGS, results):
        for message in dialog:
            print0(f"{message['role'].capitalize()}: {message['content']}\n")
        print0(f"> {result['generation']['role'].capitalize()}: {result['generation']['content']}")
        print0("\n==================================\n")


if __name__ == "__main__":
    run(main)
