"""launch/serve.py on one GPU and on two (NCCL, one GPU a rank) asked through the official openai
client: greedy answers, alone and several at once, and seeded sampled ones, equal to one process's
on one GPU (test_serve_launch.py does the same on CPU)."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from distributed import run_world
from llama_tp import Llama
from serve_client import client
from test_serve_launch import DIALOGS, LLAMA3_TOKENIZER, MAX_TOKENS, MODEL, Server
from tiny_checkpoint import full_weights, write_checkpoint

# Splits over 1 and 2 processes: 4 heads of 16, 2 KV heads, Llama 3's vocabulary.
TINY_2WAY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32, "norm_eps": 1e-5,
             "rope_theta": 500000.0, "vocab_size": 128256}
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=3)


def _answers_alone(checkpoint: str) -> tuple[list[str], str]:
    """On one GPU, in fp32 as the server runs below: each dialog's greedy answer alone, and the
    first dialog's seeded sampled answer (the server seeds a request as generate seeds prompt 0)."""
    llama = Llama.build(checkpoint, LLAMA3_TOKENIZER, max_seq_len=128, max_batch_size=1, dtype="fp32")
    greedy = [llama.chat_completion([dialog], temperature=0, max_gen_len=MAX_TOKENS)[0]["generation"]["content"]
              for dialog in DIALOGS]
    sampled = llama.chat_completion([DIALOGS[0]], max_gen_len=MAX_TOKENS, **SAMPLED)[0]["generation"]["content"]
    return greedy, sampled


@pytest.mark.parametrize("gpus", [pytest.param(1, marks=pytest.mark.gpus(1)), pytest.param(2, marks=pytest.mark.gpus(2))])
def test_the_server_on_gpus_answers_what_one_gpu_answers(tmp_path, gpus):
    weights = full_weights(TINY_2WAY, 128256, seed=5)
    one, served = (str(write_checkpoint(tmp_path / f"mp{n}", TINY_2WAY, weights, n, "vocab")) for n in (1, gpus))
    greedy, sampled = run_world(1, _answers_alone, one)[0]
    server = Server(served, gpus, "--dtype", "fp32", log=tmp_path / "stderr.txt")
    try:
        openai_client = client(server.url)

        def chat(dialog: list[dict], **options) -> str:
            answer = openai_client.chat.completions.create(model=MODEL, messages=dialog, max_tokens=MAX_TOKENS,
                                                           **({"temperature": 0} | options))
            return answer.choices[0].message.content

        assert chat(DIALOGS[0]) == greedy[0]
        with ThreadPoolExecutor(8) as pool:  # 4 cache rows: some wait, all join as rows free up
            assert list(pool.map(chat, DIALOGS)) == greedy
        assert chat(DIALOGS[0], **SAMPLED) == sampled
    finally:
        server.stop()
