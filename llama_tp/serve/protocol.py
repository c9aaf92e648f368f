"""The request bodies of OpenAI's API as typed models (vLLM's entrypoints/openai/protocol.py is the
reference for names and types), and OpenAI's error JSON.

Every body is checked here, at the edge: an unknown field, a wrong type, a value out of range or a
feature this server does not implement becomes a RequestError, which the app answers with
OpenAI's {"error": {...}} body. What a value means for the model (token counts, sampling options)
is checked where the request is built (prepare.py).
"""

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from .limits import MAX_JSON_DEPTH, nesting_depth

# The error's "type" by HTTP status, as OpenAI's clients expect it (they pick the exception class
# from the status alone; the type and code are for people and logs).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
INT64 = 2**63  # seeds go to torch.Generator.manual_seed, which takes a 64-bit integer
MAX_LOGIT_BIAS = 1024  # entries in a request's logit_bias
# bad_words: each word's token sequences are matched against every row's last tokens each step
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 256, 256


class RequestError(Exception):
    """A request the server refuses, with what OpenAI's error body says about it."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


# Fields as clients send them, normalised by hand-written checks where a pydantic union would
# answer with one error per branch.

def _stop(value: Any) -> Any:
    """A lone string is a list of one; anything else must be a list of strings."""
    if isinstance(value, str):
        return [value]
    if value is None or (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        return value
    raise PydanticCustomError("expected", "a string or a list of strings")


def _text_content(value: Any) -> str:
    """A message's content: a string, or a list of text parts, joined with newlines (as vLLM does)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(part, dict) for part in value):
        raise PydanticCustomError("expected", 'a string or a list of parts {"type": "text", "text": ...}')
    for index, part in enumerate(value):
        if part.get("type") != "text":
            raise PydanticCustomError("unsupported", f"part {index} is of type {_shown(part.get('type'))}, which "
                                      "is not supported by this server: it takes text parts only")
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise PydanticCustomError("expected", 'a string or a list of parts {"type": "text", "text": ...}')
    return "\n".join(part["text"] for part in value)


def _prompt(value: Any) -> Any:
    """A completion's prompt: a string or a list of token ids, alone or as the only item of a list."""
    def single(prompt: Any) -> bool:
        return isinstance(prompt, str) or (
            isinstance(prompt, list) and all(type(token) is int for token in prompt))  # not bool

    if isinstance(value, list) and value and all(single(item) and not isinstance(item, int) for item in value):
        if len(value) > 1:
            raise PydanticCustomError("unsupported", f"{len(value)} prompts in one request are not supported by "
                                      f"this server: send {len(value)} requests of one prompt each")
        return value[0]
    if single(value):
        return value
    raise PydanticCustomError("expected", "a string or a list of token ids (or a list of one of them)")


def _json_text(value: str) -> str:
    """JSON carried as text (a call's arguments, a schema as a string), or any other text: JSON
    nested deeper than MAX_JSON_DEPTH is refused, before anything recurses through it."""
    try:
        parsed = json.loads(value)
    except RecursionError:
        parsed = None  # nested past Python's own limit
    except ValueError:
        return value  # not JSON: plain text
    if parsed is None or nesting_depth(parsed) > MAX_JSON_DEPTH:
        raise PydanticCustomError("nesting", f"its JSON nests arrays and objects more than {MAX_JSON_DEPTH} deep, "
                                  "which this server does not take")
    return value


def _schema(value: Any) -> Any:
    """vLLM's json: a JSON schema, as an object or as JSON text (its nesting checked)."""
    if isinstance(value, str):
        return _json_text(value)
    if value is None or isinstance(value, dict):
        return value
    raise PydanticCustomError("expected", "a JSON schema object, or one as a JSON string")


Stop = Annotated[Optional[list[str]], BeforeValidator(_stop)]
JsonText = Annotated[str, AfterValidator(_json_text)]
Schema = Annotated[Optional[Union[dict[str, Any], str]], BeforeValidator(_schema)]
TextContent = Annotated[str, BeforeValidator(_text_content)]
Prompt = Annotated[Union[str, list[int]], BeforeValidator(_prompt)]


