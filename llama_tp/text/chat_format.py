"""Turning a dialog into the prompt token ids a chat model was trained on: the model's own Hugging
Face chat template where its converter kept one, else the format it was trained in."""

import json
import re
from typing import Literal, NotRequired, Optional, TypedDict

from .jinja_template import check_variables, compile_template, reads, render
from .tokenizer import Llama3Tokenizer, Llama4Tokenizer

Role = Literal["system", "user", "assistant", "ipython", "tool"]  # the last two in Llama 3 only


class Message(TypedDict):
    role: Role
    content: str
    reasoning_content: NotRequired[str]  # an assistant's thinking, from a reasoning model's answer


Dialog = list[Message]

B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
SPECIAL_TAGS = (B_INST, E_INST, "<<SYS>>", "<</SYS>>")
UNSAFE_ERROR = "Error: special tags are not allowed as part of the prompt."
# A message's keys: its role and content; an assistant's thinking, which only a model's own chat
# template reads (Qwen3's keeps the last turn's); the other formats leave it out, as they leave
# out earlier answers' thinking.
MESSAGE_KEYS = {"role", "content", "reasoning_content"}


def check_dialog(dialog: Dialog, roles: tuple[str, ...] = ("system", "user", "assistant")) -> None:
    """Raise ValueError naming the first message that breaks the dialog's shape."""
    if not isinstance(dialog, list) or not dialog:
        raise ValueError(f"a dialog must be a non-empty list of messages, found {dialog!r}")
    for index, message in enumerate(dialog):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message) <= MESSAGE_KEYS:
            raise ValueError(
                f"message {index} must be {{'role': ..., 'content': ...}} (an assistant's may add "
                f"'reasoning_content'), found {message!r}"
            )
        if message["role"] not in roles:
            raise ValueError(
                f"message {index} has role {message['role']!r}; roles are {', '.join(roles)}"
            )
        if not isinstance(message["content"], str):
            raise ValueError(f"message {index} content must be a string, found {message['content']!r}")
        if "reasoning_content" in message and (message["role"] != "assistant"
                                               or not isinstance(message["reasoning_content"], str)):
            raise ValueError(f"message {index}: 'reasoning_content' is an assistant's thinking, a string; found "
                             f"{message['reasoning_content']!r} in a {message['role']!r} message")


def check_turns(turns: list[Message], offset: int) -> None:
    """Raise ValueError unless turns alternate user, assistant, ... and end with the user.

    offset: how many messages (a system message) precede turns in the dialog, for the message numbers.
    """
    if not turns:
        raise ValueError(f"message {offset - 1} is a system message with no user message after it")
    for index, message in enumerate(turns):
        expected = "user" if index % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise ValueError(
                f"message {index + offset} has role {message['role']!r} where {expected!r} was "
                "expected: after an optional system message, turns alternate user, assistant, ..."
            )
    if turns[-1]["role"] != "user":
        raise ValueError(
            f"message {len(turns) - 1 + offset} is from the assistant; a dialog must end with a user message"
        )


class Llama2ChatFormat:
    """Meta's Llama 2 chat prompt: [INST] turns, the system prompt folded into the first one."""

    takes_tools = False  # tools are described in its tool format (structured/tools.py)
    control_tags = SPECIAL_TAGS  # text that is_unsafe refuses in a message

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.stop_tokens = tokenizer.stop_tokens

    @staticmethod
    def is_unsafe(dialog: Dialog) -> bool:
        """The reference refuses dialogs that smuggle in its control tags."""
        return any(tag in message["content"] for tag in SPECIAL_TAGS for message in dialog)

    def encode_dialog_prompt(self, dialog: Dialog) -> list[int]:
        check_dialog(dialog)
        if dialog[0]["role"] == "system":
            if len(dialog) < 2:
                raise ValueError("message 0 is a system message with no user message after it")
            first = {"role": dialog[1]["role"], "content": B_SYS + dialog[0]["content"] + E_SYS + dialog[1]["content"]}
            turns, offset = [first] + dialog[2:], 1
        else:
            turns, offset = list(dialog), 0
        check_turns(turns, offset)
        tokens: list[int] = []
        for prompt, answer in zip(turns[::2], turns[1::2]):
            text = f"{B_INST} {prompt['content'].strip()} {E_INST} {answer['content'].strip()} "
            tokens += self.tokenizer.encode(text, bos=True, eos=True)
        tokens += self.tokenizer.encode(f"{B_INST} {turns[-1]['content'].strip()} {E_INST}", bos=True, eos=False)
        return tokens


