"""World sizes side by side: the benchmark as torchrun jobs of each world size, taking turns.

    python -m llama_tp.tools.bench.world_sizes --ckpt_dir CKPT --world_sizes 1,2 --rounds 3 --batch_sizes 1

Each round runs `python -m llama_tp.bench` once per world size, in the order given, so that a
shared machine's drifting speed falls on every world size alike. World size 1 keeps torch's
threads; above 1, torchrun gives each process one thread (unless OMP_NUM_THREADS says
otherwise), so every world size uses the same cores. Other options (--batch_sizes, --compile,
--quantize, --new_tokens, ...) go to the benchmark as they are. Prints each case's median tokens
per second per world size and its ratio to the first world size, and writes them as JSON.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from ..cli import run
from . import speed


def bench_command(world_size: int, json_path: Path, ckpt_dir: Optional[str], bench_options: dict) -> list[str]:
    """The torchrun command line of one benchmark job, without the load comparison (world size 1 only)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size),
               "-m", "llama_tp.bench", "--load_repeats", "0", "--json_path", str(json_path)]
    if ckpt_dir is not None:
        command += ["--ckpt_dir", ckpt_dir]
    for name, value in bench_options.items():
        if isinstance(value, bool):
            command.append(f"--{name}" if value else f"--no{name}")
        else:
            text = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
            command += [f"--{name}", text]
    return command


def run_bench(world_size: int, ckpt_dir: Optional[str], bench_options: dict) -> dict[str, float]:
    """Tokens per second of each case of one benchmark job at world_size."""
    with tempfile.TemporaryDirectory() as folder:
        json_path = Path(folder) / "bench.json"
        environment = {name: value for name, value in os.environ.items() if name not in ("RANK", "WORLD_SIZE")}
        result = subprocess.run(bench_command(world_size, json_path, ckpt_dir, bench_options),
                                env=environment, capture_output=True, text=True)
        if result.returncode != 0:
            # A user mistake (a model that does not split this way, a missing folder) is one line per rank.
            mistakes = [line for line in result.stderr.splitlines() if line.startswith("llama_tp error")]
            if mistakes:
                raise ValueError(f"the benchmark at world size {world_size} failed: {mistakes[0]}")
            raise RuntimeError(f"the benchmark at world size {world_size} exited {result.returncode}:\n"
                               f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
        cases = json.loads(json_path.read_text())["cases"]
    return {case: figures["tokens_per_s"]["llama_tp"] for case, figures in cases.items()}


def compare(runs: dict[int, list[dict[str, float]]]) -> dict[str, dict]:
    """Per case: each world size's runs and median, and each median's ratio to the first world size's."""
    first = next(iter(runs))
    summary = {}
    for case in runs[first][0]:
        medians = {size: statistics.median(r[case] for r in size_runs) for size, size_runs in runs.items()}
        summary[case] = {
            "tokens_per_s": medians,
            "ratio_vs_first": {size: median / medians[first] for size, median in medians.items()},
            "runs": {size: [r[case] for r in size_runs] for size, size_runs in runs.items()},
        }
    return summary


def print_table(summary: dict[str, dict], world_sizes: tuple[int, ...]) -> None:
    first = world_sizes[0]
    header = "".join(f"{f'ws{size} tok/s':>13}" for size in world_sizes)
    ratios = "".join(f"{f'ws{size}/ws{first}':>10}" for size in world_sizes[1:])
    print(f"{'case':<18}{header}{ratios}")
    for case, figures in summary.items():
        speeds = "".join(f"{figures['tokens_per_s'][size]:>13.1f}" for size in world_sizes)
        shares = "".join(f"{figures['ratio_vs_first'][size]:>10.2f}" for size in world_sizes[1:])
        print(f"{case:<18}{speeds}{shares}")


def main(ckpt_dir: Optional[str] = None, world_sizes: tuple[int, ...] = (1, 2), rounds: int = 3,
         json_path: str = "bench_world_sizes.json", **bench_options):
    """Run the benchmark at each world size, alternating, `rounds` times; medians and ratios.

    Args:
        ckpt_dir: Meta-layout checkpoint folder that splits over every world size; default: the
            demo model (which splits over 1 and 3 processes only).
        world_sizes: processes per job, compared with the first.
        rounds: jobs per world size (each job reports its own medians of --repeats runs).
        json_path: where to write the results.
        bench_options: passed on to python -m llama_tp.bench (not --json_path or --load_repeats).
    """
    world_sizes = (world_sizes,) if isinstance(world_sizes, int) else tuple(world_sizes)
    if rounds < 1 or not world_sizes or min(world_sizes) < 1:
        raise ValueError(f"need rounds >= 1 and world sizes >= 1, found rounds={rounds}, world_sizes={world_sizes}")
    reserved = {"json_path", "load_repeats", "compare"} & set(bench_options)
    if reserved:
        raise ValueError(f"--{', --'.join(sorted(reserved))} cannot be passed on: each job writes its own JSON, "
                         "loads once and compares world sizes only")
    runs: dict[int, list[dict[str, float]]] = {size: [] for size in world_sizes}
    for round_index in range(rounds):
        for size in world_sizes:
            print(f"round {round_index + 1}/{rounds}: world size {size}", flush=True)
            runs[size].append(run_bench(size, ckpt_dir, bench_options))
    summary = compare(runs)
    Path(json_path).write_text(json.dumps({"world_sizes": list(world_sizes), "rounds": rounds,
                                           "bench_options": bench_options, "cases": summary}, indent=2))
    print_table(summary, world_sizes)
    print(f"wrote {json_path}")


if __name__ == "__main__":
    run(main, passes_on=speed.main)
