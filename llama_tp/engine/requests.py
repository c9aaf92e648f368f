"""What a door hands the engine (a checked GenerationRequest) and what comes back (Deltas).

Every door (the API, the batch runner, the HTTP side) validates a request before it reaches the
engine: the engine never refuses a request, it only generates, and every request it takes ends
with exactly one final Delta.
"""

import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Union

import torch

from ..sampling import SamplingOptions
from ..structured.constraint import Constraint
from ..text.reasoning import Thinking


class RequestState(enum.Enum):
    """A request's life: waiting for a slot, generating, then one of the three ends."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"  # ended by a stop token, a stop string or its token limit
    CANCELLED = "cancelled"  # its client left, or the server stopped
    FAILED = "failed"  # the engine could not go on (a rank was lost)


@dataclass(frozen=True)
class BeamSearch:
    """Beam search's settings, as transformers' generate(num_beams=...) takes them: the request's
    `width` beams share its prompt's blocks (beams.py), and its answers are the `returned` best
    finished hypotheses, best first."""

    width: int  # num_beams, 2 or more: the hypotheses kept at each step
    # A finished hypothesis scores its summed log probability over (tokens generated) ** length_penalty:
    # above 0 longer answers gain, below 0 shorter ones
    length_penalty: float = 1.0
    # True: the search ends once `width` hypotheses have finished; False: also once no running beam
    # is likely to beat them (transformers' heuristic); "never": only once none can
    early_stopping: Union[bool, str] = False
    returned: int = 1  # num_return_sequences, at most width

    def check(self) -> None:
        """Raise ValueError naming the first setting out of range (in transformers' names)."""
        if not isinstance(self.width, int) or isinstance(self.width, bool) or self.width < 2:
            raise ValueError(f"num_beams must be an integer of 2 or more for beam search (1: none), found {self.width!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise ValueError(f"length_penalty must be a number (1.0: none; above 0 favours longer answers), found "
                             f"{self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never") or not isinstance(self.early_stopping, (bool, str)):
            raise ValueError(f'early_stopping must be True, False or "never", found {self.early_stopping!r}')
        if not isinstance(self.returned, int) or isinstance(self.returned, bool) or not 1 <= self.returned <= self.width:
            raise ValueError(f"num_return_sequences must be an integer from 1 to num_beams ({self.width}), found "
                             f"{self.returned!r}")


# A logits processor from Python (Llama.generate's logits_processors): (the tokens generated so far,
# logits [vocab]) -> logits, or (prompt tokens, tokens generated so far, logits) -> logits, as vLLM's.
LogitsProcessor = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class GenerationRequest:
    """A request a door has checked: its prompt fits, its options are in range."""

    id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int  # prompt_tokens plus max_tokens fit max_seq_len
    options: SamplingOptions  # min_gen_len is OpenAI's min_tokens; seed None: one drawn for it
    stop_tokens: frozenset[int]  # tokens that end the answer (the tokenizer's, a chat format's end of turn)
    stop: tuple[str, ...] = ()  # strings that end the answer, cut before them
    logprobs: bool = False  # each generated token's log probability
    top_logprobs: int = 0  # and the most likely alternatives at each step
    # Each step's likeliest tokens and their probabilities as the sampler saw them (penalties and
    # temperature applied): the API's show_top
    top_candidates: int = 0
    prompt_logprobs: bool = False  # each prompt token's log probability: the prompt is computed whole, none reused
    constraint: Optional[Constraint] = None  # the answer's grammar (structured outputs)
    thinking: Optional[Thinking] = None  # a reasoning model's answer: its constraint holds what follows the thinking
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias added to its logit)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from each generated token's logit
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per time the token was generated
    # Each banned word's token sequences (bad_words.py): its last token is banned where the tokens
    # before it end with the rest
    bad_words: tuple[tuple[int, ...], ...] = ()
    beams: Optional[BeamSearch] = None  # beam search's settings (beams.py); None: a token a step, sampled or greedy
    logits_processors: tuple[LogitsProcessor, ...] = ()  # run on rank 0 before its choice (the API's only)
    # `n`'s later choices: the id of the first, whose prompt's keys and values they copy once it
    # is prefilled instead of prefilling it again (the scheduler's Copy)
    shares_prefill_with: Optional[str] = None
    arrival: float = field(default_factory=time.monotonic)  # for time to first token


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability under the model, and the likeliest tokens at its step."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


@dataclass(frozen=True)
class Delta:
    """What one engine step produced for one request: new text (whole characters, never past a
    stop string), its tokens, and on the last delta the finish reason and the counts."""

    text: str = ""
    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when asked
    finish_reason: Optional[str] = None  # "stop" or "length" on a normal end; "cancelled"; "error"
    prompt_tokens: int = 0  # on the last delta
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values were reused, not computed
    # With finish_reason "error": what went wrong, for the client (never internal detail: that is
    # logged), OpenAI's code for it, and the status of a whole answer: 503 where the server failed
    # or stops, 400 where the request itself could not go on (its grammar allows no next token).
    error: Optional[str] = None
    error_code: str = "engine_failed"
    error_status: int = 503
    stop_string: Optional[str] = None  # with finish_reason "stop": the stop string that ended it, if one did
    # Beam search's answers on its last delta, best first, each as a last delta of its own (the
    # first is this delta's own text, tokens and finish reason); completion_tokens here is their sum
    beams: tuple["Delta", ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Submission(Protocol):
    """A request as rank 0 hears of it, and where its deltas go (the HTTP side's RequestStream)."""

    request: GenerationRequest

    def put(self, delta: Delta) -> None: ...
