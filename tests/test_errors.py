"""Every user mistake ends a world-size-2 job on every rank, promptly, with a message that names it.

Each case runs as two real processes with torchrun's environment (see jobs.py): every rank must
exit non-zero by itself within the time limit, print "llama_tp error on rank N" with the case's
key words, and show no traceback. A few cases also run under torchrun itself, end to end.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from jobs import LAUNCH, run_forked, run_torchrun
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint

pytestmark = pytest.mark.slow  # torchrun and two-process jobs, one per mistake

TIME_LIMIT = 30  # seconds, from the issue
TEXT = LAUNCH / "text_completion.py"
CHAT = LAUNCH / "chat_completion.py"
# A chat script that sends one malformed dialog: the launch scripts only send their examples.
BAD_DIALOG_SCRIPT = '''
from llama_tp import Llama
from llama_tp.tools.cli import run

def main(ckpt_dir: str, tokenizer_path: str):
    generator = Llama.build(ckpt_dir, tokenizer_path, max_seq_len=64, max_batch_size=2)
    generator.chat_completion([[{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]])

run(main)
'''

# A script that gives each rank different prompts, as a per-node prompts file might.
RANK_PROMPTS_SCRIPT = '''
import os
from llama_tp import Llama
from llama_tp.tools.cli import run

def main(ckpt_dir: str, tokenizer_path: str):
    generator = Llama.build(ckpt_dir, tokenizer_path, max_seq_len=64, max_batch_size=2)
    generator.text_completion(["a prompt for rank " + os.environ["RANK"] * 10], max_gen_len=4)

run(main)
'''


@dataclass(frozen=True)
class Mistake:
    name: str
    # (the good checkpoint, a fresh folder to build in) -> script and its arguments
    setup: Callable[[Path, Path], tuple[Path, list[str]]]
    words: tuple[str, ...]  # must all appear in every rank's message


@pytest.fixture(scope="session")
def good_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("good") / "ckpt"
    return write_checkpoint(directory, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 2, "dim")


def text_args(ckpt: Path, *extra: str, tokenizer: Path = LLAMA2_TOKENIZER) -> tuple[Path, list[str]]:
    return TEXT, ["--ckpt_dir", str(ckpt), "--tokenizer_path", str(tokenizer), "--max_gen_len", "2", *extra]


def copy_of(good: Path, folder: Path) -> Path:
    return Path(shutil.copytree(good, folder / "ckpt"))


def with_params(params: object, raw: bool = False) -> Callable[[Path, Path], tuple[Path, list[str]]]:
    def setup(good: Path, folder: Path) -> tuple[Path, list[str]]:
        ckpt = copy_of(good, folder)
        (ckpt / "params.json").write_text(params if raw else json.dumps(params))
        return text_args(ckpt)
    return setup


def with_shard(rank: int, damage: Callable[[Path], None]) -> Callable[[Path, Path], tuple[Path, list[str]]]:
    """One rank's shard damaged, so only that rank sees the problem at first."""
    def setup(good: Path, folder: Path) -> tuple[Path, list[str]]:
        ckpt = copy_of(good, folder)
        damage(ckpt / f"consolidated.{rank:02d}.pth")
        return text_args(ckpt)
    return setup


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100_000])


def not_torch(path: Path) -> None:
    path.write_text("this is not a checkpoint\n")


def wrong_shape(path: Path) -> None:
    shard = torch.load(path, weights_only=True)
    shard["layers.1.feed_forward.w1.weight"] = shard["layers.1.feed_forward.w1.weight"][:-8]
    torch.save(shard, path)


def missing_dir(good: Path, folder: Path) -> tuple[Path, list[str]]:
    return text_args(folder / "nowhere")


def empty_dir(good: Path, folder: Path) -> tuple[Path, list[str]]:
    (folder / "empty").mkdir()
    return text_args(folder / "empty")


def no_params(good: Path, folder: Path) -> tuple[Path, list[str]]:
    ckpt = copy_of(good, folder)
    (ckpt / "params.json").unlink()
    return text_args(ckpt)


def no_shards(good: Path, folder: Path) -> tuple[Path, list[str]]:
    ckpt = copy_of(good, folder)
    for shard in ckpt.glob("*.pth"):
        shard.unlink()
    return text_args(ckpt)


def other_vocabulary(good: Path, folder: Path) -> tuple[Path, list[str]]:
    ckpt = folder / "vocab"
    write_checkpoint(ckpt, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32002), 2, "dim")
    return text_args(ckpt)


