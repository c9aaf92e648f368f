"""From a checked body to the GenerationRequest the engine takes: the prompt's tokens, the
sampling options, and a token limit that fits the model's max_seq_len.

Everything the engine could trip on is refused here with a RequestError (400), so that no bad
request reaches the ranks.
"""

import json
from dataclasses import replace
from typing import Any, Optional

from ..structured.bad_words import word_sequences
from ..structured.constraint import Constraint, GrammarLimits
from ..structured.grammars import grammars_for
from ..structured.tools import call_constraint, call_or_answer, render_dialog, tool_format
from ..text.chat_format import encode_dialog
from ..text.jinja_template import check_variables
from ..text.reasoning import Thinking
from ..text.streaming import check_stop
from .limits import text_beyond
from .protocol import INT64, ChatCompletionRequest, CompletionRequest, RequestError, SamplingRequest
from ..engine.beams import search_blocks
from ..engine.requests import BeamSearch, GenerationRequest

# SamplingOptions.check names the option first in its message; the API's name for each.
OPTION_PARAMS = {"min_gen_len": "min_tokens"}


def chat_request(body: ChatCompletionRequest, generator, request_id: str,
                 grammar_limits: GrammarLimits = GrammarLimits()) -> GenerationRequest:
    """The request for a chat completion: the dialog in the model's chat format, ended by its end
    of turn; a structured output or forced call compiled within grammar_limits."""
    tools = callable_tools(body)
    forced = _forced_call(body, tools, generator)
    prompt_tokens = chat_prompt(body, generator, tools)
    # a reasoning model's answer: the structured output waits for the end of its thinking
    thinking = generator.reasoning.thinking(prompt_tokens) if generator.reasoning is not None else None
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError(400, "`top_logprobs` needs `logprobs: true`", "top_logprobs", "invalid_value")
    max_tokens, limit_param = body.max_tokens, "max_tokens"
    if body.max_completion_tokens is not None:
        if max_tokens is not None and max_tokens != body.max_completion_tokens:
            raise RequestError(400, f"`max_tokens` ({max_tokens}) and `max_completion_tokens` "
                               f"({body.max_completion_tokens}) differ; send one of them",
                               "max_completion_tokens", "invalid_value")
        max_tokens, limit_param = body.max_completion_tokens, "max_completion_tokens"
    return _request(body, generator, request_id, prompt_tokens, "messages", max_tokens,
                    generator.formatter.stop_tokens, bool(body.logprobs), body.top_logprobs or 0, grammar_limits,
                    limit_param, forced, thinking, tools)


def chat_prompt(body: ChatCompletionRequest, generator, tools: Optional[list[dict]] = None) -> list[int]:
    """A chat body's prompt tokens: its messages and the tools the model may call (callable_tools,
    unless given)."""
    return dialog_tokens(body.messages, generator, callable_tools(body) if tools is None else tools,
                         body.chat_template_kwargs)


def callable_tools(body) -> list[dict]:
    """The tools of a chat body (or /tokenize's) as dicts, none where tool_choice is "none" (the
    model is then not told of them)."""
    if getattr(body, "tool_choice", None) == "none":
        return []
    return [tool.model_dump(exclude_none=True) for tool in body.tools or ()]


def choices(body: SamplingRequest, request: GenerationRequest, generator) -> list[GenerationRequest]:
    """The engine's requests for the body's `n` choices of one prompt: request first, then n - 1
    that share its prefill (the engine copies its prompt's keys and values), each with its own
    random stream: the request's seed plus the choice's index (as vLLM does), or without a seed
    one the engine draws for each."""
    if request.beams is not None:  # beam search's n answers are its n best beams: one request (_beam_search)
        return [request]
    n = body.n or 1
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise RequestError(400, f"`best_of` ({best_of}) differs from `n` ({n}), which is not supported by this "
                           f"server without `use_beam_search`: it returns every answer it samples; ask for "
                           f"n={best_of} and choose among them (their log probabilities with `logprobs`), or search "
                           f"{best_of} beams with `use_beam_search`", "best_of", "unsupported_parameter")
    rows = generator.model.max_batch_size
    if n > rows:
        raise RequestError(400, f"`n` is {n}, but the server generates at most {rows} answers at once "
                           f"(--max_batch_size {rows}); ask for at most {rows} choices, or send several requests",
                           "n", "invalid_value")
    seed = request.options.seed
    return [request] + [
        replace(request, id=f"{request.id}-{index}", shares_prefill_with=request.id,
                options=replace(request.options, seed=None if seed is None else (seed + index + INT64) % (2 * INT64) - INT64))
        for index in range(1, n)]


