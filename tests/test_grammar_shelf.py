"""grammar_shelf.py: rank 0 holds a constrained request back until every rank has compiled its
grammar (each grammar ordered once, however many requests use it), lets a request whose grammar
failed on some rank go with why, and lets a grammar go once no request uses it; a rank's Shelf
compiles on the compiler's threads and reports each grammar once."""

import asyncio
import time

from fake_engine import StandInModel
from llama_tp.generation import Llama
from llama_tp.sampling import SamplingOptions
from llama_tp.engine.grammar_shelf import HeldRequests, Shelf
from llama_tp.engine.requests import GenerationRequest
from llama_tp.serve.mailbox import RequestStream
from llama_tp.structured.constraint import Constraint

REGEX, CHOICE = Constraint("regex", "[ab]+"), Constraint.choice(["yes", "no"])
LOOP = asyncio.new_event_loop()  # streams need one; nothing here is put into them


def stream(request_id: str, constraint=None) -> RequestStream:
    request = GenerationRequest(request_id, (1, 2), 4, SamplingOptions(), frozenset({2}), constraint=constraint)
    return RequestStream(request, LOOP)


def test_a_request_is_held_until_every_rank_has_its_grammar_which_is_ordered_once():
    held = HeldRequests(world_size=3)
    free, first, second = stream("free"), stream("a", REGEX), stream("b", REGEX)
    assert not held.hold(free) and held.hold(first) and held.hold(second)
    (number, constraint), = held.news()[0]
    assert constraint == REGEX and held.news() == ((), ())  # told once
    held.heard(0, [(number, None)])
    held.heard(2, [(number, None)])
    assert held.ready() == [] and held.streams == [first, second]
    held.heard(1, [(number, None)])
    assert held.ready() == [first, second] and held.streams == []
    assert held.number(first.request) == number and held.number(free.request) is None


def test_a_grammar_that_fails_on_any_rank_lets_its_requests_go_with_why():
    held = HeldRequests(world_size=2)
    request = stream("a", CHOICE)
    held.hold(request)
    (number, _), = held.news()[0]
    held.heard(0, [(number, None)])
    held.heard(1, [(number, "out of memory")])
    assert held.failed() == [(request, "compiling it failed on rank 1: out of memory")]
    assert held.ready() == [] and held.streams == []


def test_a_grammar_is_let_go_once_its_last_request_ends_and_ordered_anew_after():
    held = HeldRequests(world_size=1)
    first, second = stream("a", REGEX), stream("b", REGEX)
    held.hold(first)
    held.hold(second)
    (number, _), = held.news()[0]
    held.heard(0, [(number, None)])
    held.ready()
    held.ended(first.request)
    assert held.news() == ((), ())
    held.ended(second.request)
    assert held.news() == ((), (number,))
    held.heard(0, [(number, None)])  # a late report of a grammar let go: ignored
    again = stream("c", REGEX)
    held.hold(again)
    (renumbered, _), = held.news()[0]
    assert renumbered != number and held.ready() == []


def test_a_shelf_compiles_beside_the_caller_and_reports_each_grammar_once(llama2_tokenizer):
    shelf = Shelf(Llama(StandInModel(64), llama2_tokenizer).grammars)
    shelf.start([(0, REGEX), (1, Constraint("regex", "[^\\s\\S]"))])
    reports = ()
    deadline = time.monotonic() + 60
    while len(reports) < 2 and time.monotonic() < deadline:
        reports += shelf.finished()
        time.sleep(0.01)
    assert dict(reports) == {0: None, 1: "matches no text at all: its grammar allows no first token"}
    assert shelf.finished() == ()
    assert shelf.grammar(0) is not None
    shelf.release([0, 1])
    assert shelf.finished() == ()