# What clients may send that this server does not do: each field is accepted with the values that
# change nothing (None is always one), and refused with any other, saying why.
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "suffix": (("",), "it does not fill in text before a suffix"),
    "functions": (([],), "it does not call functions"),
    "function_call": (("none",), "it does not call functions"),
    "modalities": ((["text"],), "it answers in text only"),
    "audio": ((), "it answers in text only"),
    "prediction": ((), "it does not use predicted outputs"),
    "reasoning_effort": ((), "it has no effort setting; a thinking model such as Qwen3 thinks or not by its "
                         'chat_template_kwargs {"enable_thinking": false}'),
    "verbosity": ((), "it has no verbosity setting; ask for brevity in the prompt or set max_tokens"),
    "web_search_options": ((), "it does not search the web"),
    "moderation": ((), "it does not moderate"),
    "store": ((False,), "it stores no answers"),
    "service_tier": (("auto", "default"), "it has one tier"),
    # within a message
    "name": ((), "a message's participant name has no place in this model's chat format"),
    "refusal": ((), "it takes a message's text as content"),
}


def refuse_unsupported(model: BaseModel, prefix: str = "", table: dict[str, tuple[tuple, str]] = UNSUPPORTED) -> None:
    """Raise RequestError for the first field of model set to a value this server does not implement
    (table: each field's values that change nothing, and why the others are refused)."""
    for name in type(model).model_fields:
        if name in table:
            value = getattr(model, name)
            neutral, why = table[name]
            if value is not None and value not in neutral:
                shown = json.dumps(value)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                raise RequestError(400, f"`{prefix}{name}` = {shown} is not supported by this server: {why}",
                                   prefix + name, "unsupported_parameter")


class Body(BaseModel):
    # strict: "0.5" is not a number nor 1 a boolean; no NaN nor infinity (JSON has neither)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Body):
    include_usage: Optional[bool] = None
    include_obfuscation: Optional[bool] = None  # padding against a side channel: ignored


