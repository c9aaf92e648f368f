"""The linear layers' matrix products, through the fastest kernel the device offers.

Decoding multiplies a few rows at a time, so reading the weight is the cost. On CPUs with AVX-512
our own kernel (cpu_kernels.cpp) reads fp32 weights at about the speed of a plain copy: streamed
through the demo model's layers it took 19.4 ms for one row on this project's Intel Xeon machine
(MKL 21.2) and 20.5 on its AMD EPYC (Zen 4) machine (oneDNN on packed weights 27.7, MKL 49.6).
CPUs with AVX2 alone have its counterpart (avx2_float_product.cpp). So there products of up to
KERNEL_MAX_ROWS rows by an fp32 weight go to our kernel, and weights stay plain, which also makes
loading twice as fast. Prompts go to MKL on Intel CPUs (within about 10% of oneDNN's packed kernel
there, and as transformers does) and to oneDNN on the plain weight elsewhere (on the AMD machine
15-20% faster than MKL for 128-512 rows, and 2-16% slower than on a packed weight).

Without our kernel, on CPU the loader packs each linear layer's weight once into oneDNN's blocked
layout, and `linear` sends CPU products there: on the AMD EPYC machine of this project until
2026-11-22 it read weights at 25-39 GB/s for 1-8 rows, where MKL read 15, and multiplied a
512-row prompt twice as fast. Two exceptions: compiled, inductor writes one-row products itself
(see SUMMED_MAX_ROWS), and on Intel CPUs MKL's fast paths read 1-3 rows faster than oneDNN
(MKL_MAX_ROWS), so models built for so few rows keep plain weights.
"""

import torch
import torch.nn.functional as F

from . import cpu_kernels

# oneDNN lays a weight out for an expected number of rows; 8 measured fastest for decoding at
# batch 1 and 8 alike, and costs prompts nothing.
PACKING_ROWS = 8


# Asked once: decoding calls `linear` hundreds of times per token. oneDNN's bf16 products need
# AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere it refuses to lay out a bf16 weight at all.
_ONEDNN = torch.backends.mkldnn.is_available()
_ONEDNN_BF16 = _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# Under torch.compile, a product of at most this many rows by a plain (unpacked) weight is written
# as a sum over the input dimension, which inductor compiles into one pass over the weight fused
# with the operations around it. Per product on this project's CPU, with the demo model's shapes,
# one row is 15-30% faster than oneDNN on a packed weight. So would two be, alone; but in a
# decoding step whose batch size is symbolic (torch.compile specialises only sizes 0 and 1),
# inductor's loops for a 4-row layer ran 20x slower than oneDNN's kernel.
SUMMED_MAX_ROWS = 1


def _intel_cpu() -> bool:
    """Whether this is an Intel CPU, from Linux's /proc/cpuinfo (elsewhere: not known, so no)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.split(":")[-1].strip() == "GenuineIntel" for line in cpuinfo if line.startswith("vendor_id"))
    except OSError:
        return False


# Asked once, as _ONEDNN is.
_INTEL = _intel_cpu()

# Products of up to this many rows go to MKL (F.linear on plain weights), eager and compiled alike.
MKL_MAX_ROWS = 3 if _INTEL else 0

# Whether fp32 products of few rows go to our kernel here: wherever it runs. With AVX-512 on the
# Intel machine it took 24.3 ms for 8 rows (oneDNN on packed weights 33.1, MKL 49), 36 for 16
# (MKL 51, oneDNN packed 41) and 55 for 32 (MKL 60); on the AMD one 20.9 for 8 (oneDNN packed
# 31.8), 31.2 for 16 (35.4) and 55.8 for 32 (56.9). At 48 rows MKL is faster (69 against 76 on
# Intel). With AVX2 alone (avx2_float_product.cpp; AMD EPYC, 2 threads) 26 ms for one row (oneDNN
# packed 34-38), 44-50 for 16 (65-69), 116 for 48 (122), 157 for 64 and 192 for 80 (oneDNN on the
# plain weight, which prompts then take, 180 and 200; at 96 rows it is faster, 207 against 240).
FLOAT_KERNEL = cpu_kernels.decoding_kernels_run_on(torch.device("cpu"))
KERNEL_MAX_ROWS = 32 if cpu_kernels.ON_THIS_CPU else 80


def kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decoding products by weights of this dtype on this device go to our kernel (FLOAT_KERNEL)."""
    return FLOAT_KERNEL and device.type == "cpu" and dtype == torch.float32


def packable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies weights of this dtype on this device: CPU builds with oneDNN, fp32,
    or bf16 where the CPU has oneDNN's bf16 instructions."""
    return device.type == "cpu" and (_ONEDNN and dtype == torch.float32 or _ONEDNN_BF16 and dtype == torch.bfloat16)


def packing_pays(max_rows: int, compiled: bool, dtype: torch.dtype) -> bool:
    """Whether packing CPU weights of this dtype pays for products of up to max_rows rows (a
    decoding batch): not where our kernel takes them (kernel_runs), nor where MKL is faster
    (MKL_MAX_ROWS), nor, compiled, where the compiler's summed product is; else yes, where
    oneDNN takes the dtype (packable)."""
    cpu = torch.device("cpu")
    if not packable(cpu, dtype) or kernel_runs(cpu, dtype) or max_rows <= MKL_MAX_ROWS:
        return False
    return not compiled or max_rows > SUMMED_MAX_ROWS


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in oneDNN's blocked layout: an opaque tensor that only `linear` reads."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """x [..., in] times weight [out, in] transposed.

    packed: whether weight is in oneDNN's layout, which torch.compile cannot tell from the tensor.
    """
    if not packed and not weight.is_mkldnn and kernel_runs(x.device, weight.dtype):
        if x.shape[:-1].numel() <= KERNEL_MAX_ROWS and weight.is_contiguous():  # decoding
            return cpu_kernels.float_product(x, weight)
        if _INTEL:
            return F.linear(x, weight)  # prompts: MKL, as transformers does; elsewhere oneDNN's, below
    if torch.compiler.is_compiling() and x.device.type == "cpu":
        if not packed and x.shape[:-1].numel() <= SUMMED_MAX_ROWS:
            return F.linear(x, weight) if MKL_MAX_ROWS else _summed_product(x, weight)
        # Opaque to torch.compile, which sees a packed weight as a plain one and would rewrite
        # the product into a kernel that cannot read oneDNN's layout.
        return torch.ops.llama_tp.cpu_linear(x, weight)
    if weight.is_mkldnn or (packable(weight.device, weight.dtype) and not _for_mkl(x)):
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def _for_mkl(x: torch.Tensor) -> bool:
    """Whether x has so few rows that MKL multiplies them fastest (MKL_MAX_ROWS)."""
    return x.shape[:-1].numel() <= MKL_MAX_ROWS


def _summed_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear's product as elementwise products summed over the input dimension, for inductor.

    Weight rows outermost: the compiled loop reads each row once, for all of x's rows.
    """
    rows = x.reshape(-1, x.shape[-1])  # rows, in
    sums = (weight[:, None, :] * rows[None, :, :]).sum(-1)  # out, rows
    return sums.t().reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("llama_tp::cpu_linear", mutates_args=())
def _cpu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return linear(x, weight)


@_cpu_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
