"""Counting what a piece of code allocates on one device, through a TorchDispatchMode: shared by
test_load_peak.py (the loader on the meta device, standing in for a GPU) and tests/gpu."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class DeviceAllocations(TorchDispatchMode):
    """Every byte of new storage that operators create on `device` while the mode is on.

    The running total bounds the peak from above (nothing freed is subtracted), so a total within
    a limit proves the peak within it. Operators whose results alias their inputs (views, in-place
    writes) create no storage and are not counted."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(returned.alias_info is not None for returned in func._schema.returns):
            self.total += sum(leaf.untyped_storage().nbytes() for leaf in tree_leaves(out)
                              if isinstance(leaf, torch.Tensor) and leaf.device == self.device)
        return out


def held_bytes(module: torch.nn.Module) -> int:
    """The bytes of a module's weights and buffers."""
    return sum(tensor.numel() * tensor.element_size() for tensor in module.state_dict().values())
