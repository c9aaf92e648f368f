"""Tool calls in the model's own format: the tools described in the system message, earlier calls
and the tools' answers rendered as the model was trained to see them, and the answer's calls
parsed back into OpenAI's tool_calls.

Two formats: Llama 3.1's (the call is a JSON object {"name", "parameters"}; tool answers are
"ipython" messages) and Hermes' (Qwen 2.5, SmolLM2 and most ChatML models: the call is
<tool_call>{"name", "arguments"}</tool_call>; tool answers are <tool_response> blocks in a user
turn). A forced call (tool_choice "required" or a named function) is held by a grammar to the
format and the function's parameter schema, so that it always parses; an answer asked to follow a
JSON schema beside tools the model may call is held to either a call or that schema.
"""

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional

from .constraint import Constraint

HERMES, LLAMA3 = "hermes", "llama3"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def openai(self) -> dict:
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def tool_format(formatter) -> str:
    """The tool-call format of a chat format: Llama 3's for Llama 3, Hermes' otherwise (for a
    model's own template, that of the format recognised in it)."""
    formatter = getattr(formatter, "known", formatter)
    return LLAMA3 if type(formatter).__name__ == "Llama3ChatFormat" else HERMES


def arguments_key(fmt: str) -> str:
    return "parameters" if fmt == LLAMA3 else "arguments"


def render_dialog(messages: list[dict], tools: list[dict], fmt: str) -> list[dict]:
    """OpenAI's messages (with assistant tool_calls and tool answers) as a plain dialog of
    {"role", "content"} in fmt, with the tools (OpenAI's {"type": "function", "function": {...}})
    described in the system message."""
    dialog: list[dict] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [_call_text(call["function"]["name"], call["function"]["arguments"], fmt)
                     for call in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool" and fmt == HERMES:
            block = f"<tool_response>\n{content}\n</tool_response>"
            if dialog and dialog[-1].get("tool_answers"):  # answers to parallel calls share a turn
                dialog[-1]["content"] += "\n" + block
                continue
            dialog.append({"role": "user", "content": block, "tool_answers": True})
            continue
        elif role == "user" and fmt == HERMES and dialog and dialog[-1].get("tool_answers"):
            # The user's words after the tools' answers join their turn: the chat formats Hermes'
            # calls are written in (ChatML, Llama 2's, Mistral's) take turns that alternate.
            dialog[-1] = {"role": "user", "content": dialog[-1]["content"] + "\n\n" + content}
            continue
        dialog.append({"role": role, "content": content})
    if tools:
        described = _tools_text(tools, fmt)
        if dialog and dialog[0]["role"] == "system":
            dialog[0] = {"role": "system", "content": dialog[0]["content"] + "\n\n" + described}
        else:
            dialog.insert(0, {"role": "system", "content": described})
    return [{"role": message["role"], "content": message["content"]} for message in dialog]


def _call_text(name: str, arguments: str, fmt: str) -> str:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = arguments
    call = json.dumps({"name": name, arguments_key(fmt): parsed}, ensure_ascii=False)
    return call if fmt == LLAMA3 else f"<tool_call>\n{call}\n</tool_call>"


def _tools_text(tools: list[dict], fmt: str) -> str:
    """The tools' description and how to call them, in the words the models were trained on
    (Qwen 2.5's template for Hermes, Meta's Llama 3.1 prompt format for Llama 3)."""
    functions = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    if fmt == LLAMA3:
        return ("You have access to the following functions. To call a function, respond with a JSON object "
                'of the form {"name": function name, "parameters": dictionary of argument name and its value}, '
                "and nothing else.\n\n" + functions)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
            f"with function signatures within <tools></tools> XML tags:\n<tools>\n{functions}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def call_constraint(tools: list[dict], name: Optional[str], fmt: str) -> Constraint:
    """A grammar for one call of the named function (None: any of the tools), in fmt, its
    arguments held to the function's parameter schema."""
    chosen = [tool["function"] for tool in tools if name is None or tool["function"]["name"] == name]
    key = arguments_key(fmt)
    options = [{"type": "object", "properties": {
        "name": {"const": function["name"]},
        key: function.get("parameters") or {"type": "object"}},
        "required": ["name", key], "additionalProperties": False} for function in chosen]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    before, after = ("", "") if fmt == LLAMA3 else ("<tool_call>\n", "\n</tool_call>")
    return Constraint("tool_call", json.dumps({"schema": schema, "before": before, "after": after}))


def call_or_answer(tools: list[dict], fmt: str, answer: Constraint) -> Constraint:
    """A grammar for one call of any of the tools, in fmt, or else an answer held to `answer` (a
    json_schema or json_object constraint): OpenAI's response_format beside tools the model may
    call (tool_choice "auto"), as agents with tools and a typed output send them."""
    call = json.loads(call_constraint(tools, None, fmt).source)
    return Constraint("tool_call", json.dumps(call | {"answer": json.loads(answer.source or '{"type": "object"}')}))


def parse_tool_calls(text: str, fmt: str, names: set[str]) -> tuple[Optional[str], list[ToolCall]]:
    """The answer's words (None if only calls) and its calls of known functions; no calls when
    the answer holds none that parse."""
    key = arguments_key(fmt)
    if fmt == HERMES:
        found = [(match.start(), match.group(1)) for match in HERMES_CALL.finditer(text)]
        content = text[: found[0][0]].strip() if found else text
    else:
        stripped = text.strip()
        found = [(0, stripped)] if stripped.startswith("{") else []
        content = ""
    calls = []
    for _, body in found:
        try:
            call = json.loads(body)
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") in names and isinstance(call.get(key, {}), dict):
            calls.append(ToolCall(call["name"], json.dumps(call.get(key, {}), ensure_ascii=False)))
    if not calls:
        return text, []
    return content or None, calls
