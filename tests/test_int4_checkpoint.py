"""int4 checkpoints (convert and reshard --quantize int4): they load int4 unasked and equal
load-time quantization, on one process or two, what cannot be split into whole groups is refused
with the counts that can, and quantized checkpoints load strictly."""

import shutil

import pytest
import torch

from llama_tp import Llama
from llama_tp.args import ModelArgs
from llama_tp.checkpoint.quantized import check_split
from llama_tp.memory import plan
from llama_tp.parallel import check_int4_device
from llama_tp.tools.convert.__main__ import main as convert
from llama_tp.tools.reshard import reshard
from distributed import run_world
from test_convert_hf import hf_folder
from test_int8_checkpoint import assert_ranks_agree_with_one_process, folders, outputs  # noqa: F401  (a fixture)
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2

VOCAB = 32000


@pytest.fixture(scope="module")
def one_process(folders) -> dict:
    return {"load-time": outputs(folders["bf16"], "int4"), "int4-1": outputs(folders["int4-1"]),
            "int4-2": outputs(folders["int4-2"], "int4")}


def test_int4_checkpoint_loads_unasked_to_exactly_load_time_int4(one_process):
    expected = one_process["load-time"]
    assert expected["layers"] == ["Int4Linear"] * 8 + ["Int8Linear"]  # wqkv, wo, w13, w2 per layer; the head
    planned = plan(ModelArgs.from_dict(TINY_LLAMA2).with_vocab_size(VOCAB), 1, 2, 32, torch.float32, "int4")
    assert expected["held"] == planned.weight_bytes  # python -m llama_tp.plan --quantize int4 counts it all
    for case in ("int4-1", "int4-2"):  # int4-2: two shards merged while loading
        got = one_process[case]
        assert got["layers"] == expected["layers"] and got["held"] == expected["held"], case
        assert got["tokens"] == expected["tokens"], case
        for got_logits, expected_logits in zip(got["logits"], expected["logits"], strict=True):
            assert torch.equal(got_logits, expected_logits), case


def test_loading_an_int4_checkpoint_says_so(folders, capsys):
    Llama.build(folders["int4-1"], str(LLAMA2_TOKENIZER), max_seq_len=8, max_batch_size=1)
    logged = capsys.readouterr().err
    assert "stores its linear layers as int4: loading them as int4 (quantize='int4')" in logged
    assert "int4 linear layers (the output head int8), other 4-byte weights" in logged


def _on_two_ranks(folders: dict[str, str]) -> dict:
    return {"int4-2": outputs(folders["int4-2"]), "int4-1": outputs(folders["int4-1"]),
            "load-time": outputs(folders["bf16"], "int4")}


def test_int4_on_two_processes_matches_one(folders, one_process):
    """2 shards on 2 ranks, 1 shard split over them while loading, and load-time int4 of each
    rank's slice (whole groups: the same codes) agree with one process."""
    assert_ranks_agree_with_one_process(run_world(2, _on_two_ranks, folders), one_process["int4-1"])


def test_check_split_names_the_layer_and_the_process_counts_that_fit():
    args = ModelArgs.from_dict(TINY_LLAMA2).with_vocab_size(VOCAB)  # wo 64 and w2 192 inputs: 2 and 6 groups
    check_split(args, 2, "int4", fix="unused")
    with pytest.raises(ValueError, match=r"attention\.wo \(in every layer\) has 64 inputs, quantized in int4 groups "
                                         r"of 32: split 4 ways, parts of 16 inputs would cut its groups; do this "
                                         r"\(whole groups: 1, 2\)"):
        check_split(args, 4, "int4", fix="do this")
    misaligned = ModelArgs.from_dict(TINY_LLAMA2 | {"multiple_of": 16}).with_vocab_size(VOCAB)  # ffn 176
    with pytest.raises(ValueError, match=r"feed_forward\.w2 \(in every layer\) has 176 inputs, not whole int4 "
                                         r"groups of 32 inputs; use int8, whose groups fit any width"):
        check_split(misaligned, 1, "int4", fix="unused")


def test_int4_refusals_name_the_fix(folders, tmp_path):
    with pytest.raises(ValueError, match=r"parts of 16 inputs would cut its groups; choose an --mp whose shards "
                                         r"hold whole groups \(whole groups: 1, 2\)"):
        reshard(folders["bf16"], tmp_path / "mp4", 4, quantize="int4")
    with pytest.raises(ValueError, match=r"int8-1 is stored as int8 already; reshard it without --quantize, or "
                                         r"quantize its full-precision checkpoint with --quantize int4"):
        reshard(folders["int8-1"], tmp_path / "int4", 1, quantize="int4")
    with pytest.raises(ValueError, match=r"quantize='int8' cannot load .*int4-1: its linear layers are stored as "
                                         r"grouped int4 already.*load it with quantize='int4'"):
        Llama.build(folders["int4-1"], str(LLAMA2_TOKENIZER), max_seq_len=8, max_batch_size=1, quantize="int8")
    hf_folder(tmp_path / "hf", tied=False)  # ffn 176
    with pytest.raises(ValueError, match=r"176 inputs, not whole int4 groups of 32 inputs; use int8"):
        convert("hf", str(tmp_path / "hf"), str(tmp_path / "hf-int4"), quantize="int4")
    with pytest.raises(ValueError, match=r"quantize='int4' runs on CPUs only, not on meta; on meta leave quantize "
                                         r"unset \(bf16\) or use quantize='int8'"):
        check_int4_device(torch.device("meta"))


@pytest.mark.parametrize("folder, change, message", [
    ("int4-1", lambda shard: shard.pop("layers.1.attention.wv.mins"), r"missing layers\.1\.attention\.wv\.mins"),
    ("int4-1", lambda shard: shard.update({"layers.0.feed_forward.w2.mins": torch.zeros(64, 3, dtype=torch.float16)}),
     r"layers\.0\.feed_forward\.w2\.mins has shape \[64, 3\] but this rank's slice of the model needs \[64, 6\]"),
    ("int4-1", lambda shard: shard.update({"layers.0.attention.wo.scales": shard["layers.0.attention.wo.scales"].float()}),
     r"layers\.0\.attention\.wo\.scales is torch\.float32 where an int4 checkpoint stores torch\.float16"),
    ("int8-1", lambda shard: shard.pop("layers.1.attention.wv.scales"), r"missing layers\.1\.attention\.wv\.scales"),
    ("int8-1", lambda shard: shard.update({"layers.0.feed_forward.w2.zeros": torch.zeros(64, 3)}),
     r"layers\.0\.feed_forward\.w2\.zeros has shape \[64, 3\] but this rank's slice of the model needs \[64, 6\]"),
    ("int8-1", lambda shard: shard.update({"output.scales": shard["output.scales"].double()}),
     r"output\.scales is torch\.float64 where an int8 checkpoint stores torch\.float32"),
], ids=["int4 missing", "int4 shape", "int4 dtype", "int8 missing", "int8 shape", "int8 dtype"])
def test_quantized_checkpoints_load_strictly(folders, tmp_path, folder, change, message):
    broken = shutil.copytree(folders[folder], tmp_path / "broken")
    shard = torch.load(broken / "consolidated.00.pth", weights_only=True)
    change(shard)
    torch.save(shard, broken / "consolidated.00.pth")
    with pytest.raises(ValueError, match=message):
        Llama.build(str(broken), str(LLAMA2_TOKENIZER), max_seq_len=8, max_batch_size=1)
