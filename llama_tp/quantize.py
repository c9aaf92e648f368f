"""int8 quantization of the linear layers, per output channel, applied at load time.

Each weight row becomes int8 values and one scale (the row's largest magnitude / 127).
- "int8": weight-only. The only error is the rounding of the weights.
  - On CPU, decoding steps multiply in integer arithmetic (int8_product, torch._int_mm), reading
    a quarter of fp32's bytes. The activations go in as two int8 terms, so they keep about 15
    bits and the greedy answers are those of the dequantized weights. Demo model on this
    project's machine: 2.4x transformers' fp32 at batch 1 eagerly, 3x compiled.
  - Prompts, and every product off CPU, convert the int8 weight to the activations' dtype on
    the fly (on CPU then multiplied through oneDNN, see matmul.py): that saves memory, not time.
- "int8_dynamic": the same weights, multiplied by fbgemm's int8 kernel, which rounds each input
  row to a single int8 term on the fly (dynamic quantization): 4.4x transformers' fp32 at batch
  1, but its greedy answers drift from fp32's sooner than int8's do. CPU and fp32 only.
"""

import warnings
from typing import Optional

import torch
from torch import nn

from . import matmul, parallel
from .model import LINEAR_LAYERS

QUANTIZATIONS = ("int8", "int8_dynamic")

# Decoding multiplies a few rows by each weight and is bound by reading it: there int8_product
# wins. A prompt's hundreds of rows are bound by arithmetic, where splitting the activations costs
# more than converting the weight once per product (measured: 2.5x slower at 512 rows, equal at 16).
INTEGER_PRODUCT_MAX_ROWS = 16


def check_quantize(quantize: Optional[str]) -> None:
    """Refuse an unknown quantization before any work is done."""
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(
            f"quantize={quantize!r} is not supported; use one of {', '.join(QUANTIZATIONS)} or leave it unset"
        )


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: weight [out, in] ~= q [out, in] * scales [out, 1]; scales in fp32."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
    q = torch.round(weight / scales).clamp(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    """A parallel linear layer holding its slice of the weight as int8 rows and per-row scales.

    It talks to the other ranks exactly as the layer it replaces did.
    """

    def __init__(self, layer: nn.Module, dynamic: bool):
        super().__init__()
        q, scales = quantize_int8(layer.weight.detach())
        dtype = layer.weight.dtype
        if dynamic and (dtype != torch.float32 or q.device.type != "cpu"):
            raise ValueError(
                f"quantize='int8_dynamic' runs fbgemm's CPU kernel on fp32 activations, not {dtype} on "
                f"{q.device.type}; use quantize='int8' there"
            )
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales.reshape(-1).to(dtype))  # out: one per output channel
        self.communicate = parallel.communication_after(layer)
        self.packed = _fbgemm_pack(q, scales) if dynamic else None
        # torch._int_mm takes any shape on CPU; on CUDA it wants more than 16 rows, which decoding lacks.
        self.integer_product = q.device.type == "cpu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.communicate(torch.ops.quantized.linear_dynamic(x, self.packed))
        if self.integer_product and x.shape[:-1].numel() <= INTEGER_PRODUCT_MAX_ROWS:
            return self.communicate(int8_product(x, self.weight, self.scales))
        # Scaling the product, not the weight, keeps the per-call temporary at the int8 -> dtype copy.
        return self.communicate(matmul.linear(x, self.weight.to(x.dtype)) * self.scales)


# The low term's scale: |exact - high| <= 1/2, so low stays within int8 without a clamp.
LOW_TERM_SCALE = 254


def int8_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., in] times the weight q [out, in] * scales [out], in int8 with int32 sums.

    Each row of x is written as step * (high + low / 254) with int8 high and low: low holds
    high's rounding error, so the activations keep about 15 bits instead of int8's 8. Both terms
    go through one product, as rows of one matrix: a decoding step's few rows cost no more than one.
    The int32 sums (127 * 127 per input at most) cannot overflow below 133,000 inputs, more than
    any Llama layer has. Written in few, in-place operations: each costs microseconds per call.
    """
    rows = x.reshape(-1, x.shape[-1]).float()
    step = torch.linalg.vector_norm(rows, ord=float("inf"), dim=-1, keepdim=True)
    step = step.clamp_(min=torch.finfo(torch.float32).tiny).div_(127)  # rows, 1
    exact = rows / step  # in [-127, 127]
    high = exact.round()
    low = exact.sub_(high).mul_(LOW_TERM_SCALE).round_()
    sums = torch._int_mm(torch.cat([high, low]).to(torch.int8), q.t()).float()  # 2 * rows, out
    n = rows.shape[0]
    product = torch.add(sums[:n], sums[n:], alpha=1 / LOW_TERM_SCALE).mul_(step).mul_(scales)
    return product.view(*x.shape[:-1], -1).type_as(x)


def _fbgemm_pack(q: torch.Tensor, scales: torch.Tensor) -> object:
    """q and its row scales in fbgemm's packed layout (an opaque handle) for linear_dynamic."""
    channels = scales.shape[0]
    with warnings.catch_warnings():  # quantized tensors are deprecated, but this kernel only takes them
        warnings.simplefilter("ignore")
        qweight = torch._make_per_channel_quantized_tensor(
            q, scales.reshape(-1).double(), torch.zeros(channels, dtype=torch.long), axis=0
        )
        return torch.ops.quantized.linear_prepack(qweight, None)


def quantize_model(model: nn.Module, quantize: Optional[str]) -> nn.Module:
    """Replace every linear layer of the model (attention, feed-forward, output) in place."""
    check_quantize(quantize)
    if quantize is None:
        return model
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in LINEAR_LAYERS:
                setattr(module, name, Int8Linear(child, dynamic=quantize == "int8_dynamic"))  # the full-precision weight is freed here
    return model
