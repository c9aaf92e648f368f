"""A scripted launch/chat.py session over two processes, fed through a pipe."""

import os
import pty
import select
import signal
import time

import pytest

from llama_tp import Llama
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint
from torchrun import LAUNCH, ROOT, environment, one_thread, run_script, torchrun_command  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # slow: torchrun jobs
SESSION = "Hello there\n/system Always answer in French.\nHow are you?\n/reset\nZürich, 日本?\n"
SYSTEM = {"role": "system", "content": "Always answer in French."}
MAX_SEQ_LEN, MAX_GEN_LEN = 56, 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[int, str]:
    weights = full_weights(TINY_LLAMA2, 32000, seed=3)
    root = tmp_path_factory.mktemp("chat")
    return {n: str(write_checkpoint(root / f"tp{n}", TINY_LLAMA2, weights, n, "dim")) for n in (1, 2)}


@pytest.mark.parametrize("speculation", [(), ("--speculate", "draft", "--draft_quantize", "int8")])
def test_piped_session_over_two_processes(checkpoints, speculation):
    """The transcript, turn after turn (each reusing the cache), as the API streams it; with
    speculation too, whose greedy answers are the same."""
    result = run_script("chat.py", 2, "--ckpt_dir", checkpoints[2], "--tokenizer_path", str(LLAMA2_TOKENIZER),
                        "--temperature", "0", "--max_seq_len", str(MAX_SEQ_LEN), "--max_gen_len", str(MAX_GEN_LEN),
                        *speculation, stdin=SESSION, timeout=90)
    transcript = result.stdout
    api = Llama.build(checkpoints[1], str(LLAMA2_TOKENIZER), max_seq_len=MAX_SEQ_LEN, max_batch_size=1)

    def answer(dialog):
        return "".join(api.stream_chat_completion(dialog, temperature=0, max_gen_len=MAX_GEN_LEN))

    first = answer([{"role": "user", "content": "Hello there"}])
    # With the system prompt the first exchange no longer fits, so it is dropped with a notice.
    second = answer([SYSTEM, {"role": "user", "content": "How are you?"}])
    third = answer([SYSTEM, {"role": "user", "content": "Zürich, 日本?"}])  # /reset keeps the system prompt
    expected = [
        "You: Hello there\n", f"Assistant: {first}\n",
        "You: /system Always answer in French.\n(system prompt set)\n",
        "(the 1 oldest exchange no longer fit in max_seq_len and were dropped)\n",
        f"Assistant: {second}\n",
        "You: /reset\n(conversation cleared)\n", "You: Zürich, 日本?\n", f"Assistant: {third}\n",
        "You: \n(end of input)",
    ]
    position = 0
    for part in expected:  # in this order, each once
        found = transcript.find(part, position)
        assert found >= 0, f"{part!r} missing after position {position} of:\n{transcript}"
        position = found + len(part)
    assert transcript.count("Assistant: ") == 3
    assert len({first, second, third}) == 3  # so the order above is checked


def test_ctrl_c_in_a_terminal_stops_only_the_reply(checkpoints):
    """In a terminal, torchrun would end the whole job on SIGINT; chat.py reads Ctrl-C as a key instead."""
    command = torchrun_command(2, str(LAUNCH / "chat.py"), "--ckpt_dir", checkpoints[2], "--tokenizer_path",
                               str(LLAMA2_TOKENIZER), "--temperature", "0", "--max_seq_len", "1024")
    pid, terminal = pty.fork()
    if pid == 0:  # the child: torchrun, with the pseudo-terminal as its controlling terminal
        os.chdir(ROOT)
        os.execve(command[0], command, environment())
    screen, status = Screen(terminal), None
    try:
        screen.wait_for("You: ")
        os.write(terminal, b"Hello\n")
        screen.wait_for("Assistant: ")
        os.write(terminal, b"\x03")  # Ctrl-C, long before the 768-token reply can end
        screen.wait_for(" (stopped)\r\nYou: ")
        os.write(terminal, b"/reset\n")
        screen.wait_for("(conversation cleared)\r\nYou: ")
        os.write(terminal, b"\x04")  # Ctrl-D
        screen.wait_for("(end of input)")
        _, status = os.waitpid(pid, 0)
    finally:
        if status is None:  # a step failed: stop torchrun, which stops its workers
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)
        screen.drain()  # torchrun's summary of a failed rank, for the message below
        os.close(terminal)
    assert os.waitstatus_to_exitcode(status) == 0, screen.text


