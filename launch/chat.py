"""Chat with a Llama chat checkpoint split across the torchrun processes, one turn at a time.

    torchrun --nproc_per_node N launch/chat.py --ckpt_dir DIR --tokenizer_path FILE

Rank 0 reads your lines from stdin (a terminal or a pipe) and hands them to every rank; the reply
streams as it is generated. Each turn sends the whole conversation, whose keys and values are
still in the cache from the turn before: only the newest message is prefilled. Commands:
/system TEXT (set the system prompt; /system alone clears it), /reset (forget the conversation),
/exit. In a terminal, lines are edited as in a shell (readline: arrow keys, history); Ctrl-C
stops the current reply, or drops the line being typed; Ctrl-D or the end of piped input ends
every rank. In a terminal, Ctrl-C is read as a key rather than a signal, so torchrun does not take
it as a request to stop the job; with piped input under torchrun, Ctrl-C reaches torchrun and
ends the job.
"""

import os
import select
import signal
import sys
import termios
import threading
from contextlib import contextmanager, nullcontext
from typing import Iterator, Optional, Union

from llama_tp import Dialog, Llama
from llama_tp.parallel import broadcast_object, collective_timeout, global_rank, print0
from llama_tp.sampling import check_given
from llama_tp.text.streaming import check_stop
from llama_tp.tools import demo
from llama_tp.tools.cli import run

CTRL_C = b"\x03"
WAITING = False  # broadcast while no line has arrived yet; None means end of input


def heartbeat_seconds() -> float:
    """While rank 0 waits for the user, the other ranks wait in a broadcast; rank 0 sends "still
    waiting" this often so that no collective runs into the process group's timeout."""
    return min(10.0, collective_timeout().total_seconds() / 3)


class Keyboard:
    """Rank 0's stdin: whole lines, edited with readline in a terminal, else read with a time limit
    (for the heartbeat); and Ctrl-C during replies."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buffer = b""
        self.closed = False
        self.interrupted = False
        self.tty = os.isatty(fd)
        self.saved_mode = termios.tcgetattr(fd) if self.tty else None
        # input() edits lines with readline where both ends are a terminal
        self.edits = self.tty and os.isatty(sys.stdout.fileno())
        if self.edits:
            import readline  # input() then edits lines (arrow keys, Ctrl-A, ...) and keeps their history

            # readline turns the terminal's signal keys back on while it reads: keep Ctrl-C a key
            readline.set_startup_hook(self._keys_not_signals)
            # Ctrl-C while typing: clear the line and hand in a Ctrl-C alone (chat says it was dropped)
            readline.parse_and_bind(r'"\C-c": "\C-e\C-u\C-v\C-c\n"')
        # A signal only reaches us when run without torchrun (e.g. python launch/chat.py < file).
        signal.signal(signal.SIGINT, self._on_interrupt)

    def _on_interrupt(self, signum, frame) -> None:
        self.interrupted = True

    def _keys_not_signals(self) -> None:
        """In a terminal, make Ctrl-C a key, not a signal (which would reach torchrun, not us)."""
        mode = termios.tcgetattr(self.fd)
        mode[3] &= ~termios.ISIG
        termios.tcsetattr(self.fd, termios.TCSANOW, mode)

    def ask(self, prompt: str) -> Optional[str]:
        """A line typed after prompt, with readline's editing and history; None at Ctrl-D."""
        try:
            line = input(prompt)
        except EOFError:
            return None
        if "\x03" in line:  # a dropped line (Ctrl-C) is no history
            import readline

            readline.remove_history_item(readline.get_current_history_length() - 1)
        return line

    def read_line(self, timeout: float) -> Union[str, None, bool]:
        """The next line, None at end of input, or WAITING if none arrived within timeout."""
        while b"\n" not in self.buffer and not self.closed:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if not ready:
                return WAITING
            data = os.read(self.fd, 65536)
            self.buffer += data
            self.closed = not data
        if not self.buffer:
            return None
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode("utf-8", errors="replace")

    def ctrl_c_pressed(self) -> bool:
        """Whether Ctrl-C came since the reply began (keys typed meanwhile are dropped)."""
        if self.tty and select.select([self.fd], [], [], 0)[0]:
            self.interrupted |= CTRL_C in os.read(self.fd, 65536)
        return self.interrupted

    @contextmanager
    def session(self) -> Iterator[None]:
        """In a terminal, make Ctrl-C a key (not a signal to torchrun); restore the terminal after."""
        if self.tty:
            self._keys_not_signals()
        try:
            yield
        finally:
            if self.tty:
                termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved_mode)

    @contextmanager
    def reply(self) -> Iterator[None]:
        """While a reply streams, read keys one by one without echo, so Ctrl-C is seen at once."""
        self.interrupted = False
        if self.tty:
            line_mode = termios.tcgetattr(self.fd)
            key_mode = termios.tcgetattr(self.fd)
            key_mode[3] &= ~(termios.ICANON | termios.ECHO)
            key_mode[6][termios.VMIN], key_mode[6][termios.VTIME] = 0, 0
            termios.tcsetattr(self.fd, termios.TCSADRAIN, key_mode)
        try:
            yield
        finally:
            if self.tty:
                termios.tcsetattr(self.fd, termios.TCSAFLUSH, line_mode)


