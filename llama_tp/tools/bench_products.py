"""The products of one transformer layer on a GPU, timed by row count for each way llama_tp
multiplies there: bf16 through cuBLAS; int8 read as it is stored (grouped_product, compiled) and
converted back for cuBLAS; int4 through torch's tinygemm and converted back for cuBLAS. Where
the ways cross sets int8.GPU_SUMMED_MAX_ROWS and tinygemm.MAX_ROWS.

    python -m llama_tp.tools.bench_products --shape llama2-7b --rows 1,2,4,8,16,32,64,128

Random weights in the shape of a published model (tools/random_checkpoint.py's SHAPES), several
copies of the layer so that they come from memory, not the GPU's L2 cache: microseconds a layer
(wqkv, wo, w13 and w2 together), medians of --repeats timings.
"""

import statistics
from typing import Callable

import torch
import torch.nn.functional as F

from ..args import ModelArgs
from ..kernels import int4, int8, tinygemm
from .cli import run
from .random_checkpoint import SHAPES

# Bytes of weights timed at a time, well past any GPU's L2 cache (50-60 MB on an H100 or H200).
STREAMED_BYTES = 1 << 30


def layer_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """[out, in] of each linear layer of one transformer layer, as the model fuses them."""
    kv_dim = args.kv_heads * args.head_dim
    return {"wqkv": (args.dim + 2 * kv_dim, args.dim), "wo": (args.dim, args.dim),
            "w13": (2 * args.ffn_hidden_dim, args.dim), "w2": (args.dim, args.ffn_hidden_dim)}


# Products read as stored convert each weight back once per row: past this many rows they are not timed.
SUMMED_ROWS_TIMED = 16


def ways(weights: list[torch.Tensor]) -> dict[str, tuple[Callable, list[tuple]]]:
    """Each way of multiplying: (x, *operands) -> product, and the operands of every weight."""
    summed, converted = torch.compile(int8.grouped_product, dynamic=False), torch.compile(int8.dequantize, dynamic=False)
    unpacked = torch.compile(tinygemm.dequantize, dynamic=False)
    as_int8 = [int8.quantize_int8(weight) for weight in weights]
    as_int4 = [tinygemm.pack(*int4.quantize_int4(weight)) for weight in weights]
    return {
        "bf16": (F.linear, [(weight,) for weight in weights]),
        "int8 read as stored": (summed, as_int8),
        "int8 converted back": (lambda x, *grid: F.linear(x, converted(*grid, x.dtype)), as_int8),
        "int4 tinygemm": (tinygemm.product, as_int4),
        "int4 converted back": (lambda x, *packed: F.linear(x, unpacked(*packed, x.dtype)), as_int4),
    }


def time_layer(multiply: Callable, operands: list[tuple], inputs: list[torch.Tensor], copies: int,
               repeats: int) -> float:
    """Microseconds for multiplying one layer's weights (of `copies` streamed in turn), each by
    its input: the median of `repeats` timings."""

    def once() -> None:
        for x, weight_operands in zip(inputs, operands, strict=True):
            multiply(x, *weight_operands)

    once()  # compiles
    timings = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        end.synchronize()
        timings.append(1000 * start.elapsed_time(end) / copies)
    return statistics.median(timings)


def main(shape: str = "llama2-7b", rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128), repeats: int = 5):
    """Print microseconds a layer's products take, by row count and way, on this machine's GPU.

    Args:
        shape: one of tools/random_checkpoint.py's SHAPES.
        rows: the row counts to time.
        repeats: timings per row count and way (the median is printed).
    """
    if shape not in SHAPES:
        raise ValueError(f"--shape {shape!r} is not one of {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        raise ValueError("bench_products times GPU kernels and CUDA sees no GPU; run it on a machine with one")
    if repeats < 1 or not rows or min(rows) < 1:
        raise ValueError(f"need repeats >= 1 and rows >= 1, found repeats={repeats}, rows={rows}")
    shapes = layer_shapes(ModelArgs.from_dict(SHAPES[shape]))
    torch._dynamo.config.recompile_limit = len(shapes) * len(rows)  # grouped_product: each shape and row count
    device = torch.device("cuda")
    layer_bytes = 2 * sum(out * width for out, width in shapes.values())
    copies = max(1, STREAMED_BYTES // layer_bytes)
    generator = torch.Generator(device).manual_seed(0)
    weights = [torch.randn(out, width, device=device, generator=generator, dtype=torch.bfloat16) / width ** 0.5
               for _ in range(copies) for out, width in shapes.values()]
    widths = [weight.shape[1] for weight in weights]
    by_way = ways(weights)
    del weights
    print(f"{shape}: microseconds for one layer's products ({', '.join(shapes)}), {copies} copies streamed, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| rows | " + " | ".join(by_way) + " |")
    print("| --- " * (len(by_way) + 1) + "|")
    for count in rows:
        by_width = {width: torch.randn(count, width, device=device, dtype=torch.bfloat16) for width in set(widths)}
        inputs = [by_width[width] for width in widths]
        timings = [time_layer(multiply, operands, inputs, copies, repeats)
                   if way != "int8 read as stored" or count <= SUMMED_ROWS_TIMED else None
                   for way, (multiply, operands) in by_way.items()]
        print(f"| {count} | " + " | ".join("-" if timing is None else f"{timing:.1f}" for timing in timings) + " |",
              flush=True)


if __name__ == "__main__":
    run(main)
