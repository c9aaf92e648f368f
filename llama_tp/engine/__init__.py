"""The engine under every door (the API, the scripts, the batch runner, the server): it schedules
sequences into the KV cache's rows, runs each step (feed the model, choose every row's token, one
read-back) with speculation's rounds and structured outputs' grammars for any sequence, and hands
back each request's deltas.

requests.py: what a door hands it and what comes back; scheduler.py: which sequence runs in which
cache row and what a step feeds; engine.py: admitting, stepping, ending; step.py and choices.py:
a step's tensors and its one read-back; progress.py: a sequence's own state; speculative/: rounds
of guesses; jobs.py: batch jobs and streams (every rank holds every request); serving.py: the
server's lockstep loop (rank 0 hears of requests and tells the others); observer.py: what it tells
a watcher (the server's metrics); blocks.py: the KV cache's blocks, free, held or cached.
"""

from .engine import Admission, Engine, Update
from .jobs import JOB_PREFILL_TOKENS, prompt_seed, prompt_seeds, run_job
from .observer import Observer
from .requests import Delta, GenerationRequest, RequestState, TokenLogprob
from .serving import Cancel, Inbox, News, Serving

__all__ = ["JOB_PREFILL_TOKENS", "Admission", "Cancel", "Delta", "Engine", "GenerationRequest", "Inbox", "News",
           "Observer", "RequestState", "Serving", "TokenLogprob", "Update", "prompt_seed", "prompt_seeds", "run_job"]