LLAMA3_ROLES = ("system", "user", "assistant", "ipython", "tool")


class Llama3ChatFormat:
    """Meta's Llama 3 chat prompt: each message under a role header, ended by <|eot_id|>."""

    takes_tools = False
    control_tags: tuple[str, ...] = ()  # none: is_unsafe refuses nothing
    header = ("<|start_header_id|>", "<|end_header_id|>")
    end_of_turn = "<|eot_id|>"
    strips_content = True  # Meta's Llama 3 strips each message's whitespace; its Llama 4 keeps it

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.stop_tokens = tokenizer.stop_tokens

    @staticmethod
    def is_unsafe(dialog: Dialog) -> bool:
        """Never: message text is encoded as plain text, so it cannot forge a header or an eot."""
        return False

    def encode_header(self, role: str) -> list[int]:
        """<|start_header_id|>{role}<|end_header_id|> and the blank line before the content."""
        # Tool results are "tool" messages in newer Llama APIs; the model saw them as "ipython".
        role = "ipython" if role == "tool" else role
        special = self.tokenizer.special_tokens
        return (
            [special[self.header[0]]]
            + self.tokenizer.encode(role, bos=False, eos=False)
            + [special[self.header[1]]]
            + self.tokenizer.encode("\n\n", bos=False, eos=False)
        )

    def encode_message(self, message: Message) -> list[int]:
        """The header, the (stripped) content as plain text, and <|eot_id|>."""
        text = message["content"].strip() if self.strips_content else message["content"]
        content = self.tokenizer.encode(text, bos=False, eos=False)
        return self.encode_header(message["role"]) + content + [self.tokenizer.special_tokens[self.end_of_turn]]

    def encode_dialog_prompt(self, dialog: Dialog) -> list[int]:
        """<|begin_of_text|>, every message, then an open assistant header for the model to fill."""
        check_dialog(dialog, LLAMA3_ROLES)
        for index, message in enumerate(dialog):
            if message["role"] == "system" and index > 0:
                raise ValueError(f"message {index} is a system message; only message 0 may be one")
        if dialog[-1]["role"] in ("system", "assistant"):
            raise ValueError(
                f"message {len(dialog) - 1} is from the {dialog[-1]['role']}; the prompt ends with an "
                "open assistant header, so the dialog must end with a user, ipython or tool message"
            )
        tokens = [self.tokenizer.special_tokens["<|begin_of_text|>"]]
        for message in dialog:
            tokens += self.encode_message(message)
        return tokens + self.encode_header("assistant")


class Llama4ChatFormat(Llama3ChatFormat):
    """Meta's Llama 4 chat prompt: Llama 3's, under <|header_start|>{role}<|header_end|>, each
    message as written, ended by <|eot|>."""

    header = ("<|header_start|>", "<|header_end|>")
    end_of_turn = "<|eot|>"
    strips_content = False


def chat_format_for(tokenizer, chat_format: Optional[str] = None, default_system_prompt: Optional[str] = None,
                    chat_template: Optional[str] = None):
    """The model's chat template where its converter kept one (checkpoint/record.py) and its
    tokenizer names its control tokens (a tokenizer.json's), else the chat format the converter
    recorded, else the one its tokenizer implies."""
    known = known_chat_format(tokenizer, chat_format, default_system_prompt)
    if chat_template is not None and getattr(tokenizer, "special_tokens", None):
        return TemplateChatFormat(chat_template, tokenizer, known)
    return known