class JsonSchema(Body):
    """response_format's json_schema: the answer is JSON valid under schema."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")  # None: any JSON object
    strict: Optional[bool] = None  # the answer always follows the schema here


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchema] = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("expected", '{"type": "json_schema", "json_schema": {"name": ..., '
                                      '"schema": {...}}}, or a type "text" or "json_object" alone')
        return self


class StructuredOutputs(Body):
    """vLLM's structured_outputs: one of a JSON schema, a regular expression, a choice among
    strings or an EBNF grammar (xgrammar's, as GBNF)."""

    json_: Schema = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = Field(None, min_length=1)
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


class Function(Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments object
    strict: Optional[bool] = None  # a forced call always follows the schema here


class Tool(Body):
    type: Literal["function"]
    function: Function


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(Body):
    name: str
    arguments: JsonText


class ToolCallMessage(Body):
    """A call in an assistant message, as OpenAI answered it."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(Body):
    role: str  # the chat format knows its roles (chat_format.py); "developer" is OpenAI's new "system"
    content: Optional[TextContent] = None  # None only beside an assistant's tool_calls
    tool_call_id: Optional[str] = None  # the call a "tool" message answers
    name: Any = None
    tool_calls: Optional[list[ToolCallMessage]] = None
    refusal: Any = None
    reasoning_content: Optional[str] = None  # an assistant's thinking, as a reasoning model's answer gave it

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("content", "`content` is required (it may be null only beside an "
                                      "assistant's `tool_calls`)")
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("content", f"`tool_calls` belong to assistant messages, not {self.role!r} ones")
        if self.reasoning_content is not None and self.role != "assistant":
            raise PydanticCustomError("content", f"`reasoning_content` is an assistant's thinking, not in {self.role!r} "
                                      "messages")
        return self


class SamplingRequest(Body):
    """The fields that completions and chat completions share."""

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)  # None: as many as fit in max_seq_len
    temperature: Optional[float] = None  # None here and below: the model's recommended setting, else Meta's
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # vLLM's: 0 for no cut
    repetition_penalty: Optional[float] = None  # vLLM's
    min_tokens: Optional[int] = Field(None, ge=0)  # vLLM's
    seed: Optional[int] = Field(None, ge=-INT64, lt=INT64)
    stop: Stop = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # the end user, for an operator's abuse monitoring: ignored
    n: Optional[int] = Field(None, ge=1)  # choices of one prompt; at most --max_batch_size (prepare.py)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)  # OpenAI's range
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    # token id: bias; each entry is applied on the host every step, so a whole vocabulary's would slow the batch
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100)]]] = Field(None, max_length=MAX_LOGIT_BIAS)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older names.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Schema = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = Field(None, min_length=1)
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None  # there is one here (xgrammar): ignored
    # vLLM's: words the answer may not hold, each in every way it is tokenized (structured/bad_words.py)
    bad_words: Optional[list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]]] = Field(
        None, max_length=MAX_BAD_WORDS)
    # vLLM's beam search: `beam_width` beams (else best_of's, else n's), the n best returned (prepare.py)
    use_beam_search: Optional[bool] = None
    beam_width: Optional[int] = Field(None, ge=1)
    length_penalty: Optional[float] = None  # transformers' and vLLM's: a finished beam's sum over its length ** this
    early_stopping: Optional[Union[bool, str]] = None  # transformers': true, false or "never"

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("stream_options", "`stream_options` is only allowed when `stream` is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        refuse_unsupported(self)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    # Hints that change nothing here: ignored.
    metadata: Optional[dict[str, str]] = None
    parallel_tool_calls: Optional[bool] = None  # the answer's calls are all returned; a forced call is one
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    tools: Optional[list[Tool]] = Field(None, max_length=128)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM's: variables for the model's chat template
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    store: Any = None
    service_tier: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        for index, message in enumerate(self.messages):
            refuse_unsupported(message, f"messages[{index}].")


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    logprobs: Optional[int] = Field(None, ge=0, le=20)  # the legacy form: how many alternatives per token
    best_of: Optional[int] = Field(None, ge=1)  # only as many as n: every answer generated is returned
    echo: Optional[bool] = None  # the prompt's text before the answer's
    suffix: Any = None


class TokenizeRequest(Body):
    """vLLM's /tokenize: a prompt's tokens, or a dialog's in the chat format."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: bool = True  # a completion's begin token (where the tokenizer adds one)
    add_generation_prompt: Optional[bool] = None  # the chat format always opens the assistant's turn
    # A dialog's tools and template variables, as a chat completion's: the prompt it would have.
    tools: Optional[list[Tool]] = Field(None, max_length=128)
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("expected", "one of `prompt` or `messages`")
        if self.messages is None and (self.tools is not None or self.chat_template_kwargs is not None):
            raise PydanticCustomError("expected", "`tools` and `chat_template_kwargs` go with `messages`")
        return self

    def check_supported(self) -> None:
        for index, message in enumerate(self.messages or ()):
            refuse_unsupported(message, f"messages[{index}].")


class DetokenizeRequest(Body):
    """vLLM's /detokenize: the text of token ids."""

    model: Optional[str] = None
    tokens: list[int]

    def check_supported(self) -> None:
        pass


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """The request body as model, or a RequestError saying what is wrong with it."""
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RequestError(400, f"the body is not valid JSON: {error}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"the body must be a JSON object, found {type(data).__name__}", None, "invalid_json")
    if nesting_depth(data) > MAX_JSON_DEPTH:
        raise RequestError(400, f"the body nests arrays and objects more than {MAX_JSON_DEPTH} deep, which this "
                           "server does not take", None, "invalid_json")
    try:
        body = model.model_validate(data)
    except ValidationError as error:
        raise _request_error(error.errors(include_url=False)[0]) from None
    body.check_supported()
    return body


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _request_error(error: dict) -> RequestError:
    """A RequestError from pydantic's first error, naming the field as a path: messages[0].role."""
    # A union's branch shows in the path as its type (literal[...], NamedToolChoice): not a field, left out.
    loc = [part for part in error["loc"] if isinstance(part, int) or not (part[:1].isupper() or "[" in part)]
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    kind, message = error["type"], error["msg"]
    found = _shown(error.get("input"))
    if kind == "missing":
        return RequestError(400, f"`{param}` is required", param, "missing_required_parameter")
    if kind == "extra_forbidden":
        return RequestError(400, f"`{param}` is not a field this server knows (see docs/serving.md for "
                            "those it takes)", param, "unknown_parameter")
    if kind == "unsupported":
        return RequestError(400, f"`{param}`: {message}", param, "unsupported_parameter")
    if kind == "stream_options":
        return RequestError(400, message, "stream_options", "invalid_value")
    if kind in ("content", "nesting"):  # our own checks: the path, without pydantic's wording
        return RequestError(400, f"`{param}`: {message}", param or None, "invalid_value")
    if kind == "expected" and not param:  # a check on the body as a whole
        return RequestError(400, f"the body must have {message}", None, "invalid_type")
    if kind == "expected":
        return RequestError(400, f"`{param}` must be {message}, found {found}", param, "invalid_type")
    code = "invalid_type" if kind.endswith("_type") else "invalid_value"
    return RequestError(400, f"`{param}`: {message[0].lower()}{message[1:]}, found {found}", param, code)


def _shown(value: Any) -> str:
    """A value from the body as JSON, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
