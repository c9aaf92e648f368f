"""StepGraphs (model/step_graphs.py) without a GPU: a step runs at the next rung of the ladder, a
rung's graph is recorded once (after the ranks agreed its compiling went well) and replayed after,
and where compiling failed no graph is recorded: the step, and the ones after, run as they are.
torch.cuda's streams and graphs are stood in for by fakes that replay what they recorded."""

from contextlib import contextmanager, nullcontext

import pytest
import torch

from llama_tp.model.step_graphs import StepGraphs, ladder

SPARE = 7


class FakeGraph:
    """Records the step it captures and runs it again on replay, into the same output."""

    recording: "FakeGraph | None" = None

    def __init__(self):
        self.replay_step = None

    def replay(self) -> None:
        self.replay_step()


@pytest.fixture
def fake_cuda(monkeypatch):
    class Stream:
        def __init__(self, *args):
            pass

        def wait_stream(self, other):
            pass

    @contextmanager
    def graph(fake: FakeGraph, pool=None):
        FakeGraph.recording = fake
        yield
        FakeGraph.recording = None

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


class Step:
    """A step function that logs its calls: its output is tokens + 100 * positions + 1000 * slots
    (each row's first position and cache row, beside each of its tokens)."""

    def __init__(self):
        self.calls: list[tuple[int, bool]] = []  # (rows, while recording)

    def __call__(self, tokens, slots, positions, key):
        self.calls.append((len(tokens), FakeGraph.recording is not None))
        output = self.output(tokens, slots, positions)
        recording = FakeGraph.recording
        if recording is not None:  # what a replay recomputes from the inputs, as a graph does
            recording.replay_step = lambda: output.copy_(self.output(tokens, slots, positions))
        return output

    @staticmethod
    def output(tokens, slots, positions):
        return tokens + (100 * positions + 1000 * slots)[:, None]


def test_the_ladder_doubles_up_to_the_most_rows():
    assert ladder(1) == [1]
    assert ladder(16) == [1, 2, 4, 8, 16]
    assert ladder(24) == [1, 2, 4, 8, 16, 24]


def test_a_rung_is_recorded_once_then_replayed_with_each_steps_inputs(fake_cuda):
    step, agreed = Step(), []
    graphs = StepGraphs(step, 8, SPARE, torch.device("cpu"), record=True, after_compiling=lambda: agreed.append(1) or True)
    first = graphs.run(torch.tensor([[1], [2], [3]]), [0, 1, 2], [5, 6, 7], "greedy")
    assert first.tolist() == [[501], [1602], [2703]]
    assert step.calls == [(4, False), (4, False), (4, True)]  # two warm-ups, then the capture, at rung 4
    assert len(agreed) == 1  # the ranks agreed before recording
    again = graphs.run(torch.tensor([[4], [5]]), [3, 1], [9, 8], "greedy")  # rung 2: recorded anew
    assert again.tolist() == [[3904], [1805]]
    third = graphs.run(torch.tensor([[9]] * 4), [0, 1, 2, 3], [1, 1, 1, 1], "greedy")  # rung 4 again: a replay
    assert third.tolist() == [[109], [1109], [2109], [3109]]
    assert len(step.calls) == 6 and len(agreed) == 2


def test_rows_of_several_tokens_run_at_the_next_rung_padded_with_spare_rows(fake_cuda):
    """A verifying step's rows feed width tokens each, at the next rung: the step compiles and is
    recorded on the rung's spare rows (tokens 0 in the spare cache row from position 0), and each
    replay reads the rows' own tokens, cache rows and positions."""
    seen = []
    step = Step()
    graphs = StepGraphs(lambda *inputs: seen.append([t.tolist() for t in inputs[:3]]) or step(*inputs), 4, SPARE,
                        torch.device("cpu"), record=True, after_compiling=lambda: True, width=3)
    output = graphs.run(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), [2, 0, 5], [10, 20, 30], "sampled")
    assert output.tolist() == [[3001, 3002, 3003], [2004, 2005, 2006], [8007, 8008, 8009]]
    # compiled and recorded on spare rows alone (writing the spare cache row only), replayed on the step's
    assert seen == [[[[0, 0, 0]] * 4, [SPARE] * 4, [0] * 4]] * 3
    again = graphs.run(torch.tensor([[1, 1, 1]]), [4], [2], "sampled")  # rung 1
    assert again.tolist() == [[4201, 4201, 4201]]
    replayed = graphs.run(torch.tensor([[0, 0, 1], [0, 0, 2]]), [1, 3], [0, 0], "sampled")  # rung 2 ...
    replayed_again = graphs.run(torch.tensor([[5, 5, 5], [6, 6, 6]]), [1, 3], [1, 1], "sampled")  # ... replayed
    assert replayed.tolist() == [[1000, 1000, 1001], [3000, 3000, 3002]]
    assert replayed_again.tolist() == [[1105, 1105, 1105], [3106, 3106, 3106]]
    assert len(step.calls) == 9  # three rungs compiled and recorded once each


def test_where_compiling_failed_no_graph_is_recorded_and_steps_run_as_they_are(fake_cuda):
    step = Step()
    graphs = StepGraphs(step, 8, SPARE, torch.device("cpu"), record=True, after_compiling=lambda: False)
    output = graphs.run(torch.tensor([[1], [2]]), [0, 1], [3, 4], "sampled")
    assert output.tolist() == [[301], [1402]]
    assert step.calls == [(2, False), (2, False), (2, False)]  # two warm-ups, then this step itself: no capture
    assert not graphs.graphs
    graphs.prepare(("greedy", "sampled"))  # the warm-up of every rung stops at the first failure
    assert not graphs.graphs and step.calls[-1] == (8, False)


def test_more_rows_than_the_largest_rung_run_in_steps_of_it(fake_cuda):
    step = Step()
    graphs = StepGraphs(step, 2, SPARE, torch.device("cpu"), record=True, after_compiling=lambda: True, width=2)
    output = graphs.run(torch.tensor([[1, 2], [3, 4], [5, 6]]), [0, 1, 2], [10, 20, 30], "greedy")
    assert output.tolist() == [[1001, 1002], [3003, 3004], [5005, 5006]]
    assert [rows for rows, recording in step.calls if recording] == [2, 1]  # rungs 2 and 1 recorded


def test_warming_up_records_every_rung_largest_first_writing_the_spare_row_only(fake_cuda):
    step = Step()
    graphs = StepGraphs(step, 4, SPARE, torch.device("cpu"), record=True, after_compiling=lambda: True)
    graphs.inputs[4][:2, 1] = torch.tensor([3, 1])  # what an earlier step left there (cache rows)
    graphs.prepare(("greedy",))
    assert list(graphs.graphs) == [(4, "greedy"), (2, "greedy"), (1, "greedy")]
    assert graphs.inputs[4][:2, 1].tolist() == [3, 1]  # given back after the warm-up's spare rows
