"""Hugging Face chat templates (Jinja), compiled and rendered as transformers' apply_chat_template
does (transformers/utils/chat_template_utils.py), so that a converted model sees the prompt its
makers wrote for it.

A template from the Hub is untrusted code: it runs in Jinja's immutable sandbox, with the helpers
transformers gives templates (raise_exception, strftime_now, a tojson that does not escape HTML,
dict, a namespace without underscore attributes) and its {% generation %} tag.
"""

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional

import jinja2
import jinja2.meta
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRefused(ValueError):
    """The template could not render this dialog (its raise_exception, or an error in its code)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML: templates are written against this one.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """dict() for templates, without the class itself (no attribute access to type internals)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """namespace() refusing underscore names, which could reach CPython's internals."""

    def __init__(*args, **kwargs):  # Jinja's own signature trick: namespace(self=...) still works
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the namespace attribute {name!r}")


class _GenerationTag(Extension):
    """transformers' {% generation %}...{% endgeneration %}, which marks the assistant's text for
    training masks: here it renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_GenerationTag, loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                               namespace=_TemplateNamespace)
    return environment


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """The template, compiled once; ValueError saying where its Jinja is wrong."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"the chat template is not valid Jinja: {error.message} (line {error.lineno})") from None


def reads(source: str, name: str) -> bool:
    """Whether the template reads the variable name (a template without `tools` ignores them)."""
    return name in jinja2.meta.find_undeclared_variables(_environment().parse(source))


# What render sets itself, which chat_template_kwargs may not (with the tokenizer's named tokens).
RENDER_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")


def check_variables(variables: dict, special_tokens: dict[str, str]) -> None:
    """ValueError naming a variable that render sets itself (a client's chat_template_kwargs)."""
    taken = [name for name in variables if name in RENDER_VARIABLES or name in special_tokens]
    if taken:
        raise ValueError(f"{taken[0]!r} is set by the server ({', '.join([*RENDER_VARIABLES, *special_tokens])} "
                         "are); pass the template's own switches only, such as enable_thinking")


def render(template: jinja2.Template, messages: list[dict], tools: Optional[list[dict]],
           special_tokens: dict[str, str], variables: Optional[dict] = None) -> str:
    """The prompt text for messages up to the assistant's turn (add_generation_prompt), with tools
    (OpenAI's function objects), the tokenizer's named tokens (bos_token, eos_token, ...) and the
    caller's variables (checked by check_variables), as apply_chat_template renders it;
    TemplateRefused naming the template's complaint."""
    try:
        return template.render(**(variables or {}), messages=messages, tools=tools or None, documents=None,
                               add_generation_prompt=True, **special_tokens)
    except jinja2.TemplateError as error:  # raise_exception, an undefined name, the sandbox
        raise TemplateRefused(f"the model's chat template refused the dialog: {error}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as error:
        raise TemplateRefused(f"the model's chat template failed on the dialog: {type(error).__name__}: "
                              f"{error}") from None
