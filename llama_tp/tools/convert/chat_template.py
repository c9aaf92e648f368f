"""Reading which chat format a model uses from its Jinja chat template, without running it."""

import re
from typing import Optional

# A marker only that format's template writes, and the format's name in llama_tp.json.
# Llama 2's template writes [INST] too, with its <<SYS>> system block: it is looked for first.
FORMAT_MARKERS = (("<|im_start|>", "chatml"), ("<|start_header_id|>", "llama3"), ("<|header_start|>", "llama4"),
                  ("<<SYS>>", "llama2"), ("[INST]", "mistral"))
# The token that ends an assistant turn, beyond the tokenizer's eos.
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "llama4": "<|eot|>"}

# A fixed system message the template writes when the dialog has none: SmolLM2's
# "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, ...<|im_end|>\n' }}".
# The newline may be a real one or Jinja's escaped "\n"; quotes or braces inside mean template code.
_CHATML_SYSTEM = re.compile(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}+]*?)<\|im_end\|>")


def chat_format_of(template: Optional[str]) -> Optional[str]:
    """The chat format a template writes, or None when there is no template or none we know."""
    for marker, name in FORMAT_MARKERS:
        if template and marker in template:
            return name
    return None


def default_system_prompt(template: Optional[str]) -> Optional[str]:
    """The system message a ChatML template adds to dialogs without one, if it has a fixed one."""
    match = _CHATML_SYSTEM.search(template or "")
    return match.group(1).replace("\\n", "\n") if match else None
