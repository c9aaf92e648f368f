"""A checked Messages body as the chat completion body it asks for, so that both doors share one
pipeline (prepare.py): the same dialog and settings give the same prompt tokens and answer.

Anthropic's dialog maps onto OpenAI's as vLLM's and llama.cpp's Messages doors map it: `system`
becomes the first message; an assistant's tool_use blocks its tool_calls (the input as JSON
text), its thinking blocks its reasoning_content; each tool_result block a `tool` message
answering its call, before the user's words. `thinking` is the chat template's switch,
enable_thinking (Qwen3's), as chat_template_kwargs.
"""

import json

from ..protocol import ChatCompletionRequest, RequestError
from .protocol import CountTokensRequest, InputMessage, MessagesRequest, ToolChoice, shown_choice

# Anthropic's tool_choice types as OpenAI's
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_body(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion body of a Messages body (of a count_tokens body: its prompt alone)."""
    messages = [] if body.system is None else [{"role": "system", "content": body.system}]
    for message in body.messages:
        messages += _chat_messages(message)
    chat = {"model": body.model, "messages": messages}
    if body.tools is not None:
        chat["tools"] = [{"type": "function", "function": {
            "name": tool.name, "parameters": tool.input_schema,
            **({"description": tool.description} if tool.description is not None else {})}} for tool in body.tools]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice, [tool.name for tool in body.tools or ()])
    if body.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    if isinstance(body, MessagesRequest):
        chat |= {"max_tokens": body.max_tokens, "stop": body.stop_sequences, "stream": body.stream,
                 "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
        output = body.output_config.format if body.output_config is not None else None
        if output is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                              "schema": output.schema_}}
    return ChatCompletionRequest.model_validate(chat)


def _chat_messages(message: InputMessage) -> list[dict]:
    """One Anthropic message as OpenAI's: an assistant's words and calls as one message; a user's
    tool results as tool messages, each run of its words as a user message (the words' blocks as
    OpenAI's text parts, which are joined with newlines)."""
    if message.role == "assistant":
        texts = [{"type": "text", "text": block.text} for block in message.content if block.type == "text"]
        calls = [{"id": block.id, "type": "function", "function": {
            "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
            for block in message.content if block.type == "tool_use"]
        # the template decides whether earlier thinking is shown (Qwen3's: after the last question only)
        thinking = "\n".join(block.thinking for block in message.content if block.type == "thinking")
        return [{"role": "assistant", "content": texts if texts or not calls else None,
                 **({"tool_calls": calls} if calls else {}), **({"reasoning_content": thinking} if thinking else {})}]
    messages: list[dict] = []
    for block in message.content:
        if block.type == "tool_result":
            content = f"Error: {block.content}" if block.is_error else block.content
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif messages and messages[-1]["role"] == "user":
            messages[-1]["content"].append({"type": "text", "text": block.text})
        else:
            messages.append({"role": "user", "content": [{"type": "text", "text": block.text}]})
    return messages or [{"role": "user", "content": ""}]  # no blocks: still the user's turn


def _tool_choice(choice: ToolChoice, names: list[str]):
    """OpenAI's tool_choice; a forced one needs tools, a named one one of them."""
    if choice.type in ("any", "tool") and not names:
        raise RequestError(400, f"`tool_choice` {shown_choice(choice)} needs `tools`", "tool_choice", "invalid_value")
    if choice.type != "tool":
        return TOOL_CHOICES[choice.type]
    if choice.name not in names:
        raise RequestError(400, f"`tool_choice.name` is {json.dumps(choice.name)}, which is not one of the tools: "
                           f"{', '.join(names)}", "tool_choice.name", "invalid_value")
    return {"type": "function", "function": {"name": choice.name}}
