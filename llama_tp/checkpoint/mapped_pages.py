"""Giving back this process's pages of a memory-mapped checkpoint tensor once it has been copied.

Through madvise on Linux; nothing elsewhere.
"""

import ctypes
import ctypes.util
import mmap
import platform
from typing import Optional

import torch

_MADV_DONTNEED = 4


def release(tensor: torch.Tensor) -> None:
    """Drop a memory-mapped checkpoint tensor's pages from this process once it has been copied.

    Otherwise each touched page of the mapped shard stays resident beside its copy until loading
    ends (splitting one big shard along dimension 1 touches nearly all of it). The mapping is
    private and never written, so a later read simply pages the data in from the file again: the
    tensor stays valid. (A source that is not mapped, a piece assembled from several shards, is a
    copy nobody reads again: its pages are simply given back early.) Whole pages inside the
    tensor only, so that a neighbour's data is never touched.
    """
    if _libc is None or tensor.device.type != "cpu":
        return
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def _load_libc() -> Optional[ctypes.CDLL]:
    if platform.system() != "Linux":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


_libc = _load_libc()