def _forced_call(body: ChatCompletionRequest, tools: list[dict], generator) -> Optional[Constraint]:
    """The grammar of the call tool_choice forces ("required" or a named function), else None."""
    choice = body.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    if not tools:
        raise RequestError(400, f"`tool_choice` {_shown_choice(choice)} needs `tools`", "tool_choice", "invalid_value")
    names = [tool["function"]["name"] for tool in tools]
    name = None if choice == "required" else choice.function.name
    if name is not None and name not in names:
        raise RequestError(400, f"`tool_choice.function.name` is {json.dumps(name)}, which is not one of the tools: "
                           f"{', '.join(names)}", "tool_choice.function.name", "invalid_value")
    return call_constraint(tools, name, tool_format(generator.formatter))


def _shown_choice(choice) -> str:
    return json.dumps(choice) if isinstance(choice, str) else json.dumps(choice.model_dump())


def dialog_tokens(messages: list, generator, tools: Optional[list[dict]] = None,
                  template_variables: Optional[dict] = None) -> list[int]:
    """The prompt of checked messages up to the assistant's turn: rendered by the model's own chat
    template where it has one that takes tools (tools, calls and tool messages as the template
    writes them), else in the model's chat format, the tools described and earlier calls and
    answers written in its tool format. template_variables: chat_template_kwargs, for a template."""
    formatter = generator.formatter
    text = sum(len(m.content or "") + sum(len(c.function.arguments) for c in m.tool_calls or ()) for m in messages)
    _check_room(text + (len(json.dumps(tools)) if tools else 0), generator, "messages")
    try:
        check_variables(template_variables or {}, getattr(formatter, "named_tokens", {}))
    except ValueError as error:
        raise RequestError(400, f"`chat_template_kwargs`: {error}", "chat_template_kwargs", "invalid_value") from None
    forged_tools = False  # tools that a template writes into the prompt spell a control token
    try:
        if formatter.takes_tools:
            checked = template_messages(messages)
            prompt_tokens = formatter.encode_messages(checked, tools, template_variables)
            forged_tools = formatter.spells_control(json.dumps(tools or [], ensure_ascii=False))
        else:
            plain = [{"role": "system" if message.role == "developer" else message.role, "content": message.content,
                      "tool_calls": [call.model_dump() for call in message.tool_calls or ()]} for message in messages]
            checked = render_dialog(plain, tools or [], tool_format(formatter))
            prompt_tokens = encode_dialog(formatter, checked, template_variables)
    except ValueError as error:  # the chat format's checks, or the template's refusal (TemplateRefused)
        raise RequestError(400, f"`messages`: {error}", "messages", "invalid_value") from None
    if forged_tools or formatter.is_unsafe(checked):
        tags = formatter.control_tags
        shown = ", ".join(tags[:8]) + (", ..." if len(tags) > 8 else "")
        raise RequestError(400, f"`messages`: a message holds one of the chat format's control tags "
                           f"({shown}), which could forge the dialog's turns; remove them", "messages", "invalid_value")
    return prompt_tokens


def template_messages(messages: list) -> list[dict]:
    """Checked messages as a chat template takes them (as vLLM hands them to transformers): a
    call's arguments as an object where they are JSON, `developer` as `system`, an assistant's
    earlier thinking as its `reasoning_content`."""
    dialog = []
    for message in messages:
        item = {"role": "system" if message.role == "developer" else message.role, "content": message.content}
        if message.reasoning_content is not None:
            item["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            item["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name, "arguments": _json_or_text(call.function.arguments)}}
                for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        dialog.append(item)
    return dialog


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def text_tokens(prompt: str, generator, bos: bool = True) -> list[int]:
    """A completion prompt's tokens, after the begin token where the tokenizer adds one."""
    _check_room(len(prompt), generator, "prompt")
    try:
        return generator.tokenizer.encode(prompt, bos=bos, eos=False)
    except ValueError as error:
        raise RequestError(400, f"`prompt`: {error}", "prompt", "invalid_value") from None


def _check_room(characters: int, generator, param: str) -> None:
    """Refuse prompt text that surely holds more tokens than max_seq_len, before tokenizing it: a
    few megabytes take seconds of the GIL, and memory for every token."""
    max_seq_len = generator.model.max_seq_len
    if text_beyond(characters, generator.tokenizer, max_seq_len):
        raise RequestError(400, f"`{param}` holds {characters} characters of text, more than the model's max_seq_len "
                           f"of {max_seq_len} tokens could hold; shorten it", param, "context_length_exceeded")