def next_line(keyboard: Optional[Keyboard], prompt: str) -> Optional[str]:
    """Rank 0's next input line, typed after prompt, on every rank (None at end of input)."""
    if keyboard is not None and keyboard.edits:
        with heartbeats():
            line = keyboard.ask(prompt)
        return broadcast_object(line)
    print0(prompt, end="")
    while True:
        line = keyboard.read_line(heartbeat_seconds()) if keyboard else None
        line = broadcast_object(line)
        if line is not WAITING:
            return line


@contextmanager
def heartbeats() -> Iterator[None]:
    """While rank 0 waits in input(), say WAITING to the other ranks (waiting in next_line's
    broadcast) every heartbeat_seconds, from a thread of its own."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(heartbeat_seconds()):
            broadcast_object(WAITING)

    beating = threading.Thread(target=beat, name="chat heartbeat", daemon=True)
    beating.start()
    try:
        yield
    finally:
        done.set()
        beating.join()  # a heartbeat under way ends first: the line's broadcast comes after it


def fit(dialog: Dialog, generator: Llama, room: int) -> tuple[Dialog, int]:
    """Drop the oldest exchanges until the dialog leaves room tokens for the reply; how many went."""
    system = dialog[:1] if dialog[0]["role"] == "system" else []
    turns = dialog[len(system):]
    dropped = 0
    limit = generator.model.max_seq_len - room
    while len(turns) > 1 and len(generator.formatter.encode_dialog_prompt(system + turns)) > limit:
        turns = turns[2:]  # one user message and the assistant's answer
        dropped += 1
    return system + turns, dropped


def main(
    ckpt_dir: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    max_seq_len: int = 2048,
    max_gen_len: Optional[int] = None,
    system: Optional[str] = None,
    top_k: Optional[int] = None,
    repetition_penalty: Optional[float] = None,
    stop: Optional[list[str]] = None,
    min_gen_len: int = 0,
    seed: Optional[int] = None,
    dtype: Optional[str] = None,
    quantize: Optional[str] = None,
    compile: Optional[bool] = None,
    speculate: Optional[str] = None,
    speculate_k: Optional[int] = None,
    draft_ckpt_dir: Optional[str] = None,
    draft_quantize: Optional[str] = None,
    bad_words: Optional[list[str]] = None,
):
    """Chat in the terminal (or from a pipe) with a chat model.

    Args:
        ckpt_dir: folder with params.json and consolidated.XX.pth shards of a chat model; leave
            out both paths to chat with the built-in demo model (SmolLM2-135M-Instruct).
        tokenizer_path: the tokenizer file that came with the checkpoint.
        temperature: sampling temperature; 0 is greedy. Sampling settings left out are the
            model's recommended ones (a converted model's llama_tp.json), else Meta's (0.6).
        top_p: nucleus sampling threshold in (0, 1] (default: the model's, else 0.9).
        max_seq_len: the conversation window in tokens; older turns are dropped to stay inside it.
        max_gen_len: most tokens per reply; by default a quarter of max_seq_len is kept free for
            the reply, and it may run on to the end of the window.
        system: a system prompt to start with (change it with /system TEXT).
        top_k: sample only among the k most likely tokens (default: the model's, else no limit).
        repetition_penalty: >1 discourages tokens already in the dialog (default: the model's, else 1: off).
        stop: strings that end a reply, e.g. '["User:"]'; the reply is cut before them.
        min_gen_len: the end-of-turn token is impossible before this many tokens.
        seed: seed for sampling (default: the seed Llama.build sets).
        dtype: fp32, bf16 or fp16 (default: fp32 on CPU, bf16 or fp16 on GPU).
        quantize: int8 or int4 (weight-only; int4 on CPU) or int8_dynamic (CPU) linear layers,
            made at load time; a quantized checkpoint loads as it is stored.
        compile: compile the decoding step (by default on GPUs, not on CPUs) once the first
            reply has waited for the compiler (3-6 s on a CPU): then 1.1-1.9x faster steps on
            CPU (by CPU); worth it for long chats.
        speculate: draft or lookup: guess tokens, then verify several in one pass, with the same
            greedy answers (docs/speculative.md); a draft needs --draft_quantize or --draft_ckpt_dir.
        speculate_k: guesses a round, 1 to 15 (default: tuned for each mode).
        draft_ckpt_dir: the draft model's checkpoint, sharing the tokenizer (default: this model).
        draft_quantize: the draft's quantization: int4 or int8 alone makes such a copy of this model.
        bad_words: words no reply may hold, e.g. '["darn", "heck"]' (each in every way it is
            tokenized, with and without a leading space).
    """
    room = max_gen_len or max_seq_len // 4
    if room >= max_seq_len:
        raise ValueError(
            f"max_gen_len {max_gen_len} leaves no room for a prompt in max_seq_len {max_seq_len}; "
            "lower --max_gen_len or raise --max_seq_len"
        )
    # Mistakes in the options surface now rather than at the first reply.
    check_given(temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty,
                min_gen_len=min_gen_len, seed=seed)
    check_stop(stop)
    ckpt_dir, tokenizer_path = demo.model_paths(ckpt_dir, tokenizer_path)
    generator = Llama.build(ckpt_dir, tokenizer_path, max_seq_len, max_batch_size=1,
                            dtype=dtype, quantize=quantize, compile=compile,
                            speculate=speculate, speculate_k=speculate_k, draft_ckpt_dir=draft_ckpt_dir,
                            draft_quantize=draft_quantize)
    options = dict(temperature=temperature, top_p=top_p, max_gen_len=max_gen_len, top_k=top_k,
                   repetition_penalty=repetition_penalty, stop=stop, min_gen_len=min_gen_len, seed=seed,
                   bad_words=bad_words)
    keyboard = Keyboard(sys.stdin.fileno()) if global_rank() == 0 else None
    print0("Commands: /system TEXT, /reset, /exit. Ctrl-C stops a reply; Ctrl-D ends the chat.\n")
    with keyboard.session() if keyboard else nullcontext():
        chat(generator, keyboard, system, room, options)


def chat(generator: Llama, keyboard: Optional[Keyboard], system: Optional[str], room: int, options: dict) -> None:
    """The read-reply loop, run by every rank in lockstep."""
    turns: Dialog = []
    echo = keyboard is not None and not keyboard.tty  # show piped lines, so transcripts read well
    while True:
        line = next_line(keyboard, "You: ")
        if line is None:
            print0("\n(end of input)")
            return
        if echo:
            print0(line)
        line = line.strip()
        if "\x03" in line:
            print0("(line cancelled)")
        elif line == "/exit":
            return
        elif line == "/reset":
            turns = []
            generator.forget_prefixes()
            print0("(conversation cleared)")
        elif line == "/system" or line.startswith("/system "):
            system = line[len("/system"):].strip() or None
            generator.forget_prefixes()
            print0("(system prompt set)" if system else "(system prompt cleared)")
        elif line.startswith("/"):
            print0("(commands: /system TEXT, /reset, /exit)")
        elif line:
            turns = reply(generator, keyboard, system, turns + [{"role": "user", "content": line}], room, options)


def reply(generator: Llama, keyboard: Optional[Keyboard], system: Optional[str], turns: Dialog, room: int,
          options: dict) -> Dialog:
    """Stream the assistant's answer to turns; return the turns with it (or without the question if it cannot fit)."""
    prefix: Dialog = [{"role": "system", "content": system}] if system else []
    dialog, dropped = fit(prefix + turns, generator, room)
    if dropped:
        print0(f"(the {dropped} oldest exchange{'s' * (dropped > 1)} no longer fit in max_seq_len and were dropped)")
    if len(generator.formatter.encode_dialog_prompt(dialog)) >= generator.model.max_seq_len:
        print0(f"(that message is too long for max_seq_len {generator.model.max_seq_len}; try a shorter one)")
        return turns[:-1]
    print0("Assistant: ", end="")
    text, stopped = "", False
    with keyboard.reply() if keyboard else nullcontext():
        stream = generator.stream_chat_completion(dialog, **options)
        for piece in stream:
            print0(piece, end="")
            text += piece
            stopped = broadcast_object(keyboard.ctrl_c_pressed() if keyboard else None)
            if stopped:
                break
    print0(" (stopped)" if stopped else "")
    answer = text if stopped else stream.text
    return dialog[len(prefix):] + [{"role": "assistant", "content": answer}]


if __name__ == "__main__":
    run(main)
