"""int8 quantization of the linear layers, per output channel, applied at load time.

Each weight row becomes int8 values and one scale (the row's largest magnitude / 127).
- "int8": weight-only. Activations stay in the compute dtype, so the only error is the rounding
  of the weights; the product converts the int8 weight on the fly, which on CPU is about half as
  fast as fp32 (PyTorch has no fast weight-only int8 CPU kernel: _weight_int8pack_mm measured 3x
  slower still). It saves memory, not time, there. Portable: any device and dtype.
- "int8_dynamic": the same weights, multiplied by fbgemm's int8 kernel, which also rounds each
  input row to int8 on the fly (dynamic quantization). On the demo model and this machine's CPU,
  1.5x transformers' fp32 decoding at batch 1 and 2.2x at batch 8; less accurate (greedy answers
  drift from fp32's sooner than int8's do). CPU and fp32 only.
"""

import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import parallel
from .sharding import COLUMN_PARALLEL, ROW_PARALLEL

QUANTIZATIONS = ("int8", "int8_dynamic")


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.communicate(torch.ops.quantized.linear_dynamic(x, self.packed))
        # Scaling the product, not the weight, keeps the per-call temporary at the int8 -> dtype copy.
        return self.communicate(F.linear(x, self.weight.to(x.dtype)) * self.scales)


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
    linear_names = set(COLUMN_PARALLEL + ROW_PARALLEL)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in linear_names:
                setattr(module, name, Int8Linear(child, dynamic=quantize == "int8_dynamic"))  # the full-precision weight is freed here
    return model
