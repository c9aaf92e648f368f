"""The mixture-of-experts benchmark: its two models have the same active parameters, and a tiny run
reports both models' speeds and their ratio."""

import json
from pathlib import Path

import pytest
import torch

from llama_tp.model.args import ModelArgs
from llama_tp.model.memory import active_params
from llama_tp.tools.bench import moe as bench_moe
from llama_tp.tools.convert.hf import convert_hf
from tiny_checkpoint import LLAMA2_TOKENIZER


@pytest.mark.parametrize("experts_per_token", [1, 2])
def test_the_dense_model_has_the_experts_active_parameters_but_the_routers(experts_per_token):
    params = bench_moe.shapes(768, 8, 12, 4, 32000, 8, experts_per_token)
    experts, dense = (ModelArgs.from_dict(params[name]) for name in ("experts", "dense"))
    assert experts.expert_hidden_dim == 2688 and dense.ffn_hidden_dim == experts_per_token * 2688
    assert active_params(experts) - active_params(dense) == 8 * 8 * 768  # each layer's router


def test_a_tiny_run_times_both_models_interleaved(tmp_path):
    out = tmp_path / "bench_moe.json"
    threads = torch.get_num_threads()
    try:
        bench_moe.main(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, batch_sizes=(1, 2), new_tokens=2,
                       repeats=2, threads=1, json_path=str(out))
    finally:
        torch.set_num_threads(threads)  # the rest of the session's
    report = json.loads(out.read_text())
    for batch in (1, 2):
        case = report["cases"][f"decode_batch_{batch}"]
        assert set(case["tokens_per_s"]) == {"experts", "dense"} and len(case["runs"]["dense"]) == 2
        assert case["experts_cost_vs_dense"] == pytest.approx(case["tokens_per_s"]["dense"] / case["tokens_per_s"]["experts"])


def fake_llama_cpp(root: Path) -> Path:
    """A llama.cpp build as build-llama-cpp.sh lays it out, whose converter writes an empty file and
    whose llama-bench says 50 tokens/s for the experts' file and 100 for the dense one's."""
    bin_dir, src = root / "build" / "bin", root / "src"
    bin_dir.mkdir(parents=True)
    src.mkdir()
    (src / "convert_hf_to_gguf.py").write_text(
        "import sys\nopen(sys.argv[sys.argv.index('--outfile') + 1], 'w').close()\n")
    bench = bin_dir / "llama-bench"
    bench.write_text("#!/bin/sh\n"
                     "case \"$*\" in --version) echo 'version: 1 (fake)';; *experts*) echo '[{\"avg_ts\": 50.0}]';; "
                     "*) echo '[{\"avg_ts\": 100.0}]';; esac\n")
    bench.chmod(0o755)
    return bin_dir


def test_llama_cpp_decodes_the_same_models_beside_ours(tmp_path, monkeypatch):
    out = tmp_path / "bench_moe.json"
    threads = torch.get_num_threads()
    # The fake converter's GGUF is empty: ours converts the folder it was made from instead
    # (test_convert_gguf_sentencepiece.py and test_convert_families.py convert such files for real).
    monkeypatch.setattr(bench_moe, "convert_gguf", lambda gguf, dest: convert_hf(
        str(Path(gguf).with_name(f"hf-{Path(gguf).stem}")), dest, dtype="fp32"))
    try:
        bench_moe.main(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, batch_sizes=(1,), new_tokens=2, repeats=2,
                       threads=1, peer="llama-bench", llama_cpp=str(fake_llama_cpp(tmp_path / "llama.cpp")),
                       tokenizer_path=str(LLAMA2_TOKENIZER), json_path=str(out))
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    theirs = report["llama_cpp"]
    assert theirs["tokens_per_s"] == {"experts": 50.0, "dense": 100.0} and theirs["experts_cost_vs_dense"] == 2.0
    assert len(theirs["runs"]["ours"]["experts"]) == 2
    assert theirs["ours_over_theirs"]["dense"] == pytest.approx(theirs["ours_tokens_per_s"]["dense"] / 100.0)
    assert report["command"]["llama_cpp"] == "version: 1 (fake)"
    assert report["command"]["params"]["experts"]["vocab_size"] == 32000  # the tokenizer's


def test_the_peer_needs_its_tools_and_a_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="--llama_cpp"):
        bench_moe.main(peer="llama-bench", tokenizer_path=str(LLAMA2_TOKENIZER))
    with pytest.raises(ValueError, match="--peer 'llama-server' is not one of llama-bench"):
        bench_moe.main(peer="llama-server")
    with pytest.raises(FileNotFoundError, match="build-llama-cpp.sh"):
        bench_moe.main(peer="llama-bench", llama_cpp=str(tmp_path), tokenizer_path=str(LLAMA2_TOKENIZER))