def completion_request(body: CompletionRequest, generator, request_id: str,
                       grammar_limits: GrammarLimits = GrammarLimits()) -> GenerationRequest:
    """The request for a text completion: the prompt after bos, ended by the tokenizer's stop
    tokens; a structured output compiled within grammar_limits."""
    if isinstance(body.prompt, str):
        prompt_tokens = text_tokens(body.prompt, generator)
    else:
        prompt_tokens = body.prompt
        vocab = generator.tokenizer.n_words
        outside = [token for token in prompt_tokens if not 0 <= token < vocab]
        if outside:
            raise RequestError(400, f"`prompt` holds token id {outside[0]}, outside the vocabulary [0, {vocab})",
                               "prompt", "invalid_value")
    if body.echo and body.logprobs is not None:
        raise RequestError(400, "`echo` with `logprobs` is not supported by this server: it gives the answer's "
                           "log probabilities only; send one of them", "echo", "unsupported_parameter")
    return _request(body, generator, request_id, prompt_tokens, "prompt", body.max_tokens,
                    generator.tokenizer.stop_tokens, body.logprobs is not None, body.logprobs or 0, grammar_limits)


def _request(body: SamplingRequest, generator, request_id: str, prompt_tokens: list[int], prompt_param: str,
             max_tokens: Optional[int], stop_tokens, logprobs: bool, top_logprobs: int, grammar_limits: GrammarLimits,
             limit_param: str = "max_tokens", forced: Optional[Constraint] = None,
             thinking: Optional[Thinking] = None, tools: Optional[list[dict]] = None) -> GenerationRequest:
    """The checks and the request both endpoints share; limit_param: the field max_tokens came
    from; tools: those the model may call."""
    constraint = _constraint(body, generator, grammar_limits, forced, tools)
    max_seq_len = generator.model.max_seq_len
    if not prompt_tokens:
        raise RequestError(400, f"`{prompt_param}` is empty; it needs at least one token", prompt_param,
                           "invalid_value")
    room = max_seq_len - len(prompt_tokens)
    if room < 1:
        raise RequestError(400, f"the prompt has {len(prompt_tokens)} tokens but the model's max_seq_len is "
                           f"{max_seq_len}, which leaves no room for an answer; shorten the prompt, or serve the "
                           "model with a larger --max_seq_len",
                           prompt_param, "context_length_exceeded")
    if max_tokens is None:
        max_tokens = room  # OpenAI's default for chat: all that fits
    elif max_tokens > room:
        raise RequestError(400, f"the prompt's {len(prompt_tokens)} tokens and {limit_param} {max_tokens} make "
                           f"{len(prompt_tokens) + max_tokens}, beyond the model's max_seq_len of {max_seq_len}; "
                           f"ask for at most {room} tokens, shorten the prompt, or serve the model with a larger "
                           "--max_seq_len", limit_param,
                           "context_length_exceeded")
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        raise RequestError(400, f"`min_tokens` ({min_tokens}) is more than {limit_param} ({max_tokens})", "min_tokens",
                           "invalid_value")
    options = generator.sampling_options(body.temperature, body.top_p, body.top_k, body.repetition_penalty,
                                         min_tokens, body.seed)
    try:
        options.check()
        stop = check_stop(body.stop)
    except ValueError as error:
        message = str(error)
        name = message.split()[0]
        param = OPTION_PARAMS.get(name, name)
        raise RequestError(400, f"`{param}`{message[len(name):]}", param, "invalid_value") from None
    if constraint is not None:
        if min_tokens:
            raise RequestError(400, "`min_tokens` cannot be combined with a structured output: the grammar "
                               "decides where the answer ends", "min_tokens", "invalid_value")
        # a finished grammar allows only its stop tokens (a chat format's end of turn among them)
        stop_tokens = set(stop_tokens) | grammars_for(generator).stop_tokens
    request = GenerationRequest(
        id=request_id, prompt_tokens=tuple(prompt_tokens), max_tokens=max_tokens, options=options,
        stop_tokens=frozenset(stop_tokens), stop=stop, logprobs=logprobs, top_logprobs=top_logprobs,
        constraint=constraint, thinking=thinking,
        logit_bias=_logit_bias(body.logit_bias, generator.model.args.vocab_size),
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        bad_words=_bad_words(body, generator), beams=_beam_search(body, generator, constraint, top_logprobs),
    )
    _check_search_fits(request, generator, limit_param)
    return request


