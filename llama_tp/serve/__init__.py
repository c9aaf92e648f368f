"""An OpenAI-compatible HTTP server over the tensor-parallel ranks, with continuous batching.

Rank 0 runs the HTTP side (app: FastAPI on uvicorn, in a thread of its own) beside its share of
the engine; every rank runs the engine loop (engine) in lockstep: each step rank 0 tells the
others what changed (requests admitted, cancelled), and all of them then schedule alike
(scheduler) and run the same forward passes. A request's life is one small state machine
(requests), its counts visible in /metrics (metrics).
"""