def test_a_terminal_edits_lines_keeps_history_and_drops_a_line_at_ctrl_c(checkpoints):
    """readline on rank 0, while its heartbeats keep rank 1 (waiting in a broadcast) from timing out."""
    command = torchrun_command(2, str(LAUNCH / "chat.py"), "--ckpt_dir", checkpoints[2], "--tokenizer_path",
                               str(LLAMA2_TOKENIZER), "--temperature", "0", "--max_seq_len", "64")
    pid, terminal = pty.fork()
    if pid == 0:
        os.chdir(ROOT)
        os.execve(command[0], command, environment() | {"LLAMA_TP_TIMEOUT": "15"})
    screen, status = Screen(terminal), None
    try:
        screen.wait_for("You: ")
        time.sleep(20)  # idle beyond the timeout: only the heartbeats keep rank 1 waiting
        os.write(terminal, b"/rset" + b"\x1b[D" * 3 + b"e\r")  # three steps left, an e: /reset
        screen.wait_for("(conversation cleared)\r\nYou: ")
        os.write(terminal, b"\x1b[A\r")  # up: the line before, again
        screen.wait_for("(conversation cleared)\r\nYou: ")
        os.write(terminal, b"half a thought\x03")  # Ctrl-C, no Enter
        screen.wait_for("(line cancelled)\r\nYou: ", timeout=10)
        os.write(terminal, b"\x04")
        screen.wait_for("(end of input)")
        _, status = os.waitpid(pid, 0)
    finally:
        if status is None:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)
        screen.drain()
        os.close(terminal)
    assert os.waitstatus_to_exitcode(status) == 0, screen.text


class Screen:
    """What a program writes to a pseudo-terminal, read until an expected text shows up."""

    def __init__(self, fd: int):
        self.fd = fd
        self.text = ""

    def wait_for(self, expected: str, timeout: float = 60) -> None:
        start = len(self.text)
        deadline = time.monotonic() + timeout
        while expected not in self.text[start:]:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{expected!r} did not appear within {timeout} s:\n{self.text}"
            if select.select([self.fd], [], [], remaining)[0]:
                assert self._read(), f"the program ended before {expected!r} appeared:\n{self.text}"

    def drain(self) -> None:
        """Read what is left once the program has ended."""
        while select.select([self.fd], [], [], 0)[0] and self._read():
            pass

    def _read(self) -> bool:
        """Add what is ready to the text; False once the program has ended."""
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # Linux reports a pseudo-terminal whose program ended as EIO
            data = b""
        self.text += data.decode(errors="replace")
        return bool(data)


def test_each_turn_reuses_the_conversation_so_far_until_reset(checkpoints):
    """The second turn sends the first again and feeds only what is new (the first turn fills a
    block of the KV cache, which the second shares); after /reset a new conversation shares
    nothing (LLAMA_TP_LOG=debug shows the reuse on stderr)."""
    first = " ".join(["Hello there, tell me about the weather today and tomorrow in the city by the sea."] * 3)
    session = f"{first}\nTell me more\n/reset\nGoodbye\n"
    result = run_script("chat.py", 1, "--ckpt_dir", checkpoints[1], "--tokenizer_path", str(LLAMA2_TOKENIZER),
                        "--temperature", "0", "--max_seq_len", "128", "--max_gen_len", str(MAX_GEN_LEN),
                        stdin=session, timeout=90, env={"LLAMA_TP_LOG": "debug"})
    assert result.stderr.count("reusing the cache") == 1, result.stderr
    assert result.stdout.count("Assistant: ") == 3