def known_chat_format(tokenizer, chat_format: Optional[str] = None, default_system_prompt: Optional[str] = None):
    """One of the formats written here: the one recorded, else the one the tokenizer implies."""
    if chat_format == "chatml":
        return ChatMLFormat(tokenizer, default_system_prompt)
    if chat_format == "mistral":
        return MistralChatFormat(tokenizer)
    if chat_format == "llama4" or (chat_format is None and isinstance(tokenizer, Llama4Tokenizer)):
        return Llama4ChatFormat(tokenizer)
    if chat_format == "llama3" or (chat_format is None and isinstance(tokenizer, Llama3Tokenizer)):
        return Llama3ChatFormat(tokenizer)
    return Llama2ChatFormat(tokenizer)


IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class ChatMLFormat:
    """ChatML: <|im_start|>{role}\\n{content}<|im_end|>\\n per message, then <|im_start|>assistant\\n."""

    takes_tools = False
    control_tags: tuple[str, ...] = ()  # none: is_unsafe refuses nothing

    def __init__(self, tokenizer, default_system_prompt: Optional[str] = None):
        if not hasattr(tokenizer, "special_id"):
            raise ValueError(f"ChatML needs a tokenizer with {IM_START} and {IM_END} tokens; "
                             f"{type(tokenizer).__name__} has none: check the chat format in the model's llama_tp.json")
        self.tokenizer = tokenizer
        self.default_system_prompt = default_system_prompt
        self.im_start, self.im_end = tokenizer.special_id(IM_START), tokenizer.special_id(IM_END)
        self.stop_tokens = tokenizer.stop_tokens | {self.im_end}

    @staticmethod
    def is_unsafe(dialog: Dialog) -> bool:
        """Never: message text is encoded as plain text, so it cannot forge <|im_start|> turns."""
        return False

    def encode_dialog_prompt(self, dialog: Dialog) -> list[int]:
        check_dialog(dialog)
        offset = 1 if dialog[0]["role"] == "system" else 0
        check_turns(dialog[offset:], offset)
        if offset == 0 and self.default_system_prompt is not None:
            dialog = [{"role": "system", "content": self.default_system_prompt}] + dialog
        newline = self.tokenizer.encode("\n", bos=False, eos=False)
        tokens: list[int] = []
        for message in dialog:
            text = f"{message['role']}\n{message['content']}"
            tokens += [self.im_start, *self.tokenizer.encode(text, bos=False, eos=False), self.im_end, *newline]
        return tokens + [self.im_start, *self.tokenizer.encode("assistant\n", bos=False, eos=False)]


class MistralChatFormat:
    """Mistral's prompt: <s>[INST] {user} [/INST]{answer}</s>[INST] {user} [/INST], one begin token
    for the dialog, a system message before the last user message (as Mistral's own templates put
    it). [INST] and [/INST] are control tokens where the vocabulary has them (v0.3), else text (v0.1)."""

    takes_tools = False
    control_tags: tuple[str, ...] = ()  # none: is_unsafe refuses nothing

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.stop_tokens = tokenizer.stop_tokens
        special = getattr(tokenizer, "special_tokens", {})
        self.controls = B_INST in special and E_INST in special

    @staticmethod
    def is_unsafe(dialog: Dialog) -> bool:
        """Never: where [INST] is a control token, text cannot forge it; where it is text, as in
        Mistral's own templates, it is only text."""
        return False

    def encode_dialog_prompt(self, dialog: Dialog) -> list[int]:
        check_dialog(dialog)
        offset = 1 if dialog[0]["role"] == "system" else 0
        turns = list(dialog[offset:])
        check_turns(turns, offset)
        if offset:
            turns[-1] = {"role": "user", "content": f"{dialog[0]['content']}\n\n{turns[-1]['content']}"}
        tokens = self.tokenizer.encode("", bos=True, eos=False)
        for message in turns:
            if message["role"] == "user":
                tokens += self.instruction(message["content"])
            else:
                tokens += self.tokenizer.encode(message["content"], bos=False, eos=True)
        return tokens

    def instruction(self, content: str) -> list[int]:
        """[INST] content [/INST]."""
        encode = self.tokenizer.encode
        if not self.controls:
            return encode(f"{B_INST} {content} {E_INST}", bos=False, eos=False)
        special = self.tokenizer.special_tokens
        return [special[B_INST], *encode(f" {content} ", bos=False, eos=False), special[E_INST]]