def missing_tokenizer(good: Path, folder: Path) -> tuple[Path, list[str]]:
    return text_args(good, tokenizer=folder / "tokenizer.model")


def unknown_tokenizer(good: Path, folder: Path) -> tuple[Path, list[str]]:
    (folder / "tokenizer.model").write_text("not a tokenizer\n")
    return text_args(good, tokenizer=folder / "tokenizer.model")


def prompts_file(content: str, script: Path) -> Callable[[Path, Path], tuple[Path, list[str]]]:
    def setup(good: Path, folder: Path) -> tuple[Path, list[str]]:
        (folder / "prompts.json").write_text(content)
        _, args = text_args(good, "--prompts_file", str(folder / "prompts.json"))
        return script, args
    return setup


def flags(*extra: str) -> Callable[[Path, Path], tuple[Path, list[str]]]:
    return lambda good, folder: text_args(good, *extra)


def bad_dialog(good: Path, folder: Path) -> tuple[Path, list[str]]:
    script = folder / "bad_dialog.py"
    script.write_text(BAD_DIALOG_SCRIPT)
    return script, ["--ckpt_dir", str(good), "--tokenizer_path", str(LLAMA2_TOKENIZER)]


def prompts_per_rank(good: Path, folder: Path) -> tuple[Path, list[str]]:
    script = folder / "rank_prompts.py"
    script.write_text(RANK_PROMPTS_SCRIPT)
    return script, ["--ckpt_dir", str(good), "--tokenizer_path", str(LLAMA2_TOKENIZER)]


MISTAKES = [
    Mistake("checkpoint dir missing", missing_dir, ("checkpoint directory", "nowhere does not exist")),
    Mistake("checkpoint dir empty", empty_dir, ("checkpoint directory", "empty is empty", "--ckpt_dir")),
    Mistake("params.json missing", no_params, ("params.json", "does not exist")),
    Mistake("no shards", no_shards, ("no consolidated.XX.pth", "--ckpt_dir")),
    Mistake("params.json not JSON", with_params('{"dim": 64,', raw=True), ("not valid JSON",)),
    Mistake("params.json not an object", with_params([64]), ("JSON object", "list")),
    Mistake("params.json wrong type", with_params({**TINY_LLAMA2, "dim": "64"}),
            ("dim", "must be int", "'64'")),
    Mistake("params.json unknown key", with_params({**TINY_LLAMA2, "n_head": 4}), ("unknown key 'n_head'",)),
    Mistake("shard truncated on rank 1", with_shard(1, truncate),
            ("consolidated.01.pth is not a torch checkpoint", "truncated")),
    Mistake("shard not torch on rank 0", with_shard(0, not_torch),
            ("consolidated.00.pth is not a torch checkpoint",)),
    Mistake("shard shapes inconsistent", with_shard(1, wrong_shape),
            ("consolidated.01.pth", "layers.1.feed_forward.w1.weight", "do not belong to one checkpoint")),
    Mistake("world size the model cannot split over", with_params({**TINY_LLAMA2, "n_heads": 1}),
            ("cannot be split over 2", "world sizes that work: 1")),
    Mistake("tokenizer missing", missing_tokenizer, ("tokenizer.model does not exist", "--tokenizer_path")),
    Mistake("tokenizer of unknown kind", unknown_tokenizer, ("tokenizer.model is not a",)),
    Mistake("vocab sizes differ", other_vocabulary, ("32002", "32000", "tokenizer")),
    Mistake("params vocab_size differs", with_params({**TINY_LLAMA2, "vocab_size": 32001}),
            ("vocab_size 32001", "32000")),
    Mistake("max_seq_len zero", flags("--max_seq_len", "0"), ("max_seq_len", "positive", "0")),
    Mistake("max_batch_size negative", flags("--max_batch_size", "-1"),
            ("max_batch_size", "positive", "-1")),
    Mistake("prompt longer than max_seq_len", flags("--max_seq_len", "8"),
            ("max_seq_len is 8", "--max_seq_len")),
    Mistake("temperature negative", flags("--temperature", "-0.5"), ("temperature", "-0.5")),
    Mistake("top_p zero", flags("--top_p", "0"), ("top_p", "(0, 1]", "0")),
    Mistake("top_p above one", flags("--top_p", "1.5"), ("top_p", "(0, 1]", "1.5")),
    Mistake("max_gen_len zero", flags("--max_gen_len", "0"), ("max_gen_len", "positive", "0")),
    Mistake("bad dialog", bad_dialog, ("dialog 0: message 1", "'assistant' was expected")),
    Mistake("a draft without speculation", flags("--draft_quantize", "int8"),
            ("draft_quantize='int8' is given without speculation", "speculate='draft'")),
    Mistake("speculate_k out of range", flags("--speculate", "lookup", "--speculate_k", "20"),
            ("speculate_k", "1 to 15", "20")),
    Mistake("different prompts on each rank", prompts_per_rank,
            ("the generation arguments on rank(s) 1 differ from rank 0's", "same arguments")),
    Mistake("prompts file not JSON", prompts_file("['unclosed", TEXT), ("prompts.json is not valid JSON",)),
    Mistake("prompts file not a list of strings", prompts_file('{"prompt": "hi"}', TEXT),
            ("prompts.json must hold a non-empty JSON list",)),
    Mistake("prompts file with a lone surrogate", prompts_file('["ok", "bad \\ud800 text"]', TEXT),
            ("not valid Unicode", "lone surrogate")),
    Mistake("prompts file with a bad dialog", prompts_file(
        json.dumps([[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]]), CHAT),
            ("dialog 0: message 1 has role 'user'",)),
]


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.name for m in MISTAKES])
def test_mistake_stops_every_rank_with_its_message(mistake: Mistake, good_checkpoint: Path, tmp_path: Path):
    script, args = mistake.setup(good_checkpoint, tmp_path)
    job = run_forked(script, args, timeout=TIME_LIMIT + 10)
    assert job.seconds < TIME_LIMIT
    for rank, (code, stderr) in enumerate(zip(job.returncodes, job.stderr)):
        assert code == 1, f"rank {rank} exited with {code}:\n{stderr}"
        assert f"llama_tp error on rank {rank}: " in stderr
        for word in mistake.words:
            assert word in stderr, f"rank {rank} does not say {word!r}:\n{stderr}"
        assert "Traceback" not in stderr


