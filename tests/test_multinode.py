"""Two torchrun agents on 127.0.0.1, as two machines would run them, give one process's greedy tokens.

The job streams (--stream), which also covers the text script's streaming path over two processes.
"""

import json
import socket
import subprocess
import sys

import pytest

from llama_tp import Llama
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA3, full_weights, write_checkpoint
from torchrun import LAUNCH, ROOT, environment, one_thread  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # slow: two torchrun agents
PROMPTS = ["Two machines, one model:", "naïve café"]


def test_two_node_job_matches_one_process(tmp_path):
    weights = full_weights(TINY_LLAMA3, 32000, seed=5)
    one, two = (write_checkpoint(tmp_path / f"tp{n}", TINY_LLAMA3, weights, n, "vocab") for n in (1, 2))
    (tmp_path / "prompts.json").write_text(json.dumps(PROMPTS))
    # Node 0's agent binds this port itself, as the first machine would: it can only be found free
    # beforehand (the one test left with that race; it runs alone, in the slow set).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agents = []
    for node_rank in (0, 1):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node_rank),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "multinode-test",
            # Only node 0 hosts the rendezvous store, as the first machine would.
            "--rdzv_conf", f"is_host={int(node_rank == 0)}",
            str(LAUNCH / "text_completion.py"), "--ckpt_dir", str(two), "--tokenizer_path", str(LLAMA2_TOKENIZER),
            "--prompts_file", str(tmp_path / "prompts.json"), "--output_json", str(tmp_path / f"node{node_rank}.json"),
            "--temperature", "0", "--max_seq_len", "48", "--max_gen_len", "8", "--max_batch_size", "2", "--stream",
        ]
        agents.append(subprocess.Popen(command, cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output
    # Global rank 0 (on whichever node the rendezvous placed it) alone wrote the results.
    written = [json.loads(path.read_text()) for path in tmp_path.glob("node*.json")]
    assert len(written) == 1

    # As the script builds it: streaming decodes one row at a time.
    single = Llama.build(str(one), str(LLAMA2_TOKENIZER), max_seq_len=48, max_batch_size=1)
    for record, prompt in zip(written[0], PROMPTS):
        stream = single.stream_text_completion(prompt, temperature=0, max_gen_len=8)
        assert "".join(stream) == record["generation"] == stream.text
        assert record["token_ids"] == stream.tokens and len(stream.tokens) == 8
    printed = "".join(outputs)
    assert all(printed.count(record["generation"]) == 1 for record in written[0])  # rank 0 alone printed
