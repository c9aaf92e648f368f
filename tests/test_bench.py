"""The benchmark runs on a tiny model and writes well-formed JSON; its transformers copy is the same
model; llama.cpp runs beside it on the same GGUF file where llama-cpp-python is installed."""

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from distributed import run_world
from llama_tp import parallel
from llama_tp.tools import bench_world_sizes
from llama_tp.args import ModelArgs
from llama_tp.tools.bench import compare_loading, load_meta_reference, main, weight_bytes_per_token
from llama_tp.tools.bench_hf import build_hf_model
from llama_tp.checkpoint import TOLERATED_EXTRA_KEYS, load_model
from llama_tp.checkpoint.sharding import COLUMN_PARALLEL, ROW_PARALLEL
from llama_tp.tools.convert.__main__ import main as convert
from test_convert_gguf_model import write_tiny_gguf
from test_convert_hf import byte_level_tokenizer
from tiny_checkpoint import TINY_LLAMA3, full_weights, write_checkpoint


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    weights = full_weights(TINY_LLAMA3, TINY_LLAMA3["vocab_size"])
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TINY_LLAMA3, weights, n_shards=1, layout="vocab")


def test_hf_copy_gives_our_logits(tiny_ckpt):
    """Meta -> transformers conversion (rotary permutation, Llama 3.1 rope scaling): same logits."""
    args = ModelArgs.from_dict(TINY_LLAMA3)
    placement = parallel.init()
    ours = load_model(tiny_ckpt, args, placement, torch.float32)
    ours.setup_caches(2, 32, placement.device, torch.float32)
    weights = torch.load(tiny_ckpt / "consolidated.00.pth", weights_only=True)
    hf = build_hf_model(weights, args, 32, torch.float32)
    tokens = torch.randint(0, args.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = hf(tokens).logits
    torch.testing.assert_close(ours.forward(tokens, 0), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # a benchmark run, with transformers beside it
def test_bench_writes_json(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(ckpt_dir=str(tiny_ckpt), compare="hf", json_path=str(out), repeats=1, load_repeats=0,
         new_tokens=4, batch_sizes=(1, 2), prefill_lengths=8)
    stdout = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert set(report["cases"]) == {"prefill_8", "decode_batch_1", "decode_batch_2"}
    for case in report["cases"].values():
        assert set(case["tokens_per_s"]) == {"llama_tp", "hf"}
        assert all(speed > 0 for speed in case["tokens_per_s"].values())
        assert case["ratio_vs_hf"] == pytest.approx(case["tokens_per_s"]["llama_tp"] / case["tokens_per_s"]["hf"])
    assert report["greedy_agreement_with_hf"] == 1.0
    roofline = report["roofline"]
    assert roofline["weight_bytes_per_token"] == 4 * sum(  # fp32, everything but the embedding
        t.numel() for n, t in full_weights(TINY_LLAMA3, TINY_LLAMA3["vocab_size"]).items() if not n.startswith("tok_")
    )
    for measured, bound in (("copy_bandwidth_bytes_per_s", "decode_tokens_per_s"),
                            ("read_bandwidth_bytes_per_s", "read_decode_tokens_per_s")):
        assert roofline[measured] > 0 and len(roofline["samples"]) == 2  # before and after the timing
        assert roofline[measured] == pytest.approx(statistics.mean(r[measured] for r in roofline["samples"]))
        assert roofline[bound] == pytest.approx(roofline[measured] / roofline["weight_bytes_per_token"])
    for engine in ("llama_tp", "hf"):  # both engines against the same bounds
        speed = report["cases"]["decode_batch_1"]["tokens_per_s"][engine]
        assert roofline["decode_batch_1_fractions"][engine] == pytest.approx(speed / roofline["decode_tokens_per_s"])
        assert roofline["decode_batch_1_fractions_of_read"][engine] == pytest.approx(speed / roofline["read_decode_tokens_per_s"])
    assert "load" not in report and report["load_seconds_in_process"] > 0  # fresh-process loads: too slow here
    assert len(report["peak_rss_bytes_per_rank"]) == 1
    assert "decode_batch_2" in stdout and "roofline" in stdout


def test_meta_reference_loader_fills_every_checkpoint_tensor(tiny_ckpt):
    """The reference does all of Meta's work, wq/wk/wv and w1/w3 included (our model holds them fused)."""
    loaded = load_meta_reference(tiny_ckpt, parallel.init(), torch.float32)
    checkpoint = torch.load(tiny_ckpt / "consolidated.00.pth", weights_only=True)
    assert set(loaded) == set(checkpoint) - set(TOLERATED_EXTRA_KEYS)
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, checkpoint[name].float(), atol=0, rtol=0)


@pytest.mark.slow
def test_load_comparison_measures_the_fresh_process_only(tiny_ckpt):
    """A large parent must not show in the loaders' memory figures (getrusage's peak inherits it)."""
    parent_ballast = torch.ones(2**27)  # 512 MB resident in this process while the loads run
    args = ModelArgs.from_dict(TINY_LLAMA3)
    summary = compare_loading(tiny_ckpt, args, torch.float32, quantize=None, pack=True, repeats=1)
    weight_bytes = 4 * sum(t.numel() for t in full_weights(TINY_LLAMA3, TINY_LLAMA3["vocab_size"]).values())
    for loader in ("llama_tp", "meta_reference"):
        assert summary[loader]["seconds"] > 0
        assert 0 <= summary[loader]["peak_rss_increase_bytes"] < 4 * weight_bytes + 64 * 2**20
    assert summary["speedup"] > 0 and parent_ballast[-1] == 1


def test_bench_rejects_unknown_comparison(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match="--compare 'vllm' is not supported; use --compare hf, --compare llamacpp"):
        main(ckpt_dir=str(tiny_ckpt), compare="vllm", json_path=str(tmp_path / "x.json"))


def test_bench_says_how_to_install_llama_cpp_when_it_is_missing(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if the package were not installed
    with pytest.raises(ModuleNotFoundError, match=r"--compare llamacpp needs the 'llama_cpp' package \(the 'llamacpp' "
                                                  r"extra\), which is not installed; run: pip install .*\[llamacpp\]\""
                                                  r"; pip builds llama.cpp .* cmake"):
        main(ckpt_dir=str(tiny_ckpt), compare="llamacpp", gguf=str(tmp_path / "x.gguf"), load_repeats=0,
             json_path=str(tmp_path / "x.json"))


def test_bench_asks_for_the_gguf_file_beside_a_checkpoint(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match="--compare llamacpp runs a GGUF file beside .*: pass --gguf"):
        main(ckpt_dir=str(tiny_ckpt), compare="llamacpp", load_repeats=0, json_path=str(tmp_path / "x.json"))


def test_bench_interleaves_llama_cpp_on_the_same_gguf(tmp_path, capsys):
    """Where llama-cpp-python is installed: a tiny GGUF run by both, llama.cpp at batch 1 only."""
    pytest.importorskip("llama_cpp")
    byte_level_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    vocab = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    write_tiny_gguf(tmp_path / "tiny.gguf", json.loads(tokenizer.to_str()), vocab)
    convert("gguf", str(tmp_path / "tiny.gguf"), str(tmp_path / "ckpt"))
    out = tmp_path / "bench.json"
    main(ckpt_dir=str(tmp_path / "ckpt"), compare="llamacpp", gguf=str(tmp_path / "tiny.gguf"), json_path=str(out),
         repeats=1, load_repeats=0, new_tokens=4, batch_sizes=(1, 2), prefill_lengths=8)
    report = json.loads(out.read_text())
    assert set(report["cases"]["decode_batch_1"]["tokens_per_s"]) == {"llama_tp", "llamacpp"}
    assert set(report["cases"]["decode_batch_2"]["tokens_per_s"]) == {"llama_tp"}  # llama.cpp runs one row
    assert report["cases"]["prefill_8"]["ratio_vs_llamacpp"] > 0
    assert 0 <= report["greedy_agreement_with_llamacpp"] <= 1 and report["machine"]["llama_cpp_python"]
    assert "llamacpp tok/s" in capsys.readouterr().out


def test_bench_rejects_an_empty_batch_size_list(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match="--batch_sizes names no batch size"):
        main(ckpt_dir=str(tiny_ckpt), batch_sizes=(), json_path=str(tmp_path / "x.json"))


def _bench_on_rank(ckpt_dir: str, json_path: str) -> list:
    main(ckpt_dir=ckpt_dir, json_path=json_path, repeats=1, load_repeats=0, new_tokens=4,
         batch_sizes=1, prefill_lengths=(), compile=True)  # decoding only
    return [parallel.model_parallel_rank()]


@pytest.mark.slow
def test_bench_at_world_size_2_with_compiled_decoding(tmp_path):
    """Under two processes: one report (rank 0's), every rank's memory, a roofline over both ranks."""
    weights = full_weights(TINY_LLAMA3, TINY_LLAMA3["vocab_size"])
    ckpt = write_checkpoint(tmp_path / "mp2", TINY_LLAMA3, weights, n_shards=2, layout="vocab")
    out = tmp_path / "bench.json"
    assert run_world(2, _bench_on_rank, str(ckpt), str(out)) == [[0], [1]]
    report = json.loads(out.read_text())
    assert report["machine"]["world_size"] == 2 and report["command"]["compile"] is True
    assert len(report["peak_rss_bytes_per_rank"]) == 2
    split = sum(t.numel() for n, t in weights.items() if not n.startswith("tok_") and "norm" not in n)
    replicated = sum(t.numel() for n, t in weights.items() if "norm" in n)  # every rank reads its copy
    assert report["roofline"]["weight_bytes_per_token"] == 4 * (split + 2 * replicated)
    assert report["cases"]["decode_batch_1"]["tokens_per_s"]["llama_tp"] > 0


@pytest.mark.slow
def test_world_size_comparison_runs_both_and_writes_ratios(tiny_ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))  # the jobs import this checkout
    out = tmp_path / "ws.json"
    bench_world_sizes.main(ckpt_dir=str(tiny_ckpt), world_sizes=(1, 2), rounds=1, json_path=str(out),
                           repeats=1, new_tokens=2, batch_sizes=1, prefill_lengths=8)
    report = json.loads(out.read_text())
    assert report["world_sizes"] == [1, 2] and set(report["cases"]) == {"prefill_8", "decode_batch_1"}
    for case in report["cases"].values():
        speeds = case["tokens_per_s"]
        assert set(speeds) == {"1", "2"} and all(speed > 0 for speed in speeds.values())
        assert case["ratio_vs_first"]["2"] == pytest.approx(speeds["2"] / speeds["1"])
    assert "ws2/ws1" in capsys.readouterr().out


@pytest.mark.slow
def test_world_size_comparison_names_a_world_size_the_model_cannot_take(tiny_ckpt, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    with pytest.raises(ValueError, match=r"world size 3 failed: llama_tp error on rank \d: .*cannot be split over 3"):
        bench_world_sizes.main(ckpt_dir=str(tiny_ckpt), world_sizes=(3,), rounds=1, repeats=1, new_tokens=2,
                               batch_sizes=1, prefill_lengths=8)


def test_roofline_counts_fbgemm_packed_weights(tiny_ckpt):
    """int8_dynamic's weights live in fbgemm's opaque handles, outside the state dict: one byte
    per weight and a scale per output channel still count as read by every token."""
    args = ModelArgs.from_dict(TINY_LLAMA3)
    model = load_model(tiny_ckpt, args, parallel.init(), torch.float32, quantize="int8_dynamic")
    weights = full_weights(TINY_LLAMA3, TINY_LLAMA3["vocab_size"])
    linear = {n: t for n, t in weights.items() if n.split(".")[-2] in COLUMN_PARALLEL + ROW_PARALLEL}
    other = sum(4 * t.numel() for n, t in weights.items() if n not in linear and not n.startswith("tok_"))
    packed = sum(t.numel() + 4 * t.shape[0] for t in linear.values())
    assert weight_bytes_per_token(model) == other + packed