class TemplateChatFormat:
    """A model's Hugging Face chat template, rendered with jinja2 as transformers does
    (jinja_template.py), then tokenized with its control tokens recognised: the template writes
    them as text (<|im_start|>, bos_token).

    known: the format the converter recognised in the template, for its end-of-turn stop tokens
    and its tool-call format (structured/tools.py).
    """

    def __init__(self, template: str, tokenizer, known):
        self.source = template
        self.template = compile_template(template)
        self.takes_tools = reads(template, "tools")  # else tools are described as the known format does
        self.tokenizer, self.known = tokenizer, known
        self.stop_tokens = known.stop_tokens
        self.special_tokens = dict(tokenizer.special_tokens)  # text: id
        self.named_tokens = dict(getattr(tokenizer, "named_tokens", {}))  # bos_token: text, ...
        self.control_tags = tuple(sorted(self.special_tokens))
        longest_first = sorted(self.special_tokens, key=len, reverse=True)
        self._controls = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "template": None}  # a compiled template does not pickle: it compiles again

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.template = compile_template(self.source)

    def is_unsafe(self, dialog: list[dict]) -> bool:
        """Whether a message's text (or its calls') spells a control token, which would become
        that token once the rendered prompt is tokenized (and could forge the dialog's turns)."""
        return any(self.spells_control((message.get("content") or "") + (message.get("reasoning_content") or "")
                                       + json.dumps(message.get("tool_calls"), ensure_ascii=False))
                   for message in dialog)

    def spells_control(self, text: str) -> bool:
        """Whether text the template writes into the prompt (a message, the tools) holds a control token's text."""
        return self._controls.search(text) is not None

    def encode_messages(self, messages: list[dict], tools: Optional[list[dict]] = None,
                        variables: Optional[dict] = None) -> list[int]:
        """The prompt of OpenAI-shaped messages (tool_calls, tool messages) and tools, up to the
        assistant's turn; variables: more for the template (chat_template_kwargs, such as Qwen3's
        enable_thinking). TemplateRefused (a ValueError) when the template refuses them."""
        return self.encode(render(self.template, messages, tools, self.named_tokens, variables))

    def encode_dialog_prompt(self, dialog: Dialog, variables: Optional[dict] = None) -> list[int]:
        check_dialog(dialog, LLAMA3_ROLES)
        return self.encode_messages([dict(message) for message in dialog], variables=variables)

    def check_variables(self, variables: dict) -> None:
        """ValueError naming a variable of chat_template_kwargs that the rendering sets itself."""
        check_variables(variables, self.named_tokens)

    def encode(self, text: str) -> list[int]:
        """Rendered text's tokens: control tokens by their text, the rest as text (no begin
        token: the template writes it where the model wants it)."""
        tokens: list[int] = []
        for index, piece in enumerate(self._controls.split(text)):
            if index % 2:  # a control token's text, as the split captures them
                tokens.append(self.special_tokens[piece])
            elif piece:
                tokens += self.tokenizer.encode(piece, bos=False, eos=False)
        return tokens


def encode_dialog(formatter, dialog: Dialog, template_variables: Optional[dict] = None) -> list[int]:
    """A dialog's prompt in formatter; template_variables (chat_template_kwargs) reach a model's
    own chat template, and change nothing in the formats written here, which have no variables."""
    if template_variables and isinstance(formatter, TemplateChatFormat):
        formatter.check_variables(template_variables)
        return formatter.encode_dialog_prompt(dialog, template_variables)
    return formatter.encode_dialog_prompt(dialog)
