"""`bench --compare gpt-fast` without a GPU: a fake bench_random.py in tmp_path stands in for
gpt-fast's (it records its command line and prints what the real one prints); the refusals before
anything loads; the shape names; the JSON line read back; ours over theirs and each engine's share
of the copy bandwidth; and the whole report and table, with the GPU check passed by hand."""

import json
import textwrap
from pathlib import Path

import pytest
import torch

from llama_tp.args import ModelArgs
from llama_tp.tools import bench, bench_gpt_fast
from llama_tp.tools.bench_gpt_fast import check_gpt_fast, gpt_fast_shape, run_gpt_fast, side_by_side
from llama_tp.tools.random_checkpoint import SHAPES
from tiny_checkpoint import TINY_LLAMA3, full_weights, write_checkpoint

CUDA = torch.device("cuda", 0)
FIGURES = {"peer": "gpt-fast", "shape": "7B", "quant": "none", "new_tokens": 4, "tokens_per_s": 150.0,
           "weights_gb": 13.48, "bandwidth_gb_s": 2022.0, "device": "NVIDIA H200", "torch": "2.11.0"}


def fake_gpt_fast(folder: Path, body: str) -> Path:
    """A bench_random.py in folder that records its arguments in args.json, then runs body."""
    folder.mkdir(exist_ok=True)
    (folder / "bench_random.py").write_text(textwrap.dedent("""\
        import json, sys
        from pathlib import Path
        Path("args.json").write_text(json.dumps(sys.argv[1:]))
        """) + textwrap.dedent(body))
    return folder


def printing(figures: dict) -> str:
    """A body that talks as gpt-fast's compile does, then prints the figures' line."""
    return f"""\
        print("Compiling decode_one_token ...")
        print('{{"not": "the figures"}}')
        print({json.dumps(json.dumps(figures))})
        """


def test_its_command_line_and_json_line(tmp_path):
    folder = fake_gpt_fast(tmp_path / "gpt-fast", printing(FIGURES))
    figures = run_gpt_fast(folder, "llama-3-8b", "int8", prompt_len=16, new_tokens=64, repeats=2, device=CUDA)
    assert json.loads((folder / "args.json").read_text()) == [
        "--shape", "llama-3-8b", "--quant", "int8", "--prompt_len", "16", "--new_tokens", "64", "--repeats", "2",
        "--device", "cuda:0"]
    assert figures == FIGURES | {"command": figures["command"], "folder": str(folder)}
    assert figures["command"].endswith("bench_random.py --shape llama-3-8b --quant int8 --prompt_len 16 "
                                       "--new_tokens 64 --repeats 2 --device cuda:0")


def test_bf16_is_gpt_fasts_quant_none(tmp_path):
    folder = fake_gpt_fast(tmp_path / "gpt-fast", printing(FIGURES))
    run_gpt_fast(folder, "7B", None, prompt_len=16, new_tokens=8, repeats=1, device=CUDA)
    arguments = json.loads((folder / "args.json").read_text())
    assert arguments[arguments.index("--quant") + 1] == "none"


def test_its_failure_is_named_with_its_last_words(tmp_path):
    folder = fake_gpt_fast(tmp_path / "gpt-fast", """\
        print("torch._dynamo hit a snag", file=sys.stderr)
        sys.exit(3)
        """)
    with pytest.raises(RuntimeError, match=r"bench_random.py failed \(exit 3\) in .*gpt-fast:\ntorch._dynamo hit a snag"):
        run_gpt_fast(folder, "7B", None, prompt_len=16, new_tokens=8, repeats=1, device=CUDA)


def test_a_run_without_its_figures_is_refused(tmp_path):
    folder = fake_gpt_fast(tmp_path / "gpt-fast", 'print("done")\n')
    with pytest.raises(RuntimeError, match="printed no line of figures; its output ended:\ndone"):
        run_gpt_fast(folder, "7B", None, prompt_len=16, new_tokens=8, repeats=1, device=CUDA)


@pytest.mark.parametrize("device, dtype, quantize, message", [
    (torch.device("cpu"), torch.bfloat16, None, "--compare gpt-fast times gpt-fast's CUDA graphs on a GPU, but this "
                                                "job runs on cpu; run it where CUDA sees a GPU"),
    (CUDA, torch.float32, None, r"runs gpt-fast's bf16 model, not torch.float32; pass --dtype bf16"),
    (CUDA, torch.bfloat16, "int8_dynamic", "gpt-fast alike, which has no 'int8_dynamic'; use --quantize int8, int4"),
])
def test_what_gpt_fast_cannot_run_is_refused_first(tmp_path, device, dtype, quantize, message):
    folder = fake_gpt_fast(tmp_path / "gpt-fast", printing(FIGURES))
    with pytest.raises(ValueError, match=message):
        check_gpt_fast(str(folder), device, dtype, quantize)


def test_a_folder_without_gpt_fast_is_refused_with_the_option_to_pass(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path / 'nowhere'} has no bench_random.py; pass --gpt_fast_dir"):
        check_gpt_fast(str(tmp_path / "nowhere"), CUDA, torch.bfloat16, None)


