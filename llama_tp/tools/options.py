"""A script's command line checked against its main()'s options before anything starts.

fire calls main with the arguments it can use and complains about the rest only after main returns:
a misspelled --temprature would run a whole job at the default temperature, and a server would
serve without the --api-key it was given. Here every option is matched against main's parameters
first, spelled with underscores or hyphens, and its value against the parameter's type.
"""

import difflib
import inspect
import re
import types
import typing
from typing import Any, Callable, Optional

from fire.parser import DefaultParseValue

TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")
HYPHEN_NOTE = "Every option may also be spelled with hyphens, as in --max-seq-len for --max_seq_len."


class OptionError(ValueError):
    """A command line that does not fit the script's options."""


def checked_command_line(main: Callable, argv: list[str], passes_on: Optional[Callable] = None) -> list[str]:
    """argv in the spelling fire takes (--max-seq-len becomes --max_seq_len, --stream false becomes
    --nostream), or OptionError naming the first option or value that does not fit. passes_on is
    the function that main hands its **keyword options to, whose options are accepted too."""
    fire_args, fire_flags = _split_at_separator(argv)
    options = option_types(main)
    positional_names = list(options)
    required = {name for name, parameter in inspect.signature(main).parameters.items()
                if parameter.default is parameter.empty and name in options}
    if passes_on is not None:
        options = {**option_types(passes_on), **options}
    checked, positionals, named = [], [], set()
    index = 0
    while index < len(fire_args):
        argument = fire_args[index]
        index += 1
        if not _is_flag(argument):
            positionals.append(argument)
            continue
        key, has_equals, value = argument.lstrip("-").partition("=")
        name = key.replace("-", "_")
        bare = not has_equals and (index == len(fire_args) or _is_flag(fire_args[index]))
        name, negated = _resolve(name, argument, options, required, bare)
        named.add(name)
        annotation = options[name]
        if bare:
            if not (_is_switch(annotation) or annotation is Any):
                raise OptionError(f"{argument}: needs a value, as in --{name} VALUE")
            checked.append(f"--{'no' if negated else ''}{name}")
            continue
        if not has_equals:
            value = fire_args[index]
            index += 1
        checked.append(f"--{name}={_checked_value(name, value, annotation)}")
    free_names = [name for name in positional_names if name not in named]
    if len(positionals) > len(free_names):
        extra = positionals[len(free_names)]
        raise OptionError(f"{extra!r}: unexpected argument; options start with --, as in --{positional_names[0]} VALUE"
                          if positional_names else f"{extra!r}: unexpected argument; this command takes no options")
    for name, value in zip(free_names, positionals):
        _checked_value(name, value, options[name])
    missing = [name for name in free_names[len(positionals):] if name in required]
    if missing:
        raise OptionError(f"--{missing[0]} is missing: it has no default (see --help)")
    return positionals + checked + (["--", *fire_flags] if fire_flags or "--" in argv else [])


def wants_help(argv: list[str]) -> bool:
    """Whether the command line asks for --help (or -h), whatever else is on it."""
    script_args, _ = _split_at_separator(argv)
    return "--help" in script_args or "-h" in script_args


def option_types(function: Callable) -> dict[str, Any]:
    """Each named parameter of function and its type (Any where it has none)."""
    hints = typing.get_type_hints(function)
    return {name: hints.get(name, Any) for name, parameter in inspect.signature(function).parameters.items()
            if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)}


def _split_at_separator(argv: list[str]) -> tuple[list[str], list[str]]:
    """The script's arguments, and fire's own flags after the last lone --, as fire splits them."""
    if "--" not in argv:
        return argv, []
    last = len(argv) - 1 - argv[::-1].index("--")
    return argv[:last], argv[last + 1:]


def _is_flag(argument: str) -> bool:
    """As fire tells a flag: --anything, or a hyphen and a letter (so -1 is a value)."""
    return argument.startswith("--") or re.match(r"^-[a-zA-Z]", argument) is not None


def _resolve(name: str, argument: str, options: dict[str, Any], required: set[str], bare: bool) -> tuple[str, bool]:
    """The option a flag names, and whether it is a --noNAME that turns a switch off."""
    if name in options:
        return name, False
    if bare and name.startswith("no") and _is_switch(options.get(name[2:])):
        return name[2:], True
    if len(name) == 1 and not argument.startswith("--"):  # fire's -x for the one option starting with x
        matches = [option for option in options if option.startswith(name)]
        if len(matches) > 1 and len(set(matches) & required) == 1:  # -o: run_batch's output_file, not --overwrite
            matches = [option for option in matches if option in required]
        if len(matches) == 1:
            return matches[0], False
        if matches:
            raise OptionError(f"{argument}: could be any of --{', --'.join(matches)}; spell the option out")
    guess = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    hint = f"did you mean --{guess[0]}?" if guess else "see --help for the options"
    raise OptionError(f"{argument.partition('=')[0]}: no such option; {hint}")


def _checked_value(name: str, value: str, annotation: Any) -> str:
    """value as fire should read it for this option, or OptionError if it is of the wrong kind."""
    if _is_switch(annotation):
        word = value.strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return str(word in TRUE_WORDS)
        raise OptionError(f"--{name} {value}: expected true or false")
    if not _accepts(annotation, DefaultParseValue(value)):
        raise OptionError(f"--{name} {value}: expected {_describe(annotation)}")
    return value


def _is_switch(annotation: Any) -> bool:
    return annotation is bool or (_is_union(annotation) and bool in typing.get_args(annotation))


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether a parameter of this type takes value as fire parsed it. Only numbers and switches
    are checked: fire reads "12" as a number even for a text option, which the script accepts."""
    if annotation is Any or annotation is str:
        return True
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if _is_union(annotation):
        return any(_accepts(member, value) for member in typing.get_args(annotation))
    if typing.get_origin(annotation) in (list, tuple):  # fire takes one item alone, or [a, b]
        items = value if isinstance(value, (list, tuple)) else [value]
        item_types = [member for member in typing.get_args(annotation) if member is not Ellipsis] or [Any]
        return all(any(_accepts(item_type, item) for item_type in item_types) for item in items)
    return True


def _describe(annotation: Any) -> str:
    """A type as the user would say it: "an integer", "a number or nothing"."""
    if _is_union(annotation):
        return " or ".join(_describe(member) for member in typing.get_args(annotation))
    if typing.get_origin(annotation) in (list, tuple):
        item_types = [member for member in typing.get_args(annotation) if member is not Ellipsis]
        return f"{_describe(item_types[0])}, or a list of them" if item_types else "a list"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "text", type(None): "None"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))
