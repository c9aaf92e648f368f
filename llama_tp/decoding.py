"""What a call of the API asks beside its sampling options, checked: beam search (transformers'
num_beams, length_penalty, early_stopping, num_return_sequences), banned words as the token
sequences the engine bans, and Python's logits processors (docs/serving.md, "Decoding")."""

from dataclasses import dataclass
from typing import Callable, Optional

from .engine.beams import search_blocks
from .engine.requests import BeamSearch
from .sampling.processors import check_processors
from .structured.bad_words import word_sequences


@dataclass(frozen=True)
class Decoding:
    """A call's beam search (None: none), banned words' token sequences, Python's logits processors."""

    beams: Optional[BeamSearch] = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    processors: tuple = ()

    @property
    def returned(self) -> int:
        """Answers per prompt: beam search's num_return_sequences, else one."""
        return self.beams.returned if self.beams is not None else 1

    def digest(self) -> tuple:
        """What every rank must be given alike (Python's processors cannot be compared: their count)."""
        return self.beams, self.bad_words, len(self.processors)

    def check_fits(self, index: int, prompt_length: int, room: int, cache_blocks: int) -> None:
        """Refuse a search over prompt index whose beams could outgrow the whole KV cache (they
        would preempt each other step after step: beams.search_blocks)."""
        if self.beams is None:
            return
        width = self.beams.width
        blocks = search_blocks(prompt_length, room, width)
        if blocks > cache_blocks:
            raise ValueError(f"prompt {index}: a search of {width} beams over its {prompt_length} tokens and {room} "
                             f"more may hold {blocks} blocks of the KV cache, which has {cache_blocks}; give it more "
                             "(kv_cache_memory), search fewer beams or lower max_gen_len")


def decoding(tokenizer, max_batch_size: int, num_beams: int = 1, length_penalty: float = 1.0,
             early_stopping: "bool | str" = False, num_return_sequences: int = 1,
             bad_words: Optional[list[str]] = None, logits_processors: Optional[list[Callable]] = None,
             stop: tuple = (), show_top: int = 0, response_format: Optional[dict] = None) -> Decoding:
    """A call's Decoding, checked: ValueError naming the first argument that cannot be, or cannot
    be with the call's others (stop, show_top, response_format: none of them with beam search)."""
    if bad_words is not None and (isinstance(bad_words, str) or not isinstance(bad_words, (list, tuple))):
        raise ValueError(f"bad_words must be a list of words, found {bad_words!r}")
    checked = Decoding(None, word_sequences(tokenizer, bad_words or ()), check_processors(logits_processors))
    if num_beams == 1:
        if num_return_sequences != 1:
            raise ValueError(f"num_return_sequences {num_return_sequences!r} needs beam search: num_beams of at "
                             "least as many (one answer a prompt without; ask for more prompts to sample more)")
        return checked
    beams = BeamSearch(num_beams, length_penalty, early_stopping, num_return_sequences)
    beams.check()
    if num_beams > max_batch_size:
        raise ValueError(f"num_beams {num_beams} needs a cache row a beam, but max_batch_size is {max_batch_size}; "
                         f"build with max_batch_size of at least {num_beams}")
    refused = {"stop": (stop, "beams end at stop tokens and the token limit; cut the text yourself"),
               "show_top": (show_top, "a beam's candidates are those of every beam"),
               "response_format": (response_format, "beams are not checked against a grammar")}
    for name, (value, why) in refused.items():
        if value:
            raise ValueError(f"{name} cannot be combined with beam search (num_beams {num_beams}): {why}")
    return Decoding(beams, checked.bad_words, checked.processors)
