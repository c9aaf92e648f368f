"""The launch scripts under torchrun at world sizes 1 and 2 give the Python API's tokens."""

import json

import pytest

from llama_tp import Llama
from llama_tp.tools.prompts import batch_rows
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint
from torchrun import one_thread, run_script  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["Simply put, the theory", "Grüße aus Zürich: 日本"]
DIALOGS = [
    [{"role": "user", "content": "What is a llama?"}],
    [{"role": "system", "content": "Réponds en français."}, {"role": "user", "content": "Bonjour"}],
]
GREEDY = ["--temperature", "0", "--max_seq_len", "64", "--max_gen_len", "6", "--max_batch_size", "2"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[int, str]:
    """The same tiny Llama 2 split for one and for two processes."""
    weights = full_weights(TINY_LLAMA2, 32000)
    root = tmp_path_factory.mktemp("launch")
    return {n: str(write_checkpoint(root / f"tp{n}", TINY_LLAMA2, weights, n, "dim")) for n in (1, 2)}


@pytest.fixture(scope="module")
def api(checkpoints) -> Llama:
    return Llama.build(checkpoints[1], str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=2)


def run_with_files(tmp_path, checkpoints, script: str, nproc: int, prompts: list, *flags: str) -> list[dict]:
    prompts_file, output = tmp_path / "prompts.json", tmp_path / "out.json"
    prompts_file.write_text(json.dumps(prompts, ensure_ascii=False), encoding="utf-8")
    result = run_script(script, nproc, "--ckpt_dir", checkpoints[nproc], "--tokenizer_path", str(LLAMA2_TOKENIZER),
                        "--prompts_file", str(prompts_file), "--output_json", str(output), *GREEDY, *flags)
    records = json.loads(output.read_text(encoding="utf-8"))
    assert [r["prompt"] for r in records] == prompts
    assert not list(tmp_path.glob("*.tmp"))  # the temporary file was renamed into place
    for record in records:  # rank 0 alone printed each completion, once
        assert result.stdout.count(record["generation"]) == [r["generation"] for r in records].count(
            record["generation"]), record["generation"]
    assert result.stderr.count("Loaded in") == 1  # logged by rank 0 alone
    return records


@pytest.mark.slow
def test_text_completion_script_matches_api(tmp_path, checkpoints, api):
    records = run_with_files(tmp_path, checkpoints, "text_completion.py", 1, PROMPTS, "--show_top", "2")
    expected = api.text_completion(PROMPTS, temperature=0, max_gen_len=6, token_ids=True)
    assert [r["token_ids"] for r in records] == [e["token_ids"] for e in expected]
    assert [r["generation"] for r in records] == [e["generation"] for e in expected]
    assert all(len(r["token_ids"]) == 6 for r in records)


@pytest.mark.slow
def test_chat_completion_script_matches_api_over_two_processes(tmp_path, checkpoints, api):
    records = run_with_files(tmp_path, checkpoints, "chat_completion.py", 2, DIALOGS)
    expected = api.chat_completion(DIALOGS, temperature=0, max_gen_len=6, token_ids=True)
    assert [r["token_ids"] for r in records] == [e["token_ids"] for e in expected]
    assert [r["generation"] for r in records] == [e["generation"]["content"] for e in expected]


@pytest.mark.slow
def test_text_completion_script_speculates_with_the_apis_tokens_over_two_processes(tmp_path, checkpoints, api):
    records = run_with_files(tmp_path, checkpoints, "text_completion.py", 2, PROMPTS, "--speculate", "lookup",
                             "--speculate_k", "3")
    expected = api.text_completion(PROMPTS, temperature=0, max_gen_len=6, token_ids=True)
    assert [r["token_ids"] for r in records] == [e["token_ids"] for e in expected]


@pytest.mark.slow
def test_scripts_search_beams_and_ban_words_as_the_api_over_two_processes(tmp_path, checkpoints, api):
    flags = ("--num_beams", "2", "--length_penalty", "0.5", "--early_stopping", "never", "--bad_words", '["the", "a"]')
    records = run_with_files(tmp_path, checkpoints, "chat_completion.py", 2, DIALOGS, *flags)
    expected = api.chat_completion(DIALOGS, max_gen_len=6, token_ids=True, num_beams=2, length_penalty=0.5,
                                   early_stopping="never", bad_words=["the", "a"])
    assert [r["token_ids"] for r in records] == [e["token_ids"] for e in expected]
    records = run_with_files(tmp_path, checkpoints, "text_completion.py", 1, PROMPTS, "--num_beams", "2")
    expected = api.text_completion(PROMPTS, max_gen_len=6, token_ids=True, num_beams=2)
    assert [r["token_ids"] for r in records] == [e["token_ids"] for e in expected]


def test_scripts_build_no_more_rows_than_they_decode_at_once():
    assert batch_rows(4, n_prompts=2, stream=False) == 2
    assert batch_rows(4, n_prompts=2, stream=False, beams=3) == 6  # a row a beam
    assert batch_rows(4, n_prompts=9, stream=False) == 4  # the rest in later batches
    assert batch_rows(4, n_prompts=9, stream=True) == 1  # streamed prompts run one at a time
    assert batch_rows(0, n_prompts=2, stream=True) == 0  # for Llama.build to refuse by name


@pytest.mark.slow
def test_streaming_script_builds_a_one_row_model(tmp_path, checkpoints):
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(PROMPTS))
    result = run_script("text_completion.py", 1, "--ckpt_dir", checkpoints[1], "--tokenizer_path",
                        str(LLAMA2_TOKENIZER), "--prompts_file", str(prompts_file), *GREEDY, "--stream")
    assert "batch 1 x 64 tokens" in result.stderr  # the memory plan Llama.build prints


@pytest.mark.slow
def test_text_completion_script_takes_quantize_int4(tmp_path, checkpoints):
    """--quantize int4 reaches Llama.build: the script's tokens are the API's with int4 layers."""
    records = run_with_files(tmp_path, checkpoints, "text_completion.py", 1, PROMPTS, "--quantize", "int4")
    quantized = Llama.build(checkpoints[1], str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=2, quantize="int4")
    expected = quantized.text_completion(PROMPTS, temperature=0, max_gen_len=6, token_ids=True)
    assert [r["token_ids"] for r in records] == [e["token_ids"] for e in expected]
