"""Anthropic's Messages API: its request bodies as strict models (the official `anthropic` SDK's
types are the reference for names and shapes), and its error envelope.

As with OpenAI's bodies (../protocol.py, whose checks and wording these share), every body is
checked here, at the edge: an unknown field, a wrong type or a feature this server does not
implement is a RequestError, which the app answers as {"type": "error", "error": {"type", "message"}}.
"""

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BeforeValidator, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from ..protocol import Body, RequestError, _shown, refuse_unsupported

# The error's "type" by HTTP status, as Anthropic's clients expect it.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
# Our 503 (the model loading, the server stopping, a rank lost) is Anthropic's 529, "overloaded",
# which its clients retry as they would a 503.
STATUSES = {503: 529}
# The shared checks (prepare.py) name some fields by their OpenAI names; a Messages client sent these.
FIELD_NAMES = {"stop": "stop_sequences", "response_format.json_schema.schema": "output_config.format.schema"}


def error_status(status: int) -> int:
    return STATUSES.get(status, status)


def error_body(status: int, message: str) -> dict:
    """Anthropic's error JSON for one of our statuses (before error_status)."""
    status = error_status(status)
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def messages_error(error: RequestError) -> tuple[int, dict]:
    """Anthropic's status and error JSON for a refusal, naming fields as a Messages client sent them."""
    message = error.message
    for openai_name, name in FIELD_NAMES.items():
        message = message.replace(f"`{openai_name}`", f"`{name}`")
    return error_status(error.status), error_body(error.status, message)


# Content blocks. A message's content is a string (one text block) or a list of blocks; the
# blocks this server takes are typed models, any other kind is refused by name.

BLOCK_TAGS = {"text": "TextBlock", "tool_use": "ToolUseBlock", "tool_result": "ToolResultBlock",
              "thinking": "ThinkingBlock", "redacted_thinking": "RedactedThinkingBlock"}
TAKEN = "text, tool_use, tool_result and thinking blocks"


def _blocks(value: Any) -> Any:
    """A string as one text block; every block's type one this server takes."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list) or not all(isinstance(block, dict) for block in value):
        raise PydanticCustomError("expected", 'a string or a list of content blocks {"type": ..., ...}')
    for index, block in enumerate(value):
        if block.get("type") not in BLOCK_TAGS:
            raise PydanticCustomError("unsupported", f"block {index} is of type {_shown(block.get('type'))}, which "
                                      f"is not supported by this server: it takes {TAKEN} (no images or documents)")
    return value


def _text(value: Any) -> Any:
    """A string, or a list of text blocks joined with newlines (as OpenAI's text parts are)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(block, dict) for block in value):
        raise PydanticCustomError("expected", 'a string or a list of text blocks {"type": "text", "text": ...}')
    for index, block in enumerate(value):
        if block.get("type") != "text":
            raise PydanticCustomError("unsupported", f"block {index} is of type {_shown(block.get('type'))}, which "
                                      "is not supported by this server: it takes text blocks only here")
        if not isinstance(block.get("text"), str) or not set(block) <= set(TextBlock.model_fields):
            raise PydanticCustomError("expected", 'a string or a list of text blocks {"type": "text", "text": ...}')
    return "\n".join(block["text"] for block in value)


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: Any = None  # a cache breakpoint: every prompt's prefix is cached here anyway
    citations: Any = None  # an earlier answer's citations: ignored


class ToolUseBlock(Body):
    """A call in an assistant message, as the server answered it."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None


class ToolResultBlock(Body):
    """A tool's answer to a call, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[str, BeforeValidator(_text)] = ""
    is_error: Optional[bool] = None  # the result reaches the model as "Error: ..." (translate.py)
    cache_control: Any = None


class ThinkingBlock(Body):
    """An earlier answer's reasoning, sent back by clients: the assistant message's reasoning_content."""

    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(Body):
    """Anthropic's encrypted thinking: nothing a local model can read, left out."""

    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Union[Annotated[TextBlock, Tag("TextBlock")], Annotated[ToolUseBlock, Tag("ToolUseBlock")],
                        Annotated[ToolResultBlock, Tag("ToolResultBlock")],
                        Annotated[ThinkingBlock, Tag("ThinkingBlock")],
                        Annotated[RedactedThinkingBlock, Tag("RedactedThinkingBlock")]],
                  # tags named as the models are: they stay out of an error's field path
                  Discriminator(lambda block: BLOCK_TAGS[block["type"] if isinstance(block, dict) else block.type])]
Blocks = Annotated[list[Block], BeforeValidator(_blocks)]
# Which role's messages may hold each kind of block.
BLOCK_ROLES = {"tool_use": "assistant", "thinking": "assistant", "redacted_thinking": "assistant",
               "tool_result": "user"}


