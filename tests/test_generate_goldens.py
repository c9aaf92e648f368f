"""generate's answers where Meta's static loop once ran them (one prompt, show_top, echo with log
probabilities, a JSON schema, sampled speculation, the streams) are main's of 2026-11-28, token for
token: tests/golden/generate.json, written by tests/generate_goldens.py. At world size 1 here, and
at 2 in spawned processes."""

import json
from typing import Any

import pytest

from distributed import run_world
from generate_goldens import GOLDEN, answers, checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

# The file rounds log probabilities and probabilities to 5 places.
TOLERANCE = 2e-5


def assert_matches(found: Any, expected: Any, where: str = "") -> None:
    """found equals expected: token ids and text exactly, numbers to TOLERANCE."""
    if isinstance(expected, float):
        assert found == pytest.approx(expected, abs=TOLERANCE), where
    elif isinstance(expected, dict):
        assert sorted(found) == sorted(expected), where
        for key in expected:
            assert_matches(found[key], expected[key], f"{where} / {key}")
    elif isinstance(expected, list):
        assert isinstance(found, list) and len(found) == len(expected), f"{where}: {found} != {expected}"
        for index, (item, wanted) in enumerate(zip(found, expected)):
            assert_matches(item, wanted, f"{where} [{index}]")
    else:
        assert found == expected, where


def expected() -> dict:
    return json.loads(GOLDEN.read_text())


def test_one_process_gives_mains_answers(tmp_path):
    found = json.loads(json.dumps(answers(checkpoint(tmp_path, 1))))  # as the file holds them: tuples as lists
    assert_matches(found, expected())


@pytest.mark.slow  # two spawned processes
def test_two_processes_give_mains_answers(tmp_path):
    found = json.loads(json.dumps(run_world(2, answers, checkpoint(tmp_path, 2))[0]))
    assert_matches(found, expected())
