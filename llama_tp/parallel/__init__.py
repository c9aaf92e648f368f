"""The one place that knows about processes: backend, device, process groups, parallel layers.

Everything else asks this package; nothing outside it imports torch.distributed or reads the
torchrun environment. NCCL and this process's GPU when CUDA is present (group.device_for), gloo
and CPU otherwise or with LLAMA_TP_DEVICE=cpu (gloo on GPUs with LLAMA_TP_BACKEND=gloo); host
objects always travel over gloo.

`group`: this process's place, device, dtype and process groups; `failures`: failing and leaving
together; `watchdog`: ending a GPU rank whose job lost a rank where no timeout would; `layers`:
fairscale's parallel layers; `collectives`: their sums and gathers, through `shared_memory`
between the ranks of one host.
"""

from .collectives import all_gather_last_dim, all_reduce, from_first_rank, native_sum_arguments, vocab_argmax
from .failures import (
    agreement,
    check_same_on_every_rank,
    describe_peer_failure,
    is_peer_failure,
    leave,
)
from .group import (
    DTYPES,
    Placement,
    broadcast_object,
    check_int4_device,
    collective_timeout,
    decode_compilation,
    gather_objects,
    gather_objects_if_any,
    global_rank,
    host_group,
    init,
    model_parallel_rank,
    model_parallel_size,
    print0,
    require_cxx_compiler,
    resolve_dtype,
    steps_run_whole,
)
from .layers import EmbeddingLayout, column_parallel_linear, communication_after, parallel_embedding, row_parallel_linear
from .watchdog import report_failure

__all__ = [
    "DTYPES",
    "EmbeddingLayout",
    "Placement",
    "agreement",
    "all_gather_last_dim",
    "all_reduce",
    "broadcast_object",
    "check_int4_device",
    "check_same_on_every_rank",
    "collective_timeout",
    "column_parallel_linear",
    "communication_after",
    "decode_compilation",
    "describe_peer_failure",
    "from_first_rank",
    "gather_objects",
    "gather_objects_if_any",
    "global_rank",
    "host_group",
    "init",
    "is_peer_failure",
    "leave",
    "model_parallel_rank",
    "model_parallel_size",
    "native_sum_arguments",
    "parallel_embedding",
    "print0",
    "report_failure",
    "require_cxx_compiler",
    "resolve_dtype",
    "row_parallel_linear",
    "steps_run_whole",
    "vocab_argmax",
]
