"""The scripts' batch-job files: prompts as JSON Lines, results written a whole line at a time as
each prompt finishes, and a job killed half-way that resumes to the file an unbroken run writes."""

import json
import signal
import subprocess
import sys
import time

import pytest

from jobs import LAUNCH, PROJECT_ROOT, subprocess_env
from llama_tp.tools.job_output import JobProgress, ResultLog, check_output
from llama_tp.tools.prompts import load_prompts
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint

PROMPTS = [f"Story {index}: " + "once upon a time " * (index % 7) for index in range(40)]


def test_prompts_come_as_a_json_list_or_one_a_line(tmp_path):
    listed, lines, guessed = tmp_path / "p.json", tmp_path / "p.jsonl", tmp_path / "p.txt"
    listed.write_text(json.dumps(PROMPTS[:3]))
    lines.write_text("".join(json.dumps(prompt) + "\n\n" for prompt in PROMPTS[:3]))
    guessed.write_text("".join(json.dumps(prompt) + "\n" for prompt in PROMPTS[:3]))
    assert load_prompts(str(listed), "text") == load_prompts(str(lines), "text") == load_prompts(str(guessed), "text")
    dialog = [{"role": "user", "content": "Hi"}]
    lines.write_text(json.dumps(dialog) + "\n")  # a .jsonl of one dialog is a list of one dialog
    assert load_prompts(str(lines), "chat") == [dialog]
    lines.write_text('"fine"\n{"broken"\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_prompts(str(lines), "text")


def test_resuming_keeps_whole_lines_and_cuts_a_half_written_one(tmp_path):
    path = tmp_path / "out.jsonl"
    log = ResultLog(str(path), PROMPTS, resume=False)
    log.write(2, {"prompt": PROMPTS[2], "generation": "a"})
    log.write(0, {"prompt": PROMPTS[0], "generation": "b"})
    log.close()
    with open(path, "a") as file:
        file.write('{"index": 5, "prompt": "Sto')  # what a crash mid-write could leave
    resumed = ResultLog(str(path), PROMPTS, resume=True)
    assert sorted(resumed.done) == [0, 2] and resumed.done[2]["generation"] == "a"
    resumed.close()
    assert path.read_text().endswith("}\n")
    with pytest.raises(ValueError, match="not that prompt of --prompts_file"):
        ResultLog(str(path), PROMPTS[1:], resume=True)
    assert ResultLog(str(path), PROMPTS, resume=False, overwrite=True).done == {}  # --overwrite: afresh
    assert path.read_text() == ""


def test_results_are_never_replaced_unasked(tmp_path):
    path = tmp_path / "out.jsonl"
    check_output(str(path), resume=False, overwrite=False)  # nothing there yet
    path.write_text('{"index": 0}\n')
    with pytest.raises(ValueError, match=f"^--output_jsonl {path} already holds results; pass --resume to go on "
                                         "from them, or --overwrite to replace them$"):
        ResultLog(str(path), PROMPTS, resume=False)
    assert path.read_text() == '{"index": 0}\n'
    with pytest.raises(ValueError, match="--resume goes on from the results in --output_jsonl and --overwrite "
                                         "discards them; pass one"):
        check_output(str(path), resume=True, overwrite=True)
    with pytest.raises(ValueError, match="--overwrite is about the results in --output_jsonl; pass --output_jsonl FILE"):
        check_output(None, resume=False, overwrite=True)
    with pytest.raises(FileNotFoundError, match="folder .*nowhere does not exist"):
        check_output(str(tmp_path / "nowhere" / "out.jsonl"), resume=False, overwrite=False)


def test_a_script_refuses_to_replace_results_before_loading(tmp_path):
    """The missing checkpoint shows that nothing was loaded: the file was refused first."""
    results = tmp_path / "results.jsonl"
    results.write_text('{"index": 0, "prompt": "x", "generation": "y"}\n')
    done = subprocess.run([sys.executable, str(LAUNCH / "text_completion.py"), "--ckpt_dir", str(tmp_path / "none"),
                           "--tokenizer_path", str(LLAMA2_TOKENIZER), "--output_jsonl", str(results)],
                          cwd=PROJECT_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr == (f"llama_tp error on rank 0: --output_jsonl {results} already holds results; pass "
                           "--resume to go on from them, or --overwrite to replace them\n")
    assert results.read_text() == '{"index": 0, "prompt": "x", "generation": "y"}\n'


def test_progress_says_prompts_done_tokens_a_second_and_time_left():
    progress = JobProgress(total=4, done=1)
    progress.update(10)
    assert progress.describe().startswith("2/4 prompts, ") and "tokens/s" in progress.describe()
    assert progress.describe().endswith("s left")


def script(checkpoint, prompts_file, *flags: str) -> list[str]:
    return [sys.executable, str(LAUNCH / "text_completion.py"), "--ckpt_dir", checkpoint,
            "--tokenizer_path", str(LLAMA2_TOKENIZER), "--prompts_file", str(prompts_file), "--max_batch_size", "4",
            "--max_seq_len", "96", "--max_gen_len", "40", "--temperature", "0", *flags]


@pytest.mark.slow  # three script runs
def test_a_killed_job_resumes_to_the_file_an_unbroken_run_writes(tmp_path):
    """Greedy: exactly the same tokens whatever shares the rows, on every CPU. (Sampled ones are
    too where our AVX-512 kernels run; elsewhere oneDNN's products round differently with the
    number of rows, and a random tiny model's flat distribution turns that into other samples.)"""
    write_checkpoint(tmp_path / "ckpt", TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")
    checkpoint, prompts_file = str(tmp_path / "ckpt"), tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(PROMPTS))
    unbroken, broken, lines = tmp_path / "unbroken.json", tmp_path / "broken.json", tmp_path / "broken.jsonl"
    env = subprocess_env()
    subprocess.run(script(checkpoint, prompts_file, "--output_json", str(unbroken)), cwd=PROJECT_ROOT, env=env,
                   check=True, capture_output=True, timeout=300)

    job = subprocess.Popen(script(checkpoint, prompts_file, "--output_jsonl", str(lines)), cwd=PROJECT_ROOT,
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while (not lines.exists() or lines.read_text().count("\n") < 3) and time.monotonic() < deadline:
        time.sleep(0.01)
    job.send_signal(signal.SIGKILL)
    job.wait()
    written = lines.read_text()
    assert 3 <= written.count("\n") < len(PROMPTS)  # killed half-way
    assert written.endswith("\n")  # whole lines only

    subprocess.run(script(checkpoint, prompts_file, "--output_jsonl", str(lines), "--resume",
                          "--output_json", str(broken)), cwd=PROJECT_ROOT, env=env, check=True,
                   capture_output=True, timeout=300)
    assert json.loads(broken.read_text()) == json.loads(unbroken.read_text())
    resumed = [json.loads(line) for line in lines.read_text().splitlines()]
    assert sorted(record["index"] for record in resumed) == list(range(len(PROMPTS)))
    assert lines.read_text().startswith(written)  # what the killed job wrote stays
