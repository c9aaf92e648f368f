"""The Responses API's request body and input items as strict models, checked at the edge as the
chat bodies are (serve/protocol.py: the same strictness, error JSON and refusals of what this
server does not implement)."""

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BeforeValidator, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from ..protocol import Body, RequestError, refuse_unsupported

STATUS = Literal["in_progress", "completed", "incomplete"]
FUNCTION_NAME = r"^[a-zA-Z0-9_.-]+$"
TEXT_PARTS = ("input_text", "output_text")  # a user's words, or an assistant's sent back


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__


def _item_text(value: Any) -> str:
    """A message's or a tool output's content: a string, or text parts joined with newlines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(part, dict) for part in value):
        raise PydanticCustomError("expected", 'a string or a list of parts {"type": "input_text", "text": ...}')
    for index, part in enumerate(value):
        if part.get("type") not in TEXT_PARTS:
            raise PydanticCustomError("unsupported", f"part {index} is of type {_shown(part.get('type'))}, which is "
                                      "not supported by this server: it takes text parts only")
        if not isinstance(part.get("text"), str):
            raise PydanticCustomError("expected", 'a string or a list of parts {"type": "input_text", "text": ...}')
    return "\n".join(part["text"] for part in value)


ItemText = Annotated[str, BeforeValidator(_item_text)]


class MessageItem(Body):
    """A message: the user's (or system's, developer's) words, or an assistant's answer sent back."""

    type: Optional[Literal["message"]] = None
    role: Literal["user", "assistant", "system", "developer"]
    content: ItemText
    id: Optional[str] = None  # an answer's item id, sent back
    status: Optional[STATUS] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None  # kept on sent-back answers by newer clients


class FunctionCallItem(Body):
    """A call the model made, sent back before its output."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: Optional[str] = None
    status: Optional[STATUS] = None


class FunctionCallOutputItem(Body):
    """What the client's function answered to a call."""

    type: Literal["function_call_output"]
    call_id: str
    output: ItemText
    id: Optional[str] = None
    status: Optional[STATUS] = None


class ReasoningText(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Body):
    """A reasoning model's thinking, sent back before the answer it led to."""

    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[ReasoningText] = []
    content: Optional[list[ReasoningText]] = None
    encrypted_content: Optional[str] = None  # none is ever written here: the content is in the clear
    status: Optional[STATUS] = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


ITEM_TAGS = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput",
             "reasoning": "Reasoning"}  # capitalised: error paths leave a union's tags out (serve/protocol.py)


def _known_item(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type", "message") not in ITEM_TAGS:
        raise PydanticCustomError("unsupported", f"items of type {_shown(value.get('type'))} are not supported by "
                                  "this server: it takes message, function_call, function_call_output and reasoning "
                                  "items")
    return value


def _item_tag(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None) or "message"
    return ITEM_TAGS[kind]


InputItem = Annotated[Union[Annotated[MessageItem, Tag("Message")], Annotated[FunctionCallItem, Tag("FunctionCall")],
                            Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
                            Annotated[ReasoningItem, Tag("Reasoning")]],
                      Discriminator(_item_tag), BeforeValidator(_known_item)]


def _input_items(value: Any) -> Any:
    """A lone string is one user message."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value


class FunctionTool(Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments object
    strict: Optional[bool] = None  # a forced call always follows the schema here

    def chat(self) -> dict:
        """The chat API's shape of this tool."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters,
                    "strict": self.strict}
        return {"type": "function", "function": {key: value for key, value in function.items() if value is not None}}


