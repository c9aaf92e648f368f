"""The llama.cpp side of the benchmark: the same GGUF file run by llama.cpp, through
llama-cpp-python, in a process of its own that does one request at a time while ours waits.

llama-cpp-python is the optional `llamacpp` extra, which pip builds from llama.cpp's sources (a
few minutes; it needs cmake and a C++ compiler).
"""

import multiprocessing
from pathlib import Path

from ..optional import require


class LlamaCpp:
    """llama.cpp on a GGUF file in a child process (spawned, so that its threads and ours never
    share a process); generate blocks until the child has done the work."""

    def __init__(self, gguf: Path, threads: int, context: int):
        self.version = require("llama_cpp", "--compare llamacpp").__version__
        if not Path(gguf).is_file():
            raise FileNotFoundError(f"GGUF file {gguf} does not exist; pass --gguf with the file llama.cpp should run")
        spawn = multiprocessing.get_context("spawn")
        self.connection, child = spawn.Pipe()
        self.process = spawn.Process(target=_serve, args=(child, str(gguf), threads, context), daemon=True)
        self.process.start()
        self._reply()  # loaded

    def generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        """new_tokens greedy tokens after prompt, the prompt computed afresh (nothing cached)."""
        self.connection.send((prompt, new_tokens))
        return self._reply()

    def close(self) -> None:
        self.connection.send(None)
        self.process.join()

    def _reply(self):
        reply = self.connection.recv()
        if isinstance(reply, Exception):
            self.process.join()
            raise RuntimeError(f"llama.cpp failed: {reply}")
        return reply


def _serve(connection, gguf: str, threads: int, context: int) -> None:
    """The child: load the model, then answer (prompt, new_tokens) requests until None."""
    try:
        from llama_cpp import Llama

        # The whole prompt in one batch, as ours takes it; logits of the last position only.
        llm = Llama(model_path=gguf, n_ctx=context, n_batch=context, n_ubatch=context, n_threads=threads,
                    n_threads_batch=threads, verbose=False)
        connection.send("loaded")
        while (request := connection.recv()) is not None:
            connection.send(greedy(llm, *request))
    except Exception as error:  # whatever llama.cpp raises, reported to the parent, which raises it
        connection.send(error)


def greedy(llm, prompt: list[int], new_tokens: int) -> list[int]:
    """llama.cpp's greedy continuation of prompt: one step per new token after the prompt's."""
    llm.reset()  # forget the last request's tokens, which would otherwise serve this one from the cache
    tokens = []
    for token in llm.generate(prompt, temp=0.0, reset=True):  # temperature 0: llama.cpp's greedy sampler
        tokens.append(token)
        if len(tokens) == new_tokens:
            return tokens
