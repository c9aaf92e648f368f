"""What a converter writes beside params.json (llama_tp.json): how the model was tuned to be used.

The chat template (Jinja, as Hugging Face keeps it) and the chat format recognised in it, the
system prompt its template adds, the stop tokens that end a turn, the context it was trained
for, and the sampling settings its makers recommend (Hugging Face's generation_config.json, GGUF's
general.sampling.* keys), which generation uses where the caller gives none, as vLLM does.
Meta's own checkpoints have no such file: Meta's chat formats and defaults apply.
"""

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

RECORD_FILE = "llama_tp.json"
CHAT_FORMATS = ("llama2", "llama3", "chatml", "mistral")
# The recommended settings a record may hold, with the type each must have.
SAMPLING_SETTINGS = {"temperature": float, "top_p": float, "top_k": int, "repetition_penalty": float}


@dataclass(frozen=True)
class ModelRecord:
    chat_format: Optional[str] = None  # one of CHAT_FORMATS; None: the tokenizer's usual format
    default_system_prompt: Optional[str] = None  # sent when a dialog has no system message
    stop_tokens: tuple[int, ...] = ()  # ends of turn beyond the tokenizer's eos, e.g. <|im_end|>
    converted_from: Optional[str] = None  # the file or folder the weights came from, for people
    sampling: dict = field(default_factory=dict)  # recommended SAMPLING_SETTINGS, by name
    # The model's Hugging Face chat template (Jinja), which renders its chat prompts (text/chat_format.py)
    chat_template: Optional[str] = None
    # The tokens it was trained to attend over (config.json's max_position_embeddings, GGUF's
    # context_length): a longer max_seq_len is refused unless asked for (context.py)
    context_length: Optional[int] = None

    def to_json(self) -> str:
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        record["stop_tokens"] = sorted(set(self.stop_tokens))
        return json.dumps(record, indent=2, ensure_ascii=False) + "\n"


def read_record(ckpt_dir: Path) -> ModelRecord:
    """The converter's record in ckpt_dir, or an empty one for checkpoints that have none."""
    path = Path(ckpt_dir) / RECORD_FILE
    if not path.is_file():
        return ModelRecord()
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); fix it or convert the model again") from None
    known = {f.name for f in fields(ModelRecord)}
    if not isinstance(record, dict) or set(record) - known:
        raise ValueError(f"{path} must be a JSON object with keys among {', '.join(sorted(known))}; "
                         f"found {record!r:.200}")
    if record.get("chat_format") not in (None, *CHAT_FORMATS):
        raise ValueError(f"{path}: chat_format {record['chat_format']!r} is not one of "
                         f"{', '.join(CHAT_FORMATS)} or null")
    stop_tokens = record.get("stop_tokens", [])
    if not isinstance(stop_tokens, list) or not all(isinstance(t, int) and t >= 0 for t in stop_tokens):
        raise ValueError(f"{path}: stop_tokens must be a list of token ids, found {stop_tokens!r}")
    if not isinstance(record.get("chat_template", ""), (str, type(None))):
        raise ValueError(f"{path}: chat_template must be a Jinja template as a string, or null")
    context = record.get("context_length")
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
        raise ValueError(f"{path}: context_length must be a positive number of tokens or null, found {context!r}")
    check_sampling(record.get("sampling", {}), str(path))
    return ModelRecord(**{**record, "stop_tokens": tuple(stop_tokens)})


def check_sampling(sampling: dict, source: str) -> None:
    """Refuse recommended settings that are not SAMPLING_SETTINGS of the right types."""
    if not isinstance(sampling, dict):
        raise ValueError(f"{source}: sampling must be an object such as {{\"temperature\": 0.7}}, found {sampling!r}")
    for name, value in sampling.items():
        kind = SAMPLING_SETTINGS.get(name)
        if kind is None:
            raise ValueError(f"{source}: sampling setting {name!r} is not one of {', '.join(SAMPLING_SETTINGS)}")
        allowed = (int, float) if kind is float else (int,)
        if isinstance(value, bool) or not isinstance(value, allowed):
            raise ValueError(f"{source}: sampling {name} must be a {kind.__name__}, found {value!r}")
