"""Decoding steps replayed as CUDA graphs, one graph for each rung of a ladder of batch sizes.

A graph replays a whole step, embedding to logits, as one launch: no Python, no compiled
function's guards and no kernel launched one by one between the large products (on an H200 a
7B step's five compiled calls and their ~15 eager launches cost about a fifth of its 5.5 ms). A
graph replays only the shapes it was recorded with, so a step of b rows runs the graph of the
next rung up, its spare rows padding: they sit in a cache row of their own that nothing reads
(Transformer.spare_slot), from position 0. A step feeds each row the same number of tokens: one
(decoding), or a few (the verifying pass of speculation: a row's last token and its guesses), each
width its own StepGraphs. A step may also take in prompt chunks (Transformer.mixed_step): a second
part of the inputs, a fixed number of prompt rows of a fixed width, each with the count of its own
tokens, the spare ones padding as the spare rows do. Off CUDA (CPU tests) the same steps run without
graphs, padded alike, so that the rungs, the padding and what compiles are checked there.
"""

from contextlib import contextmanager
from typing import Callable, Hashable, Iterator, Optional

import torch

# (tokens, cache rows, first positions, key), then with prompt rows, their inputs.
StepFunction = Callable[..., torch.Tensor]


def ladder(max_rows: int) -> list[int]:
    """The batch sizes graphs are recorded for: 1, 2, 4, 8, ... below max_rows, and max_rows."""
    rungs = [1]
    while rungs[-1] * 2 < max_rows:
        rungs.append(rungs[-1] * 2)
    return rungs + [max_rows] if max_rows > 1 else rungs