@pytest.mark.parametrize("flag, value, message", [
    ("--temprature", "0.5", "--temprature: no such option; did you mean --temperature?"),
    ("--temperature", "hot", "--temperature hot: expected a number or None"),
])
def test_a_command_line_mistake_stops_every_rank_with_exit_code_2(flag, value, message, good_checkpoint: Path):
    script, args = text_args(good_checkpoint, flag, value)
    job = run_forked(script, args, timeout=TIME_LIMIT)
    for rank, (code, stderr) in enumerate(zip(job.returncodes, job.stderr)):
        assert code == 2
        assert stderr.strip().splitlines() == [f"llama_tp error on rank {rank}: {message}"]


def test_a_rank_that_never_starts_times_out_with_a_message(good_checkpoint: Path):
    """Process-group start-up has a timeout (LLAMA_TP_TIMEOUT): rank 0 alone does not wait forever."""
    script, args = text_args(good_checkpoint)
    job = run_forked(script, args, timeout=TIME_LIMIT, started=[0], LLAMA_TP_TIMEOUT="2")
    assert job.returncodes == [1], job.stderr[0]
    assert "llama_tp error on rank 0: gave up waiting for the other processes" in job.stderr[0]
    assert "LLAMA_TP_TIMEOUT" in job.stderr[0] and "Traceback" not in job.stderr[0]


def test_debug_keeps_the_traceback(good_checkpoint: Path, tmp_path: Path):
    script, args = with_shard(1, truncate)(good_checkpoint, tmp_path)
    job = run_forked(script, args, timeout=TIME_LIMIT, LLAMA_TP_DEBUG="1")
    assert all(code == 1 for code in job.returncodes)
    assert all("Traceback" in stderr for stderr in job.stderr)


def test_torchrun_ends_the_job_with_our_message_as_root_cause(good_checkpoint: Path, tmp_path: Path):
    """End to end: only rank 1's shard is bad, so rank 0 learns it from the agreement."""
    script, args = with_shard(1, truncate)(good_checkpoint, tmp_path)
    job = run_torchrun(script, args, timeout=TIME_LIMIT + 10)
    assert job.returncodes == [1]
    assert job.seconds < TIME_LIMIT
    stderr = job.stderr[0]
    assert "llama_tp error on rank 0: rank 1 failed while loading the model" in stderr
    assert "llama_tp error on rank 1: " in stderr
    # torchrun's summary quotes our message instead of pointing at its docs.
    root_cause = stderr.split("Root Cause")[1]
    assert "consolidated.01.pth is not a torch checkpoint" in root_cause
