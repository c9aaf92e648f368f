"""python -m llama_tp.run_batch: a file of OpenAI batch requests, good and bad lines mixed, each
answered as the server answers it, every line answered, no line stopping the job."""

import json
import subprocess
import sys

import pytest

from jobs import PROJECT_ROOT, subprocess_env
from llama_tp import Llama
from llama_tp.tools.run_batch import Output, answer_all, main, read_lines
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"
DIALOG = [{"role": "user", "content": "Tell me about otters."}]


def line(custom_id, url: str = "/v1/chat/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}})


LINES = [
    line("chat", messages=DIALOG, max_tokens=12, temperature=0),
    "{not json",
    json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),  # no custom_id
    line("elsewhere", url="/v1/embeddings", input="hi"),
    line("unknown field", messages=DIALOG, max_tokens=4, frequency_penalty_typo=1),
    line("other model", messages=DIALOG, max_tokens=4) .replace(f'"model": "{MODEL}"', '"model": "gpt-4"'),
    line("too long", messages=DIALOG, max_tokens=1000),
    line("completion", url="/v1/completions", prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=2),
    line("sampled", messages=DIALOG, max_tokens=8, temperature=1.0, seed=5),
    line("stream", messages=DIALOG, max_tokens=4, stream=True),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp(MODEL)
    write_checkpoint(directory, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")
    return str(directory)


@pytest.fixture(scope="module")
def llama(checkpoint) -> Llama:
    return Llama.build(checkpoint, str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=2)


def read(path) -> list[dict]:
    records = [json.loads(text) for text in path.read_text().splitlines()]
    assert all(record["id"].startswith("batch_req_") for record in records)
    return records


def by_id(path) -> dict:
    return {record["custom_id"]: record for record in read(path)}


def test_good_and_bad_lines_each_get_the_servers_answer(llama, tmp_path):
    path = tmp_path / "results.jsonl"
    with Output(path) as output:
        answer_all(llama, MODEL, LINES, output)
    records = by_id(path)
    assert len(path.read_text().splitlines()) == len(LINES)

    chat = records["chat"]
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    body = chat["response"]["body"]
    expected = llama.chat_completion([DIALOG], max_gen_len=12, temperature=0, token_ids=True)[0]
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected["generation"]["content"]}
    assert body["usage"]["completion_tokens"] == len(expected["token_ids"]) + (body["choices"][0]["finish_reason"] == "stop")

    completion = records["completion"]["response"]["body"]
    expected = llama.text_completion(["Once upon a time"], max_gen_len=10, temperature=0, logprobs=True)[0]
    assert completion["object"] == "text_completion"
    assert completion["choices"][0]["text"] == expected["generation"]
    logprobs = completion["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == pytest.approx(expected["logprobs"], abs=1e-4)
    assert all(len(alternatives) == 2 for alternatives in logprobs["top_logprobs"])
    assert records["sampled"]["response"]["status_code"] == 200

    # Lines that are not requests: "error", no response.
    errors = [record for record in read(path) if record["response"] is None]
    assert sorted(record["error"]["code"] for record in errors) == ["invalid_json", "invalid_url", "missing_custom_id"]
    assert records["elsewhere"]["error"]["message"].startswith("`url` must be one of")
    # Bodies the server refuses: its status and OpenAI's error JSON as the response.
    for custom_id, status, param in [("unknown field", 400, "frequency_penalty_typo"), ("other model", 404, "model"),
                                     ("too long", 400, "max_tokens"), ("stream", 400, "stream")]:
        refused = records[custom_id]
        assert refused["error"] is None and refused["response"]["status_code"] == status, custom_id
        assert refused["response"]["body"]["error"]["param"] == param


def test_a_seeded_request_gets_the_same_answer_in_any_batch(llama, tmp_path):
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    with Output(first) as output:
        answer_all(llama, MODEL, [LINES[8]], output)
    with Output(second) as output:
        answer_all(llama, MODEL, LINES, output)
    content = [by_id(path)["sampled"]["response"]["body"]["choices"][0]["message"] for path in (first, second)]
    assert content[0] == content[1]


def test_a_resumed_job_answers_what_is_left_as_an_unbroken_run_would(llama, tmp_path):
    unbroken, broken = tmp_path / "unbroken.jsonl", tmp_path / "broken.jsonl"
    with Output(unbroken) as output:
        answer_all(llama, MODEL, LINES, output)
    kept = unbroken.read_text().splitlines(keepends=True)[:5]  # a job killed after five lines
    broken.write_text("".join(kept) + '{"id": "batch_req_1", "custom_id": "compl')  # and one cut short
    with Output(broken, resume=True) as output:
        answer_all(llama, MODEL, LINES, output)
    assert broken.read_text().startswith("".join(kept))
    assert len(read(broken)) == len(LINES)  # each line once: none again, none lost
    assert answers(broken) == answers(unbroken)


def answers(path) -> list[str]:
    """What each line got, less what differs between runs of the same request (ids and times)."""
    return sorted(json.dumps([record["custom_id"], record["error"], record["response"] and [
        record["response"]["status_code"],
        {k: v for k, v in record["response"]["body"].items() if k not in ("id", "created")}]], sort_keys=True)
        for record in read(path))


def test_requests_sharing_a_custom_id_are_refused_before_loading(tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join([LINES[0], "{not json", LINES[7], LINES[0]]) + "\n")
    with pytest.raises(ValueError, match=f"^{requests}: custom_id 'chat' is on request lines 1 and 4; give every "
                                         "request its own custom_id, to match its answer$"):
        read_lines(str(requests))


def test_results_are_never_replaced_unasked(tmp_path):
    """The missing checkpoint shows that nothing was loaded: the output was refused first."""
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    requests.write_text(LINES[0] + "\n")
    results.write_text('{"custom_id": "chat"}\n')
    with pytest.raises(ValueError, match=f"^-o {results} already holds results; pass --resume to go on from them, "
                                         "or --overwrite to replace them$"):
        main(str(requests), str(results), ckpt_dir=str(tmp_path / "none"), tokenizer_path=str(LLAMA2_TOKENIZER))
    with pytest.raises(FileNotFoundError, match="none"):  # asked: on to loading, which finds no checkpoint
        main(str(requests), str(results), overwrite=True, ckpt_dir=str(tmp_path / "none"),
             tokenizer_path=str(LLAMA2_TOKENIZER))
    assert results.read_text() == '{"custom_id": "chat"}\n'


@pytest.mark.slow  # a process of its own
def test_the_command_answers_a_file(checkpoint, tmp_path):
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    requests.write_text("\n".join(LINES[:4]) + "\n")
    done = subprocess.run([sys.executable, "-m", "llama_tp.run_batch", "-i", str(requests), "-o", str(results),
                           "--ckpt_dir", checkpoint, "--tokenizer_path", str(LLAMA2_TOKENIZER), "--model_name", MODEL,
                           "--max_seq_len", "64"], cwd=PROJECT_ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    records = by_id(results)
    assert records["chat"]["response"]["status_code"] == 200 and len(results.read_text().splitlines()) == 4