def _bad_words(body: SamplingRequest, generator) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as the token sequences the engine bans (structured/bad_words.py)."""
    try:
        return word_sequences(generator.tokenizer, body.bad_words or ())
    except ValueError as error:
        raise RequestError(400, f"`{str(error).split()[0]}` must be a word or phrase, not only spaces",
                           str(error).split()[0], "invalid_value") from None


# What beam search refuses beside it, and why: (the field, whether the body sets it, why not).
BEAM_REFUSALS = (
    ("stream", lambda body: body.stream, "the beams' answers are known only once the search ends"),
    ("stop", lambda body: body.stop, "beams end at stop tokens and the token limit"),
    ("logit_bias", lambda body: body.logit_bias, "beams are scored by the model's log probabilities"),
    ("presence_penalty", lambda body: body.presence_penalty, "beams are scored by the model's log probabilities"),
    ("frequency_penalty", lambda body: body.frequency_penalty, "beams are scored by the model's log probabilities"),
)


def _beam_search(body: SamplingRequest, generator, constraint: Optional[Constraint],
                 top_logprobs: int) -> Optional[BeamSearch]:
    """vLLM's use_beam_search: the width is beam_width, else best_of (the completions API's), else n;
    the answers are the n best. None without it (length_penalty and early_stopping are then refused)."""
    if not body.use_beam_search:
        for name in ("beam_width", "length_penalty", "early_stopping"):
            if getattr(body, name) is not None:
                raise RequestError(400, f"`{name}` needs `use_beam_search: true`", name, "invalid_value")
        return None
    n, best_of = body.n or 1, getattr(body, "best_of", None)
    width, param = next(((value, name) for value, name in ((body.beam_width, "beam_width"), (best_of, "best_of"))
                         if value is not None), (n, "n"))
    if width < 2:
        raise RequestError(400, f"`use_beam_search` needs 2 or more beams, found {width} (`{param}`): send `n` (vLLM's "
                           "beam width, every beam returned) or `beam_width`", param, "invalid_value")
    rows = generator.model.max_batch_size
    if width > rows:
        raise RequestError(400, f"`{param}` is {width}, but a beam takes a row and the server runs at most {rows} "
                           f"(--max_batch_size {rows}); search at most {rows} beams", param, "invalid_value")
    if n > width:
        raise RequestError(400, f"`n` ({n}) is more than the {width} beams searched (`{param}`): beam search returns "
                           "at most one answer a beam", "n", "invalid_value")
    refused = [(name, why) for name, sets, why in BEAM_REFUSALS if sets(body)]
    if constraint is not None:  # a structured output's field, or tool_choice's forced call
        asked = next((param for param, asked in _constraints_asked(body) if asked is not None), "tool_choice")
        refused.append((asked, "beams are not checked against a grammar"))
    if top_logprobs:
        refused.append(("top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs",
                        "a beam's alternatives are every beam's candidates"))
    if refused:
        name, why = refused[0]
        raise RequestError(400, f"`{name}` cannot be combined with `use_beam_search`: {why}", name,
                           "unsupported_parameter")
    early_stopping = False if body.early_stopping is None else body.early_stopping
    if early_stopping not in (True, False, "never"):
        raise RequestError(400, f'`early_stopping` must be true, false or "never", found {early_stopping!r}',
                           "early_stopping", "invalid_value")
    length_penalty = 1.0 if body.length_penalty is None else body.length_penalty
    return BeamSearch(width, length_penalty, early_stopping, n)


def _check_search_fits(request: GenerationRequest, generator, limit_param: str) -> None:
    """Refuse a beam search whose beams could outgrow the whole KV cache (they would preempt each other for good)."""
    if request.beams is None:
        return
    blocks = search_blocks(len(request.prompt_tokens), request.max_tokens, request.beams.width)
    held = generator.model.cache_blocks
    if blocks > held:
        raise RequestError(400, f"a search of {request.beams.width} beams over the prompt's {len(request.prompt_tokens)} "
                           f"tokens and {request.max_tokens} more may hold {blocks} blocks of the KV cache, which has "
                           f"{held}; search fewer beams or lower `{limit_param}`", limit_param, "invalid_value")


def _logit_bias(logit_bias: Optional[dict[str, float]], vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (token, bias) pairs, each id checked against the vocabulary:
    ASCII digits only ("²" and "١" are digits to str.isdigit, and int() takes neither or the other)."""
    pairs = []
    for key, bias in (logit_bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= len(str(vocab)) else None
        if token is None or not 0 <= token < vocab:
            raise RequestError(400, f"`logit_bias` has the key {json.dumps(key)}, which is not a token id in the "
                               f"vocabulary [0, {vocab})", "logit_bias", "invalid_value")
        if bias:
            pairs.append((token, float(bias)))
    return tuple(pairs)


def asks_for_grammar(body: SamplingRequest) -> bool:
    """Whether the body asks for a grammar (a structured output, or a tool call tool_choice
    forces), which preparing it compiles."""
    return getattr(body, "tool_choice", None) not in (None, "none", "auto") or any(
        constraint is not None for _, constraint in _constraints_asked(body))


def _constraint(body: SamplingRequest, generator, limits: GrammarLimits,
                forced: Optional[Constraint] = None, tools: Optional[list[dict]] = None) -> Optional[Constraint]:
    """The one structured output the body asks for (forced: a tool call tool_choice forces; tools:
    those the model may call), compiled here within limits, so that a grammar too large, too slow,
    that matches no text or that xgrammar cannot compile is a 400 naming the field (every rank
    compiles it again before the request is admitted: grammar_shelf.py).

    response_format shapes the answer a turn ends with, as OpenAI has it: a turn tool_choice
    forces to call a tool gives none, so the call's grammar holds it alone; a turn that may call
    a tool is held to a call or the answer's schema. Agents with tools and a typed output (as
    openai-agents makes them) send both."""
    asked = [(param, constraint) for param, constraint in _constraints_asked(body) if constraint is not None]
    shapes_answer = bool(asked) and asked[0][0].startswith("response_format")
    answer = None  # the answer's own constraint, where the model may call a tool instead
    if forced is not None:
        asked = [("tool_choice", forced)] + asked[shapes_answer:]
    elif tools and shapes_answer:
        answer = asked[0][1]
        asked[0] = (asked[0][0], call_or_answer(tools, tool_format(generator.formatter), answer))
    if len(asked) > 1:
        raise RequestError(400, f"`{asked[0][0]}` and `{asked[1][0]}` both constrain the answer; send one of them",
                           asked[1][0], "invalid_value")
    if not asked:
        return None
    param, constraint = asked[0]
    grammars = grammars_for(generator)
    try:
        grammars.compile(constraint, limits)
    except ValueError as error:
        if answer is not None and _compiles(grammars, answer, limits):  # then the tools' schemas are at fault
            param = "tools"
        raise RequestError(400, f"`{param}` {error}", param, "invalid_value") from None
    return constraint


def _compiles(grammars, constraint: Constraint, limits: GrammarLimits) -> bool:
    try:
        grammars.compile(constraint, limits)
    except ValueError:
        return False
    return True


def _constraints_asked(body: SamplingRequest) -> list[tuple[str, Optional[Constraint]]]:
    """(the field's name, its constraint or None) for every field that may constrain the answer."""
    asked = []
    if body.response_format is not None:
        spec = body.response_format.json_schema
        constraint = {"text": None, "json_object": Constraint("json_object"),
                      "json_schema": spec and Constraint.json_schema(spec.schema_ or {"type": "object"})}
        param = "response_format.json_schema.schema" if spec is not None else "response_format"
        asked.append((param, constraint[body.response_format.type]))
    outputs = body.structured_outputs
    if outputs is not None:
        given = [(name, value) for name, value in (("json", outputs.json_), ("regex", outputs.regex),
                 ("choice", outputs.choice), ("grammar", outputs.grammar),
                 ("json_object", outputs.json_object or None)) if value is not None]
        if len(given) != 1:
            raise RequestError(400, "`structured_outputs` takes exactly one of json, regex, choice, grammar or "
                               f"json_object, found {len(given)}", "structured_outputs", "invalid_value")
        name, value = given[0]
        asked.append((f"structured_outputs.{name}", _vllm_constraint(name, value, f"structured_outputs.{name}")))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{name}")
        if value is not None:
            asked.append((f"guided_{name}", _vllm_constraint(name, value, f"guided_{name}")))
    return asked


def _vllm_constraint(name: str, value: Any, param: str) -> Constraint:
    """vLLM's json (a schema, or one as a JSON string), regex, choice, grammar or json_object."""
    if name == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise RequestError(400, f"`{param}` is a string but not JSON: {error}", param, "invalid_value") from None
            if not isinstance(value, dict):
                raise RequestError(400, f"`{param}` must be a JSON schema object", param, "invalid_value")
        return Constraint.json_schema(value)
    if name == "choice":
        return Constraint.choice(value)
    if name == "json_object":
        return Constraint("json_object")
    return Constraint(name, value)
