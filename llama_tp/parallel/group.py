"""This process's place in the job: the torchrun environment, backend, device and dtype, the process
groups and how long to wait for them, and printing once per job."""

import contextlib
import io
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from fairscale.nn.model_parallel import initialize as fairscale_mp

from ..kernels.cpu_kernels import cxx_compiler_found
from ..logs import set_rank as set_log_rank

# How long a rank waits for the others at process-group start-up or in any one collective before
# giving up with an error instead of hanging; generous because ranks load shards at their own pace.
DEFAULT_TIMEOUT_SECONDS = 300


def collective_timeout() -> timedelta:
    """The wait limit: LLAMA_TP_TIMEOUT seconds if set, else DEFAULT_TIMEOUT_SECONDS."""
    value = os.environ.get("LLAMA_TP_TIMEOUT", str(DEFAULT_TIMEOUT_SECONDS))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"LLAMA_TP_TIMEOUT must be a positive number of seconds, found {value!r}")
    return timedelta(seconds=seconds)


# Small host-side agreements (the farewell barrier) need gloo; beside NCCL it is a second group.
_host_groups: list[Any] = []


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


@dataclass(frozen=True)
class DecodeCompilation:
    """How torch.compile runs one-token decoding steps on a device (see Transformer.compile_decoding)."""

    options: dict[str, Any]  # torch.compile's keywords
    static_shapes: bool  # every step the same shapes: attend to the whole cache under a mask


def decode_compilation(device: torch.device) -> DecodeCompilation:
    """CUDA graphs on GPUs (they replay a step without launching its kernels one by one, but need
    the same shapes every step); on CPU, code generation for a step whose length may grow, with
    the code that calls the kernels in C++ too (cpp_wrapper): a demo-model step at batch 1 took
    24.1 ms instead of 25.1, for 4 s more of compiling when nothing is cached."""
    if device.type == "cuda":
        return DecodeCompilation({"mode": "reduce-overhead"}, static_shapes=True)
    require_cxx_compiler("compile=True on CPU", "leave compile off")
    return DecodeCompilation({"dynamic": True, "options": {"cpp_wrapper": True}}, static_shapes=False)


def check_int4_device(device: torch.device) -> None:
    """Refuse int4 layers on an accelerator up front: they multiply on CPUs only (our AVX-512 kernel,
    elsewhere the weight converted back by torch's operations), and on a GPU that would be slower
    than its own bf16 products. torch's _weight_int4pack_mm (as gpt-fast uses it) is the way there."""
    if device.type != "cpu":
        raise ValueError(
            f"quantize='int4' runs on CPUs only, not on {device}; on {device.type} leave quantize unset "
            "(bf16) or use quantize='int8' to halve the weights' memory"
        )


def require_cxx_compiler(what: str, otherwise: str) -> None:
    """Refuse `what` up front when torch.compile's CPU code generation has no C++ compiler to run."""
    if not cxx_compiler_found():
        raise ValueError(
            f"{what} needs a C++ compiler for torch.compile's generated code, and none was found "
            f"(g++, c++, clang++ or $CXX); install one (e.g. apt install g++) or {otherwise}"
        )


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
    set_log_rank(rank)
    device = device_for(local_rank)
    if accelerator_available():
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if accelerator_available() else "gloo"
        timeout = collective_timeout()
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            # A plain `python` run: a one-process group needs no network rendezvous.
            store = tempfile.NamedTemporaryFile(prefix="llama_tp_rendezvous_", delete=False).name
            os.unlink(store)
            dist.init_process_group(
                backend, init_method=f"file://{store}", rank=0, world_size=1, timeout=timeout,
            )
        if world_size > 1:
            # Made now, on every rank together: creating a group is itself a collective.
            _host_groups.append(dist.new_group(backend="gloo") if backend != "gloo" else None)
            _start_launcher_watchdog()
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


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's obj, in rank order, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _start_launcher_watchdog(poll_seconds: float = 1.0) -> None:
    """Exit if torchrun dies (e.g. killed with SIGKILL), so no rank is left behind as an orphan.

    A thread, because the main thread may be blocked inside a collective where Python runs no
    signal handlers; os._exit works from any thread.
    """
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_seconds)
        print(f"llama_tp error on rank {global_rank()}: the launcher (pid {launcher}) is gone; "
              "stopping this rank too", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="llama_tp-launcher-watchdog", daemon=True).start()


@contextmanager
def _quiet() -> Iterator[None]:
    """fairscale prints three lines per rank on initialisation; keep job output to rank 0."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield
