"""llama_tp with its core requirements alone (`pip install -e .`): Meta's API works, and each feature
whose extra is missing says, in one line, which extra to install (tests/without_extras.py hides
every package only the extras bring). CI also installs the core alone in a fresh environment."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from jobs import PROJECT_ROOT, subprocess_env
from llama_tp import Llama
from llama_tp.optional import EXTRAS, MissingExtra
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint
from without_extras import extras_only_modules

HELPER = PROJECT_ROOT / "tests" / "without_extras.py"
PROMPTS = ["Simply put, the theory", "Grüße aus Zürich"]
DIALOGS = [[{"role": "user", "content": "What is a llama?"}]]

META_API = """
import json, sys
from llama_tp import Llama
generator = Llama.build(sys.argv[1], sys.argv[2], max_seq_len=64, max_batch_size=2)
texts = generator.text_completion({prompts!r}, temperature=0, max_gen_len=5)
chats = generator.chat_completion({dialogs!r}, temperature=0, max_gen_len=5)
print(json.dumps({{"texts": [t["generation"] for t in texts], "chats": [c["generation"]["content"] for c in chats]}}))
"""


def without_extras(*args: str, keep: tuple[str, ...] = (), timeout: float = 600, **env: str):
    keeping = [word for extra in keep for word in ("--keep", extra)]
    return subprocess.run([sys.executable, str(HELPER), *keeping, *args], cwd=PROJECT_ROOT,
                          env=subprocess_env(**env), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("core") / "tp1", TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000),
                            1, "dim")


def test_extras_table_names_every_package_of_each_extra_in_pyproject():
    extras = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    imported_as = {"prometheus-client": "prometheus_client", "llama-cpp-python": "llama_cpp"}
    for extra, packages in EXTRAS.items():
        for requirement in extras[extra]:
            name = requirement.split(">")[0].split("=")[0].strip()
            assert imported_as.get(name, name) in packages, (extra, name)


def test_meta_api_runs_with_the_core_requirements_alone(checkpoint):
    hidden = extras_only_modules()
    assert {"xgrammar", "fastapi", "gguf", "tokenizers", "safetensors", "pydantic", "transformers"} <= hidden
    script = checkpoint.parent / "meta_api.py"
    script.write_text(META_API.format(prompts=PROMPTS, dialogs=DIALOGS))
    result = without_extras(str(script), str(checkpoint), str(LLAMA2_TOKENIZER))
    assert result.returncode == 0, result.stderr
    answers = json.loads(result.stdout)
    generator = Llama.build(str(checkpoint), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=2)
    assert answers["texts"] == [t["generation"] for t in generator.text_completion(PROMPTS, temperature=0,
                                                                                   max_gen_len=5)]
    assert answers["chats"] == [c["generation"]["content"] for c in generator.chat_completion(
        DIALOGS, temperature=0, max_gen_len=5)]


def one_line(result: subprocess.CompletedProcess) -> str:
    """The job's only stderr line, which must be the error every rank prints."""
    lines = result.stderr.splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    return lines[0]


def test_the_demo_without_the_convert_extra_names_it_before_downloading(tmp_path):
    line = one_line(without_extras("launch/chat_completion.py", LLAMA_TP_HOME=str(tmp_path)))
    assert line.startswith("llama_tp error on rank 0: the demo model needs the 'gguf' package (the 'convert' "
                           "extra), which is not installed; run: pip install --no-build-isolation -e ")
    assert line.endswith(f'"{PROJECT_ROOT}[convert]"')
    assert list(tmp_path.iterdir()) == []


def test_the_server_without_the_serve_extra_names_it(checkpoint):
    line = one_line(without_extras("launch/serve.py", "--ckpt_dir", str(checkpoint), "--tokenizer_path",
                                   str(LLAMA2_TOKENIZER), keep=("convert",)))
    assert line.startswith("llama_tp error on rank 0: the server needs the 'fastapi' package (the 'serve' extra)")
    assert line.endswith(f'"{PROJECT_ROOT}[serve]"')


@pytest.mark.parametrize("tool, package", [("run_batch", "xgrammar"), ("bench_serve", "httpx")])
def test_tools_without_the_serve_extra_name_it(tmp_path, tool, package):
    line = one_line(without_extras("-m", f"llama_tp.{tool}", "--help", keep=("convert",)))
    assert line.startswith(f"llama_tp error on rank 0: python -m llama_tp.{tool} needs the {package!r} package "
                           "(the 'serve' extra)")


def test_a_tokenizer_json_without_the_convert_extra_names_it(checkpoint, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    line = one_line(without_extras("launch/text_completion.py", "--ckpt_dir", str(checkpoint),
                                   "--tokenizer_path", str(tmp_path / "tokenizer.json")))
    assert line.startswith(f"llama_tp error on rank 0: the tokenizer {tmp_path / 'tokenizer.json'} needs the "
                           "'tokenizers' package (the 'convert' extra)")


def test_structured_outputs_without_xgrammar_name_the_serve_extra(checkpoint, monkeypatch):
    generator = Llama.build(str(checkpoint), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=2)
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "llama_tp.structured.grammars", raising=False)
    with pytest.raises(MissingExtra, match=r"^structured outputs \(response_format, tool_choice\) needs the "
                                           r"'xgrammar' package \(the 'serve' extra\)"):
        generator.chat_completion(DIALOGS, max_gen_len=5, response_format={"type": "json_object"})
    assert generator.chat_completion(DIALOGS, temperature=0, max_gen_len=5)  # the rest works


@pytest.mark.slow  # torchrun at world size 3
def test_every_rank_names_the_missing_extra(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3", str(HELPER),
         "launch/chat_completion.py"], cwd=PROJECT_ROOT, env=subprocess_env(LLAMA_TP_HOME=str(tmp_path)),
        capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("llama_tp error")]
    assert sorted(line[:len("llama_tp error on rank 0")] for line in lines) == [
        f"llama_tp error on rank {rank}" for rank in range(3)]
    assert all("the demo model needs the 'gguf' package (the 'convert' extra)" in line for line in lines)