def _functions_only(refusal: str) -> BeforeValidator:
    """A check that a tool or tool_choice is a function's; refusal (with {kind}) says why others are not."""
    def check(value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise PydanticCustomError("unsupported", refusal.format(kind=_shown(value.get("type"))))
        return value

    return BeforeValidator(check)


class FunctionChoice(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    """text.format: plain text, a JSON object, or JSON valid under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(None, min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None  # the answer always follows the schema here

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.name is not None and self.schema_ is not None):
            raise PydanticCustomError("expected", '{"type": "json_schema", "name": ..., "schema": {...}}, or a type '
                                      '"text" or "json_object" alone')
        return self

    def chat(self) -> dict:
        """The chat API's response_format."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema_}}

    def echoed(self) -> dict:
        """As a Response object shows it."""
        shown = {"type": self.type, "name": self.name, "schema": self.schema_, "description": self.description,
                 "strict": self.strict}
        return {key: value for key, value in shown.items() if value is not None}


class TextConfig(Body):
    format: Optional[TextFormat] = None
    verbosity: Any = None


class ReasoningConfig(Body):
    effort: Any = None
    summary: Any = None
    generate_summary: Any = None


class StreamOptions(Body):
    include_obfuscation: Optional[bool] = None  # padding against a side channel: ignored


# What clients may send that this server does not do, as serve/protocol.py's UNSUPPORTED.
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "max_tool_calls": ((), "every call the answer holds is returned"),
    "background": ((False,), "it answers while the request is open; stream a long answer instead"),
    "service_tier": (("auto", "default"), "it has one tier"),
    "truncation": (("disabled",), "it does not drop earlier turns; a conversation beyond max_seq_len is refused"),
    "top_logprobs": ((0,), "its Responses answers carry no log probabilities; /v1/chat/completions' logprobs do"),
    "prompt": ((), "it keeps no reusable prompts; send the instructions and input themselves"),
    "conversation": ((), "it keeps no conversation objects; chain responses with previous_response_id"),
    # within text and reasoning
    "verbosity": ((), "it has no verbosity setting; ask for brevity in the instructions or set max_output_tokens"),
    "effort": ((), "it has no effort setting; a thinking model such as Qwen3 thinks or not by its "
                   'chat_template_kwargs {"enable_thinking": false}'),
    "summary": ((), "it does not summarise the reasoning; the reasoning items hold the thinking itself"),
    "generate_summary": ((), "it does not summarise the reasoning; the reasoning items hold the thinking itself"),
}
# include's values this server can honour: reasoning items always hold their thinking in the clear.
INCLUDABLE = ("reasoning.encrypted_content",)


class ResponsesRequest(Body):
    model: str
    input: Annotated[list[InputItem], BeforeValidator(_input_items)]
    instructions: Optional[str] = None  # a system message before the input (not carried to a later turn)
    previous_response_id: Optional[str] = None  # the conversation so far: that response's input and output
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = None  # None: the model's recommended setting, else Meta's
    top_p: Optional[float] = None
    tools: Optional[list[Annotated[FunctionTool, _functions_only(
        "tools of type {kind} are not supported by this server: it calls the client's functions only")]]] = Field(
        None, max_length=128)
    tool_choice: Optional[Annotated[Union[Literal["none", "auto", "required"], FunctionChoice], _functions_only(
        'a tool_choice of type {kind} is not supported by this server: choose "none", "auto", "required" or a '
        "function")]] = None
    parallel_tool_calls: Optional[bool] = None  # every call the answer holds is returned
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    store: Optional[bool] = None  # default true: kept for previous_response_id and GET /v1/responses/{id}
    include: Optional[list[str]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM's: variables for the model's chat template
    # Hints that change nothing here: ignored.
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Any = None
    # What this server does not do (UNSUPPORTED).
    max_tool_calls: Any = None
    background: Any = None
    service_tier: Any = None
    truncation: Any = None
    top_logprobs: Any = None
    prompt: Any = None
    conversation: Any = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("stream_options", "`stream_options` is only allowed when `stream` is true")
        return self

    def check_supported(self) -> None:
        refuse_unsupported(self, table=UNSUPPORTED)
        if self.text is not None:
            refuse_unsupported(self.text, "text.", UNSUPPORTED)
        if self.reasoning is not None:
            refuse_unsupported(self.reasoning, "reasoning.", UNSUPPORTED)
        for value in self.include or ():
            if value not in INCLUDABLE:
                raise RequestError(400, f"`include` holds {json.dumps(value)}, which is not supported by this server: "
                                   f"it can include only {', '.join(INCLUDABLE)}", "include", "unsupported_parameter")
