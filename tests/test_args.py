import json

import pytest

from llama_tp.model.args import ModelArgs

LLAMA2_7B = {"dim": 4096, "multiple_of": 256, "n_heads": 32, "n_layers": 32, "norm_eps": 1e-05, "vocab_size": -1}
LLAMA3_8B = {
    "dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256,
    "multiple_of": 1024, "ffn_dim_multiplier": 1.3, "norm_eps": 1e-05, "rope_theta": 500000.0,
}


def test_meta_ffn_size_rule():
    assert ModelArgs.from_dict(LLAMA2_7B).ffn_hidden_dim == 11008
    assert ModelArgs.from_dict(LLAMA3_8B).ffn_hidden_dim == 14336
    assert ModelArgs.from_dict(LLAMA3_8B).kv_heads == 8
    assert ModelArgs.from_dict(LLAMA2_7B).kv_heads == 32


def test_vocab_size_comes_from_the_tokenizer_when_minus_one():
    assert ModelArgs.from_dict(LLAMA2_7B).with_vocab_size(32000).vocab_size == 32000
    with pytest.raises(ValueError, match="128256.*32000"):
        ModelArgs.from_dict(LLAMA3_8B).with_vocab_size(32000)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"n_head": 4}, "unknown key 'n_head'"),
        ({"dim": "4096"}, "dim must be int"),
        ({"use_scaled_rope": 1}, "use_scaled_rope must be bool"),
        ({"n_layers": True}, "n_layers must be int"),
        ({"n_kv_heads": 5}, "not a multiple of n_kv_heads"),
        ({"dim": 4100}, "not divisible by n_heads"),
    ],
)
def test_bad_params_name_the_key(change, words):
    with pytest.raises(ValueError, match=words):
        ModelArgs.from_dict(LLAMA2_7B | change)


def test_missing_required_key():
    params = dict(LLAMA2_7B)
    del params["n_layers"]
    with pytest.raises(ValueError, match="'n_layers' is missing"):
        ModelArgs.from_dict(params)


def test_load_reports_missing_and_invalid_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory .* is empty"):
        ModelArgs.load(tmp_path / "params.json")
    (tmp_path / "consolidated.00.pth").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="params.json does not exist"):
        ModelArgs.load(tmp_path / "params.json")
    (tmp_path / "params.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelArgs.load(tmp_path / "params.json")
    (tmp_path / "params.json").write_text(json.dumps(LLAMA3_8B))
    assert ModelArgs.load(tmp_path / "params.json").n_kv_heads == 8


def test_world_sizes_that_cannot_split_the_model_name_the_ones_that_can():
    args = ModelArgs.from_dict(LLAMA3_8B)
    args.check_model_parallel_size(8)
    args.check_model_parallel_size(16)  # more ranks than KV heads: each keeps a copy of one
    with pytest.raises(ValueError, match=r"cannot be split over 3 processes.*1, 2, 4, 8, 16, 32"):
        args.check_model_parallel_size(3)
