"""Llama.build refuses broken set-ups with a message that names the problem and the fix."""

import json
import shutil

import pytest
import torch

from llama_tp import Llama


def build(ckpt_dir, tokenizer_path, **kwargs):
    return Llama.build(str(ckpt_dir), str(tokenizer_path), kwargs.pop("max_seq_len", 32), kwargs.pop("max_batch_size", 2), **kwargs)


@pytest.fixture
def checkpoint(tmp_path, checkpoints):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints["llama2", 1], folder)
    return folder


def test_missing_directory(tmp_path, tokenizer_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory .*nowhere does not exist; pass --ckpt_dir"):
        build(tmp_path / "nowhere", tokenizer_path)


def test_missing_params(checkpoint, tokenizer_path):
    (checkpoint / "params.json").unlink()
    with pytest.raises(FileNotFoundError, match="params.json does not exist"):
        build(checkpoint, tokenizer_path)


def test_no_shards(checkpoint, tokenizer_path):
    (checkpoint / "consolidated.00.pth").unlink()
    with pytest.raises(FileNotFoundError, match="no consolidated.XX.pth shard"):
        build(checkpoint, tokenizer_path)


def test_missing_tokenizer(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer file .* does not exist"):
        build(checkpoint, tmp_path / "tokenizer.model")


def test_truncated_shard_names_the_file(checkpoint, tokenizer_path):
    shard = checkpoint / "consolidated.00.pth"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ValueError, match="consolidated.00.pth is not a torch checkpoint .* truncated or corrupt"):
        build(checkpoint, tokenizer_path)


def test_vocab_size_disagreeing_with_the_tokenizer(checkpoint, tokenizer_path):
    params = json.loads((checkpoint / "params.json").read_text())
    (checkpoint / "params.json").write_text(json.dumps(params | {"vocab_size": 32001}))
    with pytest.raises(ValueError, match="vocab_size 32001 but the tokenizer has 32000"):
        build(checkpoint, tokenizer_path)


def test_params_that_do_not_match_the_shards(checkpoint, tokenizer_path):
    params = json.loads((checkpoint / "params.json").read_text())
    (checkpoint / "params.json").write_text(json.dumps(params | {"n_layers": 3}))
    with pytest.raises(ValueError, match=r"missing layers\.2\.attention"):
        build(checkpoint, tokenizer_path)


def test_unexpected_tensor_is_refused(checkpoint, tokenizer_path):
    shard = torch.load(checkpoint / "consolidated.00.pth")
    shard["layers.0.attention.bias"] = torch.zeros(3)
    torch.save(shard, checkpoint / "consolidated.00.pth")
    with pytest.raises(ValueError, match=r"unexpected layers\.0\.attention\.bias"):
        build(checkpoint, tokenizer_path)


def test_wrong_shape_names_the_tensor(checkpoint, tokenizer_path):
    shard = torch.load(checkpoint / "consolidated.00.pth")
    shard["layers.1.feed_forward.w2.weight"] = shard["layers.1.feed_forward.w2.weight"][:, :-1].clone()
    torch.save(shard, checkpoint / "consolidated.00.pth")
    with pytest.raises(ValueError, match=r"layers\.1\.feed_forward\.w2\.weight has shape"):
        build(checkpoint, tokenizer_path)


@pytest.mark.parametrize("limits", [{"max_seq_len": 0}, {"max_batch_size": -2}])
def test_limits_must_be_positive(checkpoint, tokenizer_path, limits):
    with pytest.raises(ValueError, match="must be a positive integer"):
        build(checkpoint, tokenizer_path, **limits)


def test_model_parallel_size_must_match_the_world(checkpoint, tokenizer_path):
    with pytest.raises(ValueError, match="model_parallel_size 2 differs from the world size 1"):
        build(checkpoint, tokenizer_path, model_parallel_size=2)


def test_compile_must_be_a_bool(checkpoint, tokenizer_path):
    with pytest.raises(ValueError, match="compile must be True or False, found 'yes'"):
        build(checkpoint, tokenizer_path, compile="yes")


def test_compile_without_a_cpp_compiler_is_a_clear_error(checkpoint, tokenizer_path, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ValueError, match=r"needs a C\+\+ compiler.*apt install g\+\+"):
        build(checkpoint, tokenizer_path, compile=True)


def test_int8_on_cpu_without_a_cpp_compiler_is_a_clear_error(checkpoint, tokenizer_path, monkeypatch):
    """Its kernels are compiled: say so at build, not from inside torch.compile at the first step."""
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ValueError, match=r"quantize='int8' on CPU needs a C\+\+ compiler.*'int8_dynamic'"):
        build(checkpoint, tokenizer_path, quantize="int8")
