"""int4 checkpoints (convert and reshard --quantize int4): GGUF's Q4_0, Q4_1 and Q8_0 tensors come
in as they are stored, a converted Q4 model gives its fp32 dequantisation's logits, checkpoints
load int4 unasked and equal load-time quantization, on one process or two, what cannot be split
into whole groups is refused with the counts that can, and quantized checkpoints load strictly."""

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from tokenizers import Tokenizer

from llama_tp import Llama
from llama_tp.args import ModelArgs
from llama_tp.checkpoint import load_shard, shard_paths
from llama_tp.checkpoint.quantized import check_split
from llama_tp.kernels import int4, int8
from llama_tp.memory import plan
from llama_tp.parallel import check_int4_device
from llama_tp.quantize import Int4Linear, Int8Linear
from llama_tp.tools.convert.__main__ import main as convert
from llama_tp.tools.convert.gguf_blocks import quantized_weight
from llama_tp.tools.reshard import reshard
from distributed import run_world
from test_convert_gguf_model import TYPES, write_tiny_gguf
from test_convert_hf import byte_level_tokenizer, hf_folder
from test_int8_checkpoint import assert_ranks_agree_with_one_process, folders, outputs  # noqa: F401  (a fixture)
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2

VOCAB = 32000
# Every layer in GGUF's 4-bit types, the tied embedding (the output head) Q8_0: the demo model's make-up.
ALL_Q4 = {kind: Q.Q4_0 if kind in ("attn_k", "ffn_up") else Q.Q4_1 for kind in TYPES} | {"token_embd": Q.Q8_0}


def gguf_tensor(path, rows: int, width: int, kind: Q):
    """A random weight [rows, width] in GGUF's blocks of `kind`, written to a file at path and read back."""
    values = np.random.default_rng(0).standard_normal((rows, width)).astype(np.float32)
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("t", gguf_quantize(values, kind), raw_dtype=kind)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        write()
    (tensor,) = GGUFReader(str(path)).tensors
    return tensor


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda k: k.name)
def test_gguf_blocks_come_in_as_they_are_stored(tmp_path, kind):
    tensor = gguf_tensor(tmp_path / "t.gguf", 6, 128, kind)
    weight = quantized_weight(tensor)
    expected = torch.from_numpy(gguf_dequantize(tensor.data, kind))  # gguf's own dequantisation, fp32
    assert weight.shape == (6, 128)
    if kind == Q.Q8_0:
        assert weight.kind == "int8" and weight.tensors["weight"].dtype == torch.int8
        got = int8.dequantize(*(weight.tensors[part] for part in ("weight", "scales", "zeros")), torch.float32)
    else:
        assert weight.kind == "int4" and weight.tensors["weight"].shape == (6, 64)
        assert torch.equal(weight.tensors["weight"].view(6, 4, 16), torch.from_numpy(tensor.data.reshape(6, 4, -1)[..., -16:].copy()))
        got = int4.dequantize(*(weight.tensors[part] for part in ("weight", "scales", "mins")), torch.float32)
    assert torch.equal(got, expected)  # every weight to the bit


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory) -> dict:
    """A tiny GGUF made like the demo model's (ALL_Q4) and one of every type, converted."""
    root = tmp_path_factory.mktemp("gguf4")
    byte_level_tokenizer(root)
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    vocab = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    for name, types in (("q4", ALL_Q4), ("mixed", TYPES)):
        write_tiny_gguf(root / f"{name}.gguf", json.loads(tokenizer.to_str()), vocab, types)
    convert("gguf", str(root / "q4.gguf"), str(root / "q4-fp32"), mp=1)
    convert("gguf", str(root / "q4.gguf"), str(root / "q4-int4"), mp=2, quantize="int4")
    return {"root": root, "reader": GGUFReader(str(root / "q4.gguf"))}


def test_convert_gguf_int4_keeps_q4_layers_and_the_q8_0_head_byte_for_byte(gguf_models):
    root, reader = gguf_models["root"], gguf_models["reader"]
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    shards = [load_shard(path) for path in shard_paths(root / "q4-int4")]
    for gguf_name, layer in (("blk.1.attn_k.weight", "layers.1.attention.wk"), ("blk.0.ffn_up.weight", "layers.0.feed_forward.w3"),
                             ("blk.0.ffn_down.weight", "layers.0.feed_forward.w2"), ("token_embd.weight", "output")):
        expected = quantized_weight(by_name[gguf_name])
        split_dim = 1 if layer.endswith(("wo", "w2")) else 0
        for part, tensor in expected.tensors.items():
            stored = torch.cat([shard[f"{layer}.{part}"] for shard in shards], dim=split_dim)
            assert stored.dtype == tensor.dtype and torch.equal(stored, tensor), (layer, part)
    assert shards[0]["output.weight"].dtype == torch.int8 and shards[0]["layers.0.feed_forward.w2.weight"].dtype == torch.uint8


def test_converted_q4_model_in_int4_gives_its_fp32_dequantisations_logits(gguf_models):
    root = gguf_models["root"]
    tokenizer = str(root / "q4-fp32" / "tokenizer.json")
    fp32 = Llama.build(str(root / "q4-fp32"), tokenizer, max_seq_len=64, max_batch_size=2)
    stored = Llama.build(str(root / "q4-int4"), tokenizer, max_seq_len=64, max_batch_size=2)  # 2 shards, merged
    assert isinstance(stored.model.layers[0].attention.wqkv, Int4Linear) and isinstance(stored.model.output, Int8Linear)
    tokens = torch.randint(0, fp32.model.args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    expected = fp32.model.forward(tokens, 0)
    # A 40-token prompt (weights converted back) and a one-token step (the kernel), as causal as fp32's.
    for got in (stored.model.forward(tokens, 0), stored.model.forward(tokens[:1, :1], 0)):
        scale = expected.abs().max()
        torch.testing.assert_close(got, expected[: got.shape[0], : got.shape[1]], rtol=1e-5, atol=1e-5 * scale)
    prompts = tokens[:, :5].tolist()
    assert stored.generate(prompts, 12, temperature=0)[0] == fp32.generate(prompts, 12, temperature=0)[0]


def test_convert_gguf_int4_rounds_other_types_itself_and_says_so(gguf_models, tmp_path, capsys):
    convert("gguf", str(gguf_models["root"] / "mixed.gguf"), str(tmp_path / "int4"), mp=1, quantize="int4")
    logged = capsys.readouterr().err
    assert ("dequantised and rounded by llama_tp (kernels/int4.py, int8.py), their GGUF types not being kept as "
            "they are (int4: Q4_0, Q4_1; int8: Q8_0): 2 BF16 layers to int4, 2 F16 layers to int4, 2 Q4_K layers to "
            "int4, 2 Q6_K layers to int4, 2 Q8_0 layers to int4") in logged
    shard = load_shard(shard_paths(tmp_path / "int4")[0])
    assert shard["layers.0.attention.wq.weight"].dtype == torch.uint8 and shard["output.zeros"].abs().max() == 0


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


@pytest.mark.slow  # a two-process world; the one-process int4 tests above stay fast
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
    with pytest.raises(ValueError, match=r"quantize='int4' runs on CPUs and on CUDA GPUs of compute capability 8\.0 "
                                         r"or newer, not on meta; leave quantize unset or use quantize='int8'"):
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
