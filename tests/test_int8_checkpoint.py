"""int8 checkpoints (convert and reshard --quantize int8): what they store, and that they load to
exactly the model that quantizing at load time gives, on any number of processes."""

import json

import pytest
import torch
from tokenizers import Tokenizer

from llama_tp import Llama
from llama_tp.model.args import ModelArgs
from llama_tp.checkpoint import load_shard, shard_paths
from llama_tp.tools.convert.__main__ import main as convert
from llama_tp.tools.convert.writer import shard_of
from llama_tp.checkpoint.quantized import check_split
from llama_tp.kernels.int8 import quantize_int8
from llama_tp.model.quantize import Int4Linear, Int8Linear
from llama_tp.tools.reshard import reshard
from llama_tp.checkpoint.sharding import COLUMN_PARALLEL, ROW_PARALLEL
from distributed import run_world
from test_convert_gguf_model import write_tiny_gguf
from test_convert_hf import byte_level_tokenizer, hf_folder
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint

VOCAB = 32000  # the Llama 2 tokenizer's, for the checkpoints that are loaded
# One KV head: two shards each hold a copy of it, and of its scales and zeros.
ONE_KV_HEAD = TINY_LLAMA2 | {"n_kv_heads": 1, "vocab_size": 512}
# ffn size 176, in int8 groups of 16: halves of 88 inputs would cut a group.
MISALIGNED = TINY_LLAMA2 | {"multiple_of": 16}
PROMPTS = [[1, 450, 6593, 310], [1, 15043]]
GRID = ("weight", "scales", "zeros")


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in COLUMN_PARALLEL + ROW_PARALLEL


def read_all(folder) -> list[dict[str, torch.Tensor]]:
    return [dict(load_shard(path)) for path in shard_paths(folder)]


def assert_same_shards(got, expected) -> None:
    for got_shard, expected_shard in zip(got, expected, strict=True):
        assert got_shard.keys() == expected_shard.keys()
        for name, tensor in expected_shard.items():
            assert got_shard[name].dtype == tensor.dtype and torch.equal(got_shard[name], tensor), name


