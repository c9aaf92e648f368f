"""Every script's command line is checked against its options before anything starts."""

import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import fire
import pytest

from torchrun import LAUNCH, ROOT, environment, torchrun_command

from llama_tp.tools.cli import run
from llama_tp.tools.help import docstring_parts, help_text
from llama_tp.tools.options import HYPHEN_NOTE, OptionError, checked_command_line, option_types, wants_help


def sample(kind: str, dest: str = "out", max_seq_len: int = 128, temperature: Optional[float] = None,
           stream: bool = False, stop: Optional[list[str]] = None, batch_sizes: tuple[int, ...] = (1,),
           dtype: Optional[str] = None):
    """A script's main.

    Args:
        kind: what to do.
    """
    return dict(kind=kind, dest=dest, max_seq_len=max_seq_len, temperature=temperature, stream=stream,
                stop=stop, batch_sizes=batch_sizes, dtype=dtype)


def received_by_main(argv: list[str]) -> dict:
    """What sample receives from the checked command line, as fire hands it over."""
    return fire.Fire(sample, command=checked_command_line(sample, argv))


def through_fire(argv: list[str]) -> dict:
    """The options that the command line set to other than their defaults."""
    defaults = {name: parameter.default for name, parameter in inspect.signature(sample).parameters.items()}
    return {name: value for name, value in received_by_main(argv).items() if value != defaults[name]}


def refusal(argv: list[str]) -> str:
    with pytest.raises(OptionError) as error:
        checked_command_line(sample, argv)
    return str(error.value)


def test_a_misspelled_option_names_the_closest_one():
    assert refusal(["run", "--temprature", "0"]) == "--temprature: no such option; did you mean --temperature?"
    assert refusal(["run", "--max-seq-lenght=64"]) == "--max-seq-lenght: no such option; did you mean --max_seq_len?"


def test_an_unknown_option_points_to_help():
    assert refusal(["run", "--api_key", "secret"]) == "--api_key: no such option; see --help for the options"


def test_hyphenated_spellings_reach_main_as_the_same_options():
    received = through_fire(["run", "--max-seq-len", "64", "--stop", '["a-b"]', "--batch-sizes", "1,2"])
    assert received == {"kind": "run", "max_seq_len": 64, "stop": ["a-b"], "batch_sizes": (1, 2)}


def test_switches_take_words_and_fires_forms():
    assert received_by_main(["run", "--stream", "false"])["stream"] is False
    assert received_by_main(["run", "--stream=Yes"])["stream"] is True
    assert received_by_main(["run", "--stream", "--dtype", "bf16"])["stream"] is True
    assert received_by_main(["run", "--stream", "--nostream"])["stream"] is False
    assert refusal(["run", "--stream", "maybe"]) == "--stream maybe: expected true or false"


def test_values_of_the_wrong_kind_are_refused_with_what_was_expected():
    assert refusal(["run", "--max_seq_len", "many"]) == "--max_seq_len many: expected an integer"
    assert refusal(["run", "--temperature", "hot"]) == "--temperature hot: expected a number or None"
    assert refusal(["run", "--batch_sizes", "1,x"]) == "--batch_sizes 1,x: expected an integer, or a list of them"
    assert refusal(["run", "--max_seq_len"]) == "--max_seq_len: needs a value, as in --max_seq_len VALUE"


def test_numbers_and_negative_numbers_are_values():
    received = through_fire(["run", "--temperature", "-1", "--max_seq_len=7", "--dtype", "16"])
    assert (received["temperature"], received["max_seq_len"], received["dtype"]) == (-1, 7, 16)


def test_positional_arguments_fill_the_options_not_named():
    assert through_fire(["--kind", "a", "b"]) == {"kind": "a", "dest": "b"}
    assert refusal(["a", "b", "c", "d", "e", "f", "g", "h", "i"]) == (
        "'i': unexpected argument; options start with --, as in --kind VALUE")
    assert refusal(["a", "b", "many"]) == "--max_seq_len many: expected an integer"


def test_one_letter_shortcuts_resolve_only_when_unambiguous():
    assert through_fire(["run", "-k", "x"]) == {"kind": "x", "dest": "run"}
    assert refusal(["run", "-s", "x"]) == "-s: could be any of --stream, --stop; spell the option out"


def test_one_letter_shortcuts_prefer_the_one_option_that_must_be_given():
    def run_batch(input_file: str, output_file: str, overwrite: bool = False, other: int = 1):
        pass

    assert checked_command_line(run_batch, ["-i", "a", "-o", "b", "--overwrite"]) == [
        "--input_file=a", "--output_file=b", "--overwrite"]
    with pytest.raises(OptionError, match="^--output_file is missing: it has no default \\(see --help\\)$"):
        checked_command_line(run_batch, ["-i", "a"])
    assert checked_command_line(run_batch, ["a", "b"]) == ["a", "b"]  # or given by place


def test_help_is_asked_for_whatever_else_is_on_the_line():
    assert wants_help(["--temprature", "0", "--help"]) and wants_help(["-h"])
    assert not wants_help(["run", "--", "--help"])  # fire's own flags, after a lone --
    assert checked_command_line(sample, ["run", "--", "--trace"]) == ["run", "--", "--trace"]


def test_options_passed_on_are_accepted_but_still_checked():
    def tool(rounds: int = 1, **passed_on):
        pass

    assert checked_command_line(tool, ["--rounds", "2", "--max-seq-len", "9"], passes_on=sample) == [
        "--rounds=2", "--max_seq_len=9"]
    with pytest.raises(OptionError, match="--max_seq_lne: no such option; did you mean --max_seq_len?"):
        checked_command_line(tool, ["--max_seq_lne", "9"], passes_on=sample)