def test_the_default_folder_is_shared_peers_beside_the_project(tmp_path):
    project = Path(bench_gpt_fast.__file__).resolve().parents[2]
    assert bench_gpt_fast.DEFAULT_DIR == project.parent / "shared" / "peers" / "gpt-fast"
    folder = fake_gpt_fast(tmp_path / "gpt-fast", printing(FIGURES))
    assert check_gpt_fast(str(folder), CUDA, torch.bfloat16, "int4") == folder


def test_our_published_shapes_take_gpt_fasts_names(tmp_path):
    assert gpt_fast_shape(ModelArgs.from_dict(SHAPES["llama2-7b"]), tmp_path) == "7B"
    assert gpt_fast_shape(ModelArgs.from_dict(SHAPES["llama3-8b"]), tmp_path) == "llama-3-8b"
    # Meta's own Llama-2-7B params.json leaves the vocabulary to the tokenizer (bench fills it in).
    meta = {"dim": 4096, "multiple_of": 256, "n_heads": 32, "n_layers": 32, "norm_eps": 1e-05, "vocab_size": -1}
    assert gpt_fast_shape(ModelArgs.from_dict(meta).with_vocab_size(32000), tmp_path) == "7B"


def test_another_shape_is_refused_with_the_way_to_make_one(tmp_path):
    with pytest.raises(ValueError, match=r"is none of llama2-7b, llama3-8b \(dim 64, 2 layers, .*random_checkpoint"):
        gpt_fast_shape(ModelArgs.from_dict(TINY_LLAMA3), tmp_path)


def test_shares_of_the_copy_bandwidth_leave_gpt_fasts_embedding_table_out():
    args = ModelArgs.from_dict(SHAPES["llama2-7b"])
    embedding = 32000 * 4096 * 2  # gpt-fast counts it in weights_gb; a token reads one row of it
    comparison = side_by_side(165.0, 13_000_000_000, FIGURES, args, copy_bandwidth=4e12)
    assert comparison["tokens_per_s"] == {"llama_tp": 165.0, "gpt-fast": 150.0}
    assert comparison["ratio_vs_gpt-fast"] == pytest.approx(1.1)
    assert comparison["bytes_per_token"]["gpt-fast"] == pytest.approx(13.48e9 - embedding)
    assert comparison["share_of_copy_bandwidth"]["llama_tp"] == pytest.approx(165 * 13e9 / 4e12)
    assert comparison["share_of_copy_bandwidth"]["gpt-fast"] == pytest.approx(150 * (13.48e9 - embedding) / 4e12)
    assert comparison["gpt_fast"] == FIGURES


def test_the_report_and_table_carry_both_engines(tmp_path, monkeypatch, capsys):
    """The whole command on the CPU, with the GPU check passed by hand and the tiny model taken
    for a published shape: both engines in the sampled batch-1 case, the ratio, the shares."""
    ckpt = write_checkpoint(tmp_path / "ckpt", TINY_LLAMA3, full_weights(TINY_LLAMA3, TINY_LLAMA3["vocab_size"]), 1,
                            "vocab")
    folder = fake_gpt_fast(tmp_path / "gpt-fast", printing(FIGURES | {"new_tokens": 4}))
    real_check = bench.check_gpt_fast
    monkeypatch.setattr(bench, "check_gpt_fast", lambda folder, device, dtype, quantize:
                        real_check(folder, CUDA, dtype, quantize))
    monkeypatch.setattr(bench, "gpt_fast_shape", lambda args, ckpt_dir: "7B")
    out = tmp_path / "bench.json"
    bench.main(ckpt_dir=str(ckpt), compare="gpt-fast", gpt_fast_dir=str(folder), dtype="bf16", json_path=str(out),
               repeats=1, load_repeats=0, new_tokens=4, batch_sizes=1, prefill_lengths=())
    report = json.loads(out.read_text())
    arguments = json.loads((folder / "args.json").read_text())
    assert arguments[:10] == ["--shape", "7B", "--quant", "none", "--prompt_len", str(bench.DECODE_PROMPT_LEN),
                              "--new_tokens", "4", "--repeats", "1"]
    case = report["cases"]["decode_batch_1_sampled"]
    ours = case["tokens_per_s"]["llama_tp"]
    assert case["tokens_per_s"]["gpt-fast"] == 150.0 and case["ratio_vs_gpt-fast"] == pytest.approx(ours / 150.0)
    assert set(report["cases"]["decode_batch_1"]["tokens_per_s"]) == {"llama_tp"}  # greedy: ours alone
    comparison = report["gpt_fast"]
    roofline = report["roofline"]
    assert comparison["share_of_copy_bandwidth"]["llama_tp"] == pytest.approx(
        ours * roofline["weight_bytes_per_token"] / roofline["copy_bandwidth_bytes_per_s"])
    assert comparison["gpt_fast"]["device"] == "NVIDIA H200" and comparison["gpt_fast"]["folder"] == str(folder)
    table = capsys.readouterr().out
    assert "gpt-fast (7B, none), batch 1 sampled: llama_tp" in table and "share of the copy bandwidth" in table
    assert "decode_batch_1_sampled" in table and "150.0" in table