@pytest.mark.parametrize("mp", [1, 2])
def test_reshard_quantize_stores_the_whole_layers_int8_split_as_the_weight(tmp_path, mp):
    weights = full_weights(ONE_KV_HEAD, 512)
    source = write_checkpoint(tmp_path / "fp", ONE_KV_HEAD, weights, 1, "vocab")
    reshard(source, tmp_path / "int8", mp, quantize="int8")
    args = ModelArgs.from_dict(ONE_KV_HEAD)
    shards = read_all(tmp_path / "int8")
    assert len(shards) == mp
    for rank, shard in enumerate(shards):
        linear = [name for name in weights if is_linear(name)]
        assert len(linear) == 2 * 7 + 1
        stored = {f"{name.removesuffix('.weight')}.{part}" for name in linear for part in GRID}
        assert shard.keys() == stored | set(weights) | {"rope.freqs"}
        for name in set(weights) - set(linear):
            assert shard[name].dtype == torch.bfloat16, name
        for name in linear:
            layer = name.removesuffix(".weight")
            q, scales, zeros = (shard[f"{layer}.{part}"] for part in GRID)
            assert q.dtype == torch.int8 and scales.dtype == zeros.dtype == torch.float32
            assert q.shape == shard_of(name, weights[name], rank, mp, args).shape
            assert scales.shape == zeros.shape == (q.shape[0], q.shape[1] // 32)  # dim 64, ffn 192: groups of 32
            # The whole layer quantized, then split as its weight is (wo, w2 by groups; wk, wv copied).
            for part, whole in zip(GRID, quantize_int8(weights[name])):
                assert torch.equal(shard[f"{layer}.{part}"], shard_of(f"{layer}.{part}", whole, rank, mp, args)), (layer, part)


def test_resharding_an_int8_checkpoint_keeps_it_int8(tmp_path):
    source = write_checkpoint(tmp_path / "fp", ONE_KV_HEAD, full_weights(ONE_KV_HEAD, 512), 1, "vocab")
    reshard(source, tmp_path / "int8-1", 1, quantize="int8")
    reshard(source, tmp_path / "int8-2", 2, quantize="int8")
    reshard(tmp_path / "int8-1", tmp_path / "split", 2)
    reshard(tmp_path / "int8-2", tmp_path / "merged", 1, quantize="int8")  # already int8: only resharded
    assert_same_shards(read_all(tmp_path / "split"), read_all(tmp_path / "int8-2"))
    assert_same_shards(read_all(tmp_path / "merged"), read_all(tmp_path / "int8-1"))


def test_int8_checkpoint_file_holds_about_a_third_of_fp32s_linear_bytes(tmp_path):
    weights = {name: tensor.float() for name, tensor in full_weights(ONE_KV_HEAD, 512).items()}
    source = write_checkpoint(tmp_path / "fp32", ONE_KV_HEAD, weights, 1, "vocab")
    reshard(source, tmp_path / "int8", 1, quantize="int8")
    other_bytes = sum(4 * tensor.numel() for name, tensor in weights.items() if not is_linear(name))
    fp32, int8 = ((folder / "consolidated.00.pth").stat().st_size - other_bytes for folder in (source, tmp_path / "int8"))
    assert 0.28 < int8 / fp32 < 0.36  # 1.25 bytes per weight against 4: 0.3125


def test_convert_hf_quantize_equals_reshard_quantize_and_refuses_cut_groups(tmp_path):
    hf_folder(tmp_path / "hf", tied=False)  # ffn size 176: int8 groups of 16
    convert("hf", str(tmp_path / "hf"), str(tmp_path / "fp"), mp=1, dtype="fp32")
    convert("hf", str(tmp_path / "hf"), str(tmp_path / "int8"), mp=1, dtype="fp32", quantize="int8")
    reshard(tmp_path / "fp", tmp_path / "resharded", 1, quantize="int8")
    assert_same_shards(read_all(tmp_path / "int8"), read_all(tmp_path / "resharded"))
    assert (tmp_path / "int8" / "llama_tp.json").is_file()
    with pytest.raises(ValueError, match=r"feed_forward\.w2 \(in every layer\) has 176 inputs, quantized in int8 "
                                         r"groups of 16: split 2 ways, parts of 88 inputs would cut its groups; "
                                         r"choose an --mp whose shards hold whole groups \(whole groups: 1\)"):
        convert("hf", str(tmp_path / "hf"), str(tmp_path / "mp2"), mp=2, quantize="int8")
    assert not (tmp_path / "mp2").exists()
    with pytest.raises(ValueError, match="--quantize int8_dynamic is applied at load time only"):
        convert("hf", str(tmp_path / "hf"), str(tmp_path / "dynamic"), quantize="int8_dynamic")
    with pytest.raises(ValueError, match="--quantize 'int2' is not supported; use int8 or int4 or leave it unset"):
        reshard(tmp_path / "fp", tmp_path / "int2", 1, quantize="int2")
    with pytest.raises(ValueError, match="--quantize int8_dynamic is applied at load time only"):
        reshard(tmp_path / "fp", tmp_path / "dynamic", 1, quantize="int8_dynamic")


@pytest.mark.parametrize("mp", [2, 4])  # 4: each shard holds a copy of one of the 2 KV heads
def test_convert_gguf_quantize_equals_reshard_quantize(tmp_path, mp):
    byte_level_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    vocab = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    write_tiny_gguf(tmp_path / "tiny.gguf", json.loads(tokenizer.to_str()), vocab)
    convert("gguf", str(tmp_path / "tiny.gguf"), str(tmp_path / "fp"), mp=mp)  # its embedding split as convert splits it
    convert("gguf", str(tmp_path / "tiny.gguf"), str(tmp_path / "int8"), mp=mp, quantize="int8")
    reshard(tmp_path / "fp", tmp_path / "resharded", mp, quantize="int8")
    shards = read_all(tmp_path / "int8")
    assert_same_shards(shards, read_all(tmp_path / "resharded"))
    assert shards[0]["layers.0.feed_forward.w2.weight"].dtype == torch.int8
    assert shards[0]["layers.0.feed_forward.w2.scales"].shape == (256, 512 // mp // 32)  # ffn 512 split by inputs


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """A bf16 checkpoint, its int8 and int4 copies of 1 and 2 shards, and an int8 model that 2
    processes cannot split (test_int4_checkpoint.py uses them too)."""
    root = tmp_path_factory.mktemp("quantized")
    source = write_checkpoint(root / "bf16", TINY_LLAMA2, full_weights(TINY_LLAMA2, VOCAB), 1, "dim")
    for quantize in ("int8", "int4"):
        for shards in (1, 2):
            reshard(source, root / f"{quantize}-{shards}", shards, quantize=quantize)
    misaligned = write_checkpoint(root / "misaligned-bf16", MISALIGNED, full_weights(MISALIGNED, VOCAB), 1, "dim")
    reshard(misaligned, root / "misaligned", 1, quantize="int8")
    return {path.name: str(path) for path in root.iterdir()}


def outputs(folder: str, quantize=None) -> dict:
    """Logits of a prompt, of a two-row and a one-row step (the kernels' cases), greedy tokens, the
    kinds of quantized layers built and the bytes the model holds."""
    llama = Llama.build(folder, str(LLAMA2_TOKENIZER), max_seq_len=32, max_batch_size=2, quantize=quantize)
    forward = llama.model.forward
    logits = [forward(torch.tensor([[1, 450, 6593, 310], [1, 15043, 29871, 13]]), 0),
              forward(torch.tensor([[450], [306]]), 4), forward(torch.tensor([[338]]), 5)]
    tokens, _ = llama.generate(PROMPTS, max_gen_len=8, temperature=0)
    layers = [type(m).__name__ for m in llama.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    held = sum(tensor.nbytes for tensor in llama.model.state_dict().values())
    return {"logits": logits, "tokens": tokens, "layers": layers, "held": held}


@pytest.fixture(scope="module")
def one_process(folders) -> dict:
    """At world size 1: the bf16 checkpoint quantized at load, and the int8 checkpoints."""
    return {"load-time": outputs(folders["bf16"], "int8"), "int8-1": outputs(folders["int8-1"]),
            "int8-1 asked": outputs(folders["int8-1"], "int8"), "int8-2": outputs(folders["int8-2"])}


def test_int8_checkpoint_gives_exactly_load_time_int8(one_process):
    expected = one_process["load-time"]
    assert len(set(t for row in expected["tokens"] for t in row)) > 2, "a degenerate model proves little"
    for case in ("int8-1", "int8-1 asked", "int8-2"):  # int8-2: two shards merged while loading
        got = one_process[case]
        assert got["layers"] == ["Int8Linear"] * (2 * 4 + 1), case
        assert got["tokens"] == expected["tokens"], case
        for got_logits, expected_logits in zip(got["logits"], expected["logits"], strict=True):
            assert torch.equal(got_logits, expected_logits), case


def test_loading_an_int8_checkpoint_says_so_once(folders, capsys):
    Llama.build(folders["int8-1"], str(LLAMA2_TOKENIZER), max_seq_len=8, max_batch_size=1)
    assert capsys.readouterr().err.count("stores its linear layers as int8: loading them as int8") == 1


def _on_two_ranks(folders: dict[str, str]) -> dict:
    results = {"int8-2": outputs(folders["int8-2"]), "int8-1": outputs(folders["int8-1"])}
    try:
        Llama.build(folders["misaligned"], str(LLAMA2_TOKENIZER), max_seq_len=8, max_batch_size=1)
    except ValueError as error:
        results["misaligned"] = str(error)
    return results


def assert_ranks_agree_with_one_process(ranks: list[dict], expected: dict) -> None:
    """Each case's outputs on both ranks are the same, and one process's to fp32 rounding."""
    for case in ranks[0]:
        if case == "misaligned":
            continue
        got, other = ranks[0][case], ranks[1][case]
        assert got["tokens"] == other["tokens"] == expected["tokens"], case
        for got_logits, other_logits, expected_logits in zip(got["logits"], other["logits"], expected["logits"]):
            assert torch.equal(got_logits, other_logits)
            scale = expected_logits.abs().max()
            torch.testing.assert_close(got_logits, expected_logits, rtol=1e-5, atol=1e-5 * scale, msg=case)


@pytest.mark.slow
def test_int8_checkpoints_on_two_processes_match_one(folders, one_process):
    """2 shards on 2 ranks, and 1 shard split over them while loading, agree with one process."""
    ranks = run_world(2, _on_two_ranks, folders)
    assert_ranks_agree_with_one_process(ranks, one_process["int8-1"])
    for rank in ranks:
        message = rank.get("misaligned", "no error")
        assert "feed_forward.w2 (in every layer) has 176 inputs, quantized in int8 groups of 16: split 2 ways, " \
               "parts of 88 inputs would cut its groups" in message
        assert "run it on a number of processes whose slices hold whole groups, or load the full-precision " \
               "checkpoint with quantize='int8'" in message and message.endswith("(whole groups: 1)")


def test_int8_dynamic_is_refused_for_an_int8_checkpoint(folders):
    with pytest.raises(ValueError, match=r"quantize='int8_dynamic' cannot load .*int8-1: its linear layers are "
                                         r"stored as grouped int8 already.*load it with quantize='int8'"):
        Llama.build(folders["int8-1"], str(LLAMA2_TOKENIZER), max_seq_len=8, max_batch_size=1, quantize="int8_dynamic")


def test_check_split_names_the_layer_and_the_part_counts_that_fit():
    args = ModelArgs.from_dict(MISALIGNED).with_vocab_size(VOCAB)
    check_split(args, 1, "int8", fix="unused")
    with pytest.raises(ValueError, match=r"feed_forward\.w2 .* 176 inputs.* groups of 16: split 2 ways, parts of "
                                         r"88 inputs .*; do this \(whole groups: 1\)"):
        check_split(args, 2, "int8", fix="do this")
    wide = ModelArgs.from_dict(TINY_LLAMA2).with_vocab_size(VOCAB)  # wo 64 and w2 192 wide: 2 and 6 groups
    check_split(wide, 2, "int8", fix="unused")
    with pytest.raises(ValueError, match=r"attention\.wo .* 64 inputs.* parts of 16 inputs .*whole groups: 1, 2\)"):
        check_split(wide, 4, "int8", fix="do this")