def test_help_mentions_the_hyphenated_spellings_and_each_option_whole():
    text = help_text(sample, "sample.py")
    assert text.startswith("usage: sample.py [--OPTION VALUE]...\n\nA script's main.\n\n" + HYPHEN_NOTE)
    assert "  --kind TEXT  (required)\n        what to do.\n" in text
    assert "  --max_seq_len N  (default: 128)\n" in text and "  --stream\n" in text
    assert "  --temperature NUMBER\n" in text and "  --stop LIST\n" in text


def test_a_description_with_colons_and_many_lines_is_kept_whole():
    summary, described = docstring_parts("""Do it.

    Args:
        first: a value: with colons, and
            a second line: still the first's.
        second: short.

    Returns:
        nothing.
    """)
    assert summary == "Do it."
    assert described == {"first": "a value: with colons, and a second line: still the first's.", "second": "short."}


# `if __name__ == "__main__":` and what runs a main through llama_tp.tools.cli: run(main), or
# run_tool("module", ...) for a python -m llama_tp.* command whose tool module holds it.
ENTRY = re.compile(r'^if __name__ == "__main__":\n\s+(run\(main\b|run_tool\("(?P<tool>[\w.]+)")', re.MULTILINE)


def entry_points() -> list[str]:
    """Every file that runs a main through llama_tp.tools.cli: the launch scripts and the
    python -m llama_tp.* commands."""
    files = sorted(ROOT.glob("launch/*.py")) + sorted(ROOT.glob("llama_tp/**/*.py"))
    return [str(file.relative_to(ROOT)) for file in files if ENTRY.search(file.read_text())]


def load_main(relative_path: str):
    if relative_path.startswith("launch/"):
        spec = importlib.util.spec_from_file_location(Path(relative_path).stem, ROOT / relative_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.main
    tool = ENTRY.search((ROOT / relative_path).read_text())["tool"]
    return importlib.import_module(tool or relative_path.removesuffix(".py").replace("/", ".")).main


def test_every_launch_script_and_command_is_found():
    found = set(entry_points())
    assert {"launch/chat.py", "launch/chat_completion.py", "launch/serve.py", "launch/text_completion.py",
            "llama_tp/convert.py", "llama_tp/reshard.py", "llama_tp/plan.py", "llama_tp/bench.py",
            "llama_tp/bench_serve.py", "llama_tp/tools/bench_world_sizes.py"} <= found


@pytest.mark.parametrize("entry_point", entry_points())
def test_every_entry_point_refuses_misspelled_and_unknown_options_and_takes_hyphens(entry_point):
    main = load_main(entry_point)
    options = list(option_types(main))
    named = [option for option in options if "_" in option] or options
    option = named[-1]
    misspelled = option[:-1] if len(option) > 3 else option + "x"
    with pytest.raises(OptionError, match=f"^--{misspelled}: no such option; did you mean --{option}\\?$"):
        checked_command_line(main, [f"--{misspelled}", "1"])
    with pytest.raises(OptionError, match="^--no_such_option: no such option"):
        checked_command_line(main, ["--no_such_option", "1"])
    required = [f"--{name}=1" for name, parameter in inspect.signature(main).parameters.items()
                if parameter.default is parameter.empty and name != option and name in options]
    hyphenated = checked_command_line(main, [*required, f"--{option.replace('_', '-')}=1"])
    assert hyphenated[-1].startswith(f"--{option}=") or hyphenated[-1] in (f"--{option}", f"--no{option}")


@pytest.mark.parametrize("entry_point", entry_points())
def test_every_entry_points_help_lists_each_option_with_its_whole_description(entry_point, monkeypatch, capsys):
    main = load_main(entry_point)
    monkeypatch.setattr(sys, "argv", [entry_point, "--help"])
    with pytest.raises(SystemExit) as exit:
        run(main)
    assert exit.value.code == 0
    text = capsys.readouterr().out
    assert "Optional" not in text and "Type:" not in text and "-h, " not in text
    unwrapped = " ".join(text.split())
    _, described = docstring_parts(main.__doc__)
    for name, parameter in inspect.signature(main).parameters.items():
        if parameter.kind is not parameter.VAR_KEYWORD:
            assert f"--{name}" in text, name
            assert name in described, f"{entry_point}: --{name} has no description in main's docstring"
            assert " ".join(described[name].split()) in unwrapped, name


@pytest.mark.slow
@pytest.mark.parametrize("entry_point", entry_points())
def test_a_misspelled_option_stops_each_command_at_once_with_exit_code_2(entry_point):
    command = ([sys.executable, str(ROOT / entry_point)] if entry_point.startswith("launch/") else
               [sys.executable, "-m", entry_point.removesuffix(".py").replace("/", ".")])
    result = subprocess.run([*command, "--max_seq_lenn", "64"], cwd=ROOT, env=environment(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("llama_tp error on rank 0: --max_seq_lenn: no such option")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 3])
def test_every_rank_refuses_a_misspelled_option_before_loading(world_size, tmp_path):
    missing = tmp_path / "never-read"
    result = subprocess.run(torchrun_command(world_size, str(LAUNCH / "chat_completion.py"), "--ckpt_dir",
                                             str(missing), "--tokenizer-path", str(missing), "--temprature", "0"),
                            cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    refusals = [line for line in result.stderr.splitlines()
                if line.startswith("llama_tp error") and "--temprature: no such option" in line]
    assert sorted(refusals) == [f"llama_tp error on rank {rank}: --temprature: no such option; did you mean "
                                "--temperature?" for rank in range(world_size)]
    assert "is missing" not in result.stderr and "not found" not in result.stderr  # nothing was loaded
