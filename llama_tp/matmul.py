"""The linear layers' matrix products, through the fastest kernel the device offers.

On CPU, `F.linear` goes to MKL's sgemm, which on this project's AMD machine reads fp32 weights at
about 15 GB/s for one row (on one thread, whatever the thread count) and slower still for 2-16.
oneDNN's inner product on a weight reordered once into its blocked layout reads them at 25-39 GB/s
for 1-8 rows and multiplies a 512-row prompt twice as fast. So on CPU the loader packs each linear
layer's weight for oneDNN, and `linear` sends every CPU product there (a plain weight too, such as
int8 converted on the fly: 1.5-2x faster than MKL); elsewhere nothing changes.
"""

import torch
import torch.nn.functional as F

# oneDNN lays a weight out for an expected number of rows; 8 measured fastest for decoding at
# batch 1 and 8 alike, and costs prompts nothing.
PACKING_ROWS = 8


# Asked once: decoding calls `linear` hundreds of times per token.
_ONEDNN = torch.backends.mkldnn.is_available()


def packable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies weights of this dtype on this device: CPU builds with oneDNN, fp32 or bf16."""
    return _ONEDNN and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in oneDNN's blocked layout: an opaque tensor that only `linear` reads."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] times weight [out, in] transposed, packed or not."""
    if torch.compiler.is_compiling() and x.device.type == "cpu":
        # Opaque to torch.compile, which sees a packed weight as a plain one and would rewrite
        # the product into a kernel that cannot read oneDNN's layout.
        return torch.ops.llama_tp.cpu_linear(x, weight)
    if weight.is_mkldnn or packable(weight.device, weight.dtype):
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


@torch.library.custom_op("llama_tp::cpu_linear", mutates_args=())
def _cpu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return linear(x, weight)


@_cpu_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
