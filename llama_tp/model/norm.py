"""RMSNorm, normalising in fp32 whatever the weights' dtype, as Meta's reference does."""

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 == self.weight.dtype:  # one call instead of three
            if cpu_kernels.decoding_kernels_run_on(x.device) and not torch.compiler.is_compiling():
                return cpu_kernels.rms_norm(x, self.weight, self.eps)  # one pass instead of six
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in fp32 whatever the weights' dtype, as the reference does.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return normed.type_as(x) * self.weight
