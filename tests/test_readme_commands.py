"""Every command that README.md, CONTRIBUTING.md and docs/ show for our scripts and tools runs as
written: its launcher options are torchrun's, its script or module exists, every option it passes
is one of that main's, of the right kind, and a demo-model run (no --ckpt_dir) asks for a world
size the demo splits into. Those that need no files of the user's are run (CI runs the README's
first command itself, in a fresh environment)."""

import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import PROJECT_ROOT, subprocess_env
from llama_tp.tools import demo
from llama_tp.tools.options import checked_command_line, wants_help
from test_options import ENTRY, load_main

PAGES = [PROJECT_ROOT / "README.md", PROJECT_ROOT / "CONTRIBUTING.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
LAUNCHERS = ("llama-tp", "torchrun")
# The scripts that run the demo model when no --ckpt_dir is given.
DEMO_SCRIPTS = ("launch/chat_completion.py", "launch/text_completion.py", "launch/chat.py", "launch/serve.py")


# A line that runs our code, after any VARIABLE=value: a launcher, a tool module or a launch script.
OURS = re.compile(r"^\s*(?:[A-Z_]+=\S+\s+)*(?:llama-tp |torchrun |python -m llama_tp|python launch/)")


def shown_commands(page: Path) -> list[str]:
    """The page's commands that run our code: lines of its code blocks (continued lines joined,
    `a && b` split) and inline `code` that starts like one."""
    text = page.read_text()
    lines = []
    for block in re.findall(r"```(?:bash|sh|console|)\n(.*?)```", text, re.DOTALL):
        lines += block.replace("\\\n", " ").splitlines()
    # inline code that is a whole command: not a tool's bare name (`python -m llama_tp.convert`) nor a
    # launcher's fragment (`torchrun --nproc_per_node N`)
    lines += [code for code in re.findall(r"(?<!`)`((?:python -m llama_tp|llama-tp |torchrun )[^`]*)`", text)
              if len(code.split()) > 3 and (code.startswith("python") or "launch/" in code or " -m " in code)]
    return [command.strip() for line in lines for command in line.split("&&") if OURS.match(command)]


def words_of(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    while re.match(r"^[A-Z_]+=", words[0]):  # VARIABLE=value before the command
        words = words[1:]
    return words


COMMANDS = [(page.relative_to(PROJECT_ROOT), command) for page in PAGES for command in shown_commands(page)]


def test_the_pages_show_the_commands_a_user_runs():
    readme = [command for page, command in COMMANDS if str(page) == "README.md"]
    assert readme[0] == "llama-tp --nproc_per_node 1 launch/chat_completion.py"  # the first command's run
    assert len(readme) >= 10 and any("run_batch" in command for _, command in COMMANDS)


def split(words: list[str]) -> tuple[list[str], str, list[str]]:
    """A command's launcher options, what it runs (launch/X.py, or llama_tp.X for a module) and that one's options."""
    if words[0] in LAUNCHERS:
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args(words[1:])  # torchrun's own parser: SystemExit on a bad option
        return words[1:len(words) - len(parsed.training_script_args) - 1], parsed.training_script, \
            parsed.training_script_args
    if words[1] == "-m":
        return [], words[2], words[3:]
    return [], words[1], words[2:]


def main_of(target: str):
    """The target's main, and the function it passes its **options on to, if any."""
    path = target if target.endswith(".py") else target.replace(".", "/") + ".py"
    if not (PROJECT_ROOT / path).is_file():
        raise AssertionError(f"{target} does not exist")
    passes_on = re.search(r"run\(main, passes_on=(\w+)\.main\)", (PROJECT_ROOT / path).read_text())
    module = importlib.import_module(path.removesuffix(".py").replace("/", ".")) if passes_on else None
    return load_main(path), getattr(module, passes_on[1]).main if passes_on else None


@pytest.mark.parametrize("page, command", COMMANDS, ids=[f"{page}: {command[:60]}" for page, command in COMMANDS])
def test_each_shown_command_fits_its_options(page, command):
    words = words_of(command)
    launcher, target, args = split(words)
    main, passes_on = main_of(target)
    if not wants_help(args):
        # placeholders (N, CKPT, HOST:PORT) stand for values of any kind
        values = ["1" if re.fullmatch(r"[A-Z][A-Z_:]*", arg) else arg for arg in args]
        checked_command_line(main, values, passes_on)  # OptionError names what does not fit
    if words[0] in LAUNCHERS and target in DEMO_SCRIPTS and "--ckpt_dir" not in args:
        nproc = int(launcher[launcher.index("--nproc_per_node") + 1])
        assert nproc in demo.WORLD_SIZES, f"the demo model splits over {demo.WORLD_SIZES}, not {nproc}"


@pytest.mark.parametrize("command", [command for page, command in COMMANDS
                                     if command.startswith("python -m llama_tp.plan")])
def test_the_plans_shown_run(command):
    result = subprocess.run([sys.executable, *words_of(command)[1:]], cwd=PROJECT_ROOT, env=subprocess_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Memory per process" in result.stdout