def _role(value: Any) -> Any:
    if value in ("user", "assistant"):
        return value
    raise PydanticCustomError("expected", '"user" or "assistant" (a system prompt goes in the top-level `system`)')


class InputMessage(Body):
    role: Annotated[str, BeforeValidator(_role)]
    content: Blocks

    @model_validator(mode="after")
    def _blocks_of_the_role(self):
        for index, block in enumerate(self.content):
            role = BLOCK_ROLES.get(block.type, self.role)
            if role != self.role:
                raise PydanticCustomError("content", f"block {index} is a {block.type} block, which belongs to "
                                          f"{role} messages, not {self.role} ones")
        return self


class Tool(Body):
    """A tool the client runs, described by a JSON schema of its input."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None
    strict: Optional[bool] = None  # a forced call always follows the schema here
    cache_control: Any = None
    eager_input_streaming: Optional[bool] = None  # a forced call's input streams as it is written anyway
    input_examples: Optional[list[dict[str, Any]]] = None  # not shown to the model: ignored
    defer_loading: Any = None
    allowed_callers: Any = None

    @model_validator(mode="after")
    def _object_input(self):
        if self.input_schema.get("type") != "object":
            raise PydanticCustomError("content", 'the tool\'s `input_schema` must be an object\'s schema, '
                                      '{"type": "object", ...}')
        return self


def _custom_tool(value: Any) -> Any:
    """Anthropic's server tools (web search, code execution, ...) run on Anthropic's side."""
    if isinstance(value, dict) and value.get("type") not in (None, "custom"):
        raise PydanticCustomError("unsupported", f"a tool of type {_shown(value.get('type'))} is one of Anthropic's "
                                  "server tools, which this server does not run: it takes the client's own tools "
                                  '{"name", "description", "input_schema"}')
    return value


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None  # with "tool": the tool to call
    disable_parallel_tool_use: Optional[bool] = None  # a forced call is one call; auto returns every call

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError("expected", '{"type": "tool", "name": ...}, or a type "auto", "any" or "none" '
                                      "without a name")
        return self


class OutputFormat(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    format: Optional[OutputFormat] = None  # the answer is JSON valid under the schema
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None  # Claude's: ignored here


class Thinking(Body):
    """Whether a reasoning model thinks: the chat template's enable_thinking (translate.py)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(None, ge=1)  # not held: max_tokens bounds thinking and answer together
    display: Optional[Literal["summarized", "omitted"]] = None  # the thinking is always shown whole


# What Messages clients may send that this server does not do: accepted with the values that
# change nothing, refused with any other (as protocol.UNSUPPORTED).
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "container": ((), "it runs no code containers"),
    "mcp_servers": (([],), "it connects to no MCP servers; run them in the client"),
    "context_management": ((), "it does not edit the context; Claude Code's CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS=1 "
                               "leaves it out"),
    "service_tier": (("auto", "standard_only"), "it has one tier"),
    "speed": (("standard",), "it has one speed"),
    "defer_loading": ((False,), "it does not search tools"),
    "allowed_callers": ((), "it does not call tools from code"),
}


class CountTokensRequest(Body):
    """/v1/messages/count_tokens: what makes the prompt of a message."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: Optional[Annotated[str, BeforeValidator(_text)]] = None
    tools: Optional[list[Annotated[Tool, BeforeValidator(_custom_tool)]]] = Field(None, max_length=128)
    tool_choice: Optional[ToolChoice] = None
    output_config: Optional[OutputConfig] = None
    thinking: Optional[Thinking] = None
    # Hints that change nothing here: ignored.
    cache_control: Any = None  # automatic caching: every prompt's prefix is cached anyway
    speed: Any = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None

    def check_supported(self) -> None:
        refuse_unsupported(self, "", UNSUPPORTED)
        for index, tool in enumerate(self.tools or ()):
            refuse_unsupported(tool, f"tools[{index}].", UNSUPPORTED)


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)  # required, as Anthropic's API has it
    stop_sequences: Optional[list[str]] = None
    stream: Optional[bool] = None
    # Sampling settings: not in the 2026 SDK's signature, sent as extra body fields; left out,
    # the model's recommended setting as for chat completions.
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    metadata: Optional[dict[str, Any]] = None  # the end user's id, for abuse monitoring: ignored
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    service_tier: Any = None
    inference_geo: Optional[str] = None  # where the model runs: here
    diagnostics: Any = None


def shown_choice(choice: ToolChoice) -> str:
    return json.dumps(choice.model_dump(exclude_none=True))
