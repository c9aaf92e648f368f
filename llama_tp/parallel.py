"""The one place that knows about processes: backend, device, process groups, parallel layers.

Everything else asks this module; nothing else imports torch.distributed or reads the
torchrun environment. NCCL and `cuda:LOCAL_RANK` when CUDA is present, gloo and CPU otherwise.
"""

import contextlib
import io
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Literal, Optional

import torch
import torch.distributed as dist
from fairscale.nn.model_parallel import initialize as fairscale_mp
from fairscale.nn.model_parallel import layers as fairscale_layers
from fairscale.nn.model_parallel import mappings as fairscale_mappings

# Llama 2 checkpoints split the token embedding along the model dimension (fairscale's
# ParallelEmbedding), Llama 3 along the vocabulary (VocabParallelEmbedding).
EmbeddingLayout = Literal["dim", "vocab"]

COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("LLAMA_TP_TIMEOUT", 300)))


@dataclass(frozen=True)
class Placement:
    """Where this process sits: its rank among the model-parallel processes and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def accelerator_available() -> bool:
    return torch.cuda.is_available()


def device_for(local_rank: int) -> torch.device:
    if accelerator_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def resolve_dtype(dtype: "str | torch.dtype | None", device: torch.device) -> torch.dtype:
    """The compute dtype: as asked, else bf16 on GPUs that have it, fp16 on other GPUs, and fp32
    on CPU, where bf16 matrix-vector products are about 3x slower."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def init(model_parallel_size: Optional[int] = None) -> Placement:
    """Join (or start) the process group and fairscale's model-parallel group; idempotent."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if model_parallel_size is None:
        model_parallel_size = world_size
    if model_parallel_size != world_size:
        raise ValueError(
            f"model_parallel_size {model_parallel_size} differs from the world size {world_size}; "
            f"every process holds one model slice, so run with --nproc_per_node "
            f"{model_parallel_size} or leave model_parallel_size unset"
        )
    device = device_for(local_rank)
    if accelerator_available():
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if accelerator_available() else "gloo"
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
        else:
            # A plain `python` run: a one-process group needs no network rendezvous.
            store = tempfile.NamedTemporaryFile(prefix="llama_tp_rendezvous_", delete=False).name
            os.unlink(store)
            dist.init_process_group(
                backend, init_method=f"file://{store}", rank=0, world_size=1,
                timeout=COLLECTIVE_TIMEOUT,
            )
    if not fairscale_mp.model_parallel_is_initialized():
        with _quiet():
            fairscale_mp.initialize_model_parallel(model_parallel_size)
    return Placement(rank, world_size, local_rank, device)


def global_rank() -> int:
    """This process's rank in the job, before or after the process group exists."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def print0(*args: Any, **kwargs: Any) -> None:
    """print on global rank 0 only, so a job's output appears once."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def model_parallel_rank() -> int:
    return fairscale_mp.get_model_parallel_rank()


def model_parallel_size() -> int:
    return fairscale_mp.get_model_parallel_world_size()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank src's value of obj, on every rank (for decisions only rank 0 can make)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def column_parallel_linear(in_features: int, out_features: int, gather_output: bool) -> torch.nn.Module:
    """y = x W^T with W split by output rows; each rank computes its slice of y."""
    with _skip_weight_init():
        return fairscale_layers.ColumnParallelLinear(
            in_features, out_features, bias=False, gather_output=gather_output, init_method=_keep
        )


def row_parallel_linear(in_features: int, out_features: int) -> torch.nn.Module:
    """y = x W^T with W split by input columns; partial products are summed across ranks."""
    with _skip_weight_init():
        return fairscale_layers.RowParallelLinear(
            in_features, out_features, bias=False, input_is_parallel=True, init_method=_keep
        )


def parallel_embedding(vocab_size: int, dim: int, layout: EmbeddingLayout) -> torch.nn.Module:
    with _skip_weight_init():
        if layout == "dim":
            return fairscale_layers.ParallelEmbedding(vocab_size, dim, init_method=_keep)
        return fairscale_layers.VocabParallelEmbedding(vocab_size, dim, init_method=_keep)


def _keep(weight: torch.Tensor) -> torch.Tensor:
    return weight


@contextmanager
def _skip_weight_init() -> Iterator[None]:
    """Build fairscale layers without initialising their weights.

    Above one process fairscale builds a full-size master weight on every rank and copies this
    rank's slice out of it: pure waste (and the whole model in memory) when real weights are
    loaded right after. Left untouched, the freshly allocated weights cost no resident memory.
    """
    original = fairscale_layers._initialize_affine_weight
    fairscale_layers._initialize_affine_weight = lambda *args, **kwargs: None
    try:
        yield
    finally:
        fairscale_layers._initialize_affine_weight = original


@contextmanager
def _quiet() -> Iterator[None]:
    """fairscale prints three lines per rank on initialisation; keep job output to rank 0."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def communication_after(layer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a parallel linear layer does with its local product in inference: all-reduce (row
    parallel), all-gather (column parallel gathering its output) or nothing; for layers that
    replace one's matrix product (quantized weights) but must talk to the other ranks the same way."""
    if isinstance(layer, fairscale_layers.RowParallelLinear):
        return fairscale_mappings.reduce_from_model_parallel_region
    if isinstance(layer, fairscale_layers.ColumnParallelLinear):
        return fairscale_mappings.gather_from_model_parallel_region if layer.gather_output else _keep
    raise TypeError(f"{type(layer).__name__} is not one of fairscale's parallel linear layers")