class StepGraphs:
    """A step function of (tokens [rows, width], cache rows [rows], first positions [rows]) and a
    key (which head the step ends in), run at the next rung's size; with record=True, as a CUDA
    graph per rung and key. With prompt rows, the step also takes their inputs, and its output
    holds theirs after the rung's rows'."""

    def __init__(self, step: StepFunction, max_rows: int, spare_slot: int, device: torch.device, record: bool,
                 after_compiling: Callable[[], bool], width: int = 1, prompt_rows: int = 0, prompt_width: int = 0):
        """after_compiling: called after the step compiled for a new rung and key (before its graph is
        recorded), at the same step on every rank, where the ranks can agree on how it went: whether
        compiled steps go on. width: the tokens every row feeds. prompt_rows: rows of prompt_width
        tokens that every step takes too (none: 0)."""
        self.step, self.spare_slot, self.device, self.record = step, spare_slot, device, record
        self.after_compiling, self.width = after_compiling, width
        self.rungs = ladder(max_rows)
        # Each rung's inputs, where its graphs read them: [rung, width + 2], each row's tokens, then
        # its cache row and its first token's position.
        self.inputs = {rung: self._padding(rung).to(device) for rung in self.rungs}
        # The prompt rows' inputs, the same for every rung: [prompt_rows, prompt_width + 3], each
        # row's tokens, its cache row, its first token's position and how many of its tokens are its own.
        self.prompt_width = prompt_width
        self.prompt_inputs = self._prompt_padding(prompt_rows).to(device) if prompt_rows else None
        self.graphs: dict[tuple[int, Hashable], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if record else None

    def rung(self, rows: int) -> int:
        """The batch size a step of rows runs at."""
        for rung in self.rungs:
            if rung >= rows:
                return rung
        raise ValueError(f"a step of {rows} rows is more than the {self.rungs[-1]} the graphs take")

    def run(self, tokens: torch.Tensor, slots: list[int], positions: list[int], key: Hashable,
            prompt: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The step's output for rows fed tokens [bsz, width] (on the device or the host) from
        positions, a copy that the next step leaves alone; more rows than the largest rung, in
        steps of that many. prompt: with prompt rows, up to that many rows' inputs [rows,
        prompt_width + 3] on the host (see prompt_inputs), whose outputs follow the rows'."""
        most = self.rungs[-1]
        if len(slots) > most and prompt is None:
            return torch.cat([self.run(tokens[first : first + most], slots[first : first + most],
                                       positions[first : first + most], key) for first in range(0, len(slots), most)])
        rows, rung = len(slots), self.rung(len(slots))
        inputs = self.inputs[rung]
        pinned = self.device.type == "cuda"
        host = self._padding(rung, pinned)
        host[:rows, self.width], host[:rows, self.width + 1] = torch.tensor(slots), torch.tensor(positions)
        if tokens.device.type == "cpu":
            host[:rows, : self.width] = tokens
        inputs.copy_(host, non_blocking=True)  # one copy from pinned memory, which waits for nothing
        if tokens.device.type != "cpu":
            inputs[:rows, : self.width] = tokens
        if self.prompt_inputs is not None:
            prompt_host = self._prompt_padding(len(self.prompt_inputs), pinned)
            if prompt is not None:
                prompt_host[: len(prompt)] = prompt
            self.prompt_inputs.copy_(prompt_host, non_blocking=True)
        if not self.record:
            return self._own(self._step(inputs, key), rows, rung, prompt)
        if (rung, key) not in self.graphs:
            recorded = self._recorded(rung, key)
            if recorded is None:  # compiling failed: this step, and the next ones, eagerly
                return self._own(self._step(inputs, key), rows, rung, prompt)
            self.graphs[rung, key] = recorded
        graph, output = self.graphs[rung, key]
        graph.replay()
        return self._own(output, rows, rung, prompt)

    @staticmethod
    def _own(output: torch.Tensor, rows: int, rung: int, prompt: Optional[torch.Tensor]) -> torch.Tensor:
        """A copy of the output of a step's own rows (then its prompt rows'), without the padding's."""
        if prompt is None:
            return output[:rows].clone()
        return torch.cat((output[:rows], output[rung : rung + len(prompt)]))

    def prepare(self, keys: tuple[Hashable, ...]) -> None:
        """Compile every rung's step for each key now and, on CUDA, record its graph (largest
        first, as their memory nests), rather than in the first steps. Only the spare row is written."""
        for rung in reversed(self.rungs):
            for key in keys:
                if not self.record:
                    with self._padded(rung) as inputs:
                        self._step(inputs, key)
                    if not self.after_compiling():
                        return
                elif (rung, key) not in self.graphs:
                    recorded = self._recorded(rung, key)
                    if recorded is None:
                        return
                    self.graphs[rung, key] = recorded

    def _recorded(self, rung: int, key: Hashable) -> Optional[tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
        """A graph of the step on the rung's inputs, and the tensor it writes its output to. The
        step runs twice first, on a stream of its own as recording wants: compiling for these
        shapes and making the libraries' workspaces happen there. None where compiling failed on
        some rank (after_compiling): no graph is recorded of the eager code that ran instead
        (FlexAttention's eager code cannot even be recorded)."""
        with self._padded(rung) as inputs:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step(inputs, key)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if not self.after_compiling():
                return None
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self._step(inputs, key)
        return graph, output

    def _step(self, inputs: torch.Tensor, key: Hashable) -> torch.Tensor:
        """The step on a rung's inputs (and the prompt rows')."""
        width = self.width
        prompt = () if self.prompt_inputs is None else (self.prompt_inputs,)
        return self.step(inputs[:, :width], inputs[:, width], inputs[:, width + 1], key, *prompt)

    @contextmanager
    def _padded(self, rung: int) -> Iterator[torch.Tensor]:
        """The rung's inputs (and the prompt rows') holding spare rows only, then what they held:
        steps run on them meanwhile write the spare cache row alone."""
        inputs, prompt = self.inputs[rung], self.prompt_inputs
        held = inputs.clone(), None if prompt is None else prompt.clone()
        inputs.copy_(self._padding(rung))
        if prompt is not None:
            prompt.copy_(self._prompt_padding(len(prompt)))
        try:
            yield inputs
        finally:
            inputs.copy_(held[0])
            if prompt is not None:
                prompt.copy_(held[1])

    def _padding(self, rung: int, pinned: bool = False) -> torch.Tensor:
        """Inputs of rung spare rows: tokens 0 in the spare cache row from position 0."""
        padding = torch.zeros(rung, self.width + 2, dtype=torch.long, pin_memory=pinned)
        padding[:, self.width] = self.spare_slot
        return padding

    def _prompt_padding(self, rows: int, pinned: bool = False) -> torch.Tensor:
        """Prompt rows' inputs of spare rows: one token 0 of its own in the spare cache row from position 0."""
        padding = torch.zeros(rows, self.prompt_width + 3, dtype=torch.long, pin_memory=pinned)
        padding[:, self.prompt_width], padding[:, self.prompt_width + 2] = self.spare_slot, 1
        return padding
