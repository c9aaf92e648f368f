"""A script's --help, written from its main(): what it does, then every option with the kind of value
it takes, its default and its whole description from the docstring's Args section."""

import inspect
import re
import textwrap
import typing
from typing import Any, Callable, Optional

from .options import HYPHEN_NOTE, option_types

WIDTH = 100
INDENT = " " * 8


def help_text(main: Callable, program: str, passes_on: Optional[Callable] = None) -> str:
    """The help for main, run as program; passes_on: the function main hands its **options to."""
    summary, described = docstring_parts(main.__doc__ or "")
    lines = [f"usage: {program} [--OPTION VALUE]...", "", summary, "", HYPHEN_NOTE, "", "options:"]
    kinds = option_types(main)
    for name, parameter in inspect.signature(main).parameters.items():
        if parameter.kind is parameter.VAR_KEYWORD:
            if passes_on is not None:
                lines.append(f"  --OPTION VALUE (any of {passes_on.__module__}'s)")
                lines.append(_wrapped(described.get(name, "")))
            continue
        lines.append(f"  --{name}{_value(kinds[name])}{_default(parameter)}")
        if name in described:
            lines.append(_wrapped(described[name]))
    return "\n".join(lines)


def docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """A Google-style docstring's text before `Args:`, and each argument's description, joined
    into one line whatever it says (colons included)."""
    head, _, args = inspect.cleandoc(doc).partition("\nArgs:\n")
    described: dict[str, str] = {}
    indent = None
    names: list[str] = []
    for line in args.splitlines():
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        match = re.match(r"(\w+(?:, \w+)*): ?(.*)", line.strip())  # "name: ..." or "one, other: ..."
        if depth == indent and match:
            names = match[1].split(", ")
            described.update(dict.fromkeys(names, match[2]))
        elif depth < indent:  # a section after Args
            break
        elif names:
            for name in names:
                described[name] += " " + line.strip()
    return head.strip(), described


def _wrapped(text: str) -> str:
    return textwrap.fill(text, WIDTH, initial_indent=INDENT, subsequent_indent=INDENT)


def _value(annotation: Any) -> str:
    """What follows the option: nothing for a switch, else the kind of value, as a placeholder."""
    members = [member for member in typing.get_args(annotation) if member is not type(None)] or [annotation]
    if bool in members:
        return ""
    names = {int: "N", float: "NUMBER", str: "TEXT"}
    if len(members) == 1 and members[0] in names:
        return " " + names[members[0]]
    if typing.get_origin(members[0]) in (list, tuple):
        return " LIST"
    return " VALUE"


def _default(parameter: inspect.Parameter) -> str:
    if parameter.default is parameter.empty:
        return "  (required)"
    if parameter.default is None or parameter.default is False:
        return ""
    return f"  (default: {parameter.default})"
