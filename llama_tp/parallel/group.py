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
from .watchdog import global_rank, watch_peers

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
    processes_here: int = 1  # this host's processes of the job (LOCAL_WORLD_SIZE), which share its memory

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# LLAMA_TP_DEVICE: "cpu" runs on CPU with gloo on a machine that has GPUs (the test suite does);
# "cuda" insists on GPUs; unset (or "auto"): GPUs where CUDA sees one.
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def requested_device() -> str:
    """LLAMA_TP_DEVICE, checked: one of DEVICE_CHOICES."""
    return _setting("LLAMA_TP_DEVICE", DEVICE_CHOICES, "set it to cpu to run on CPU, or leave it unset")


def _setting(variable: str, choices: tuple[str, ...], fix: str) -> str:
    """The environment variable's value, "auto" where unset, refused with `fix` unless one of choices."""
    value = os.environ.get(variable, "auto").strip().lower() or "auto"
    if value not in choices:
        raise ValueError(f"{variable}={value!r} is not one of {', '.join(choices)}; {fix}")
    return value


def accelerator_available() -> bool:
    """Whether this job runs on GPUs: CUDA sees one and LLAMA_TP_DEVICE does not say cpu."""
    requested = requested_device()
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("LLAMA_TP_DEVICE=cuda but CUDA sees no GPU (check CUDA_VISIBLE_DEVICES and the "
                         "driver), or set LLAMA_TP_DEVICE=cpu")
    return requested != "cpu" and torch.cuda.is_available()


def device_for(local_rank: int) -> torch.device:
    """This process's device: its GPU if the job runs on GPUs (choose_gpu), else the CPU."""
    if accelerator_available():
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
        shared = requested_backend() == "gloo"
        return torch.device("cuda", choose_gpu(local_rank, local_world_size, torch.cuda.device_count(), shared))
    return torch.device("cpu")


def choose_gpu(local_rank: int, local_world_size: int, visible: int, shared: bool = False) -> int:
    """The index of this process's GPU among the `visible` ones: 0 where each process sees one GPU
    of its own (SLURM, Kubernetes), else LOCAL_RANK's, which must exist: two processes on one
    GPU make NCCL fail with "Duplicate GPU" after a long wait. Checked against the host's process
    count (LOCAL_WORLD_SIZE), so that every rank refuses, not only those without a GPU. Where the
    ranks talk through gloo (`shared`), GPUs may be shared: the ranks take them in turn."""
    if visible == 1:
        return 0
    if shared:
        return local_rank % visible
    if max(local_rank + 1, local_world_size) > visible:
        raise ValueError(
            f"this host runs {max(local_rank + 1, local_world_size)} processes but shows {visible} GPUs to "
            f"each, so LOCAL_RANK {local_rank} may have no GPU of its own; start at most {visible} processes "
            f"a host (--nproc_per_node {visible}), give each its own GPU through CUDA_VISIBLE_DEVICES, "
            "set LLAMA_TP_BACKEND=gloo to share GPUs (collectives through the host: slow), or set LLAMA_TP_DEVICE=cpu"
        )
    return local_rank


# LLAMA_TP_BACKEND: "gloo" runs the collectives through the host even on GPUs, where NCCL refuses
# two ranks on one GPU (the GPU tests run a two-rank job on one GPU so); "nccl" insists on NCCL;
# unset (or "auto"): NCCL on GPUs, gloo on CPUs.
BACKEND_CHOICES = ("auto", "nccl", "gloo")


def requested_backend() -> str:
    """LLAMA_TP_BACKEND, checked: one of BACKEND_CHOICES."""
    return _setting("LLAMA_TP_BACKEND", BACKEND_CHOICES, "leave it unset for NCCL on GPUs and gloo on CPUs")


def backend_for(device: torch.device) -> str:
    """The collectives' backend for a job on `device`: NCCL on GPUs unless LLAMA_TP_BACKEND=gloo,
    gloo on CPUs (where NCCL cannot run)."""
    requested = requested_backend()
    if device.type == "cpu" and requested == "nccl":
        raise ValueError("LLAMA_TP_BACKEND=nccl needs GPUs, but this job runs on the CPU; leave "
                         "LLAMA_TP_BACKEND unset (gloo on CPUs) or run where CUDA sees a GPU")
    if device.type == "cpu" or requested == "gloo":
        return "gloo"
    return "nccl"


DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def resolve_dtype(dtype: "str | torch.dtype | None", device: torch.device) -> torch.dtype:
    """The compute dtype: as asked, else bf16 on GPUs that compute in it, fp16 on other GPUs, and
    fp32 on CPU, where bf16 matrix-vector products are about 3x slower."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if computes_bf16(device) else torch.float16


# NVIDIA GPUs compute in bf16 (its tensor cores) from compute capability 8.0 (Ampere) on.
BF16_CAPABILITY = (8, 0)


def computes_bf16(device: torch.device) -> bool:
    """Whether the GPU computes in bf16 itself. V100 and T4 (7.x) only emulate it, slowly and
    without flash attention (the math kernel instead), although torch.cuda.is_bf16_supported()
    says yes there; its including_emulation=False asks the same of the current device, this asks
    it of ours."""
    return torch.cuda.get_device_capability(device) >= BF16_CAPABILITY


@dataclass(frozen=True)
class DecodeCompilation:
    """How torch.compile runs one-token decoding steps on a device (see Transformer.compile_decoding)."""

    options: dict[str, Any]  # torch.compile's keywords
    graphs: bool  # whole steps at the sizes of a ladder, recorded as CUDA graphs (model/step_graphs.py)


def decode_compilation(device: torch.device) -> DecodeCompilation:
    """CUDA graphs on GPUs (they replay a whole step as one launch, but need the same shapes every
    time: the step runs at the next size of a ladder, compiled for each), where a graph can hold the step's
    collectives; compiled without graphs of the compiler's own, which would replay each group of
    layers apart; on CPU, code generation for a step whose length may grow, with
    the code that calls the kernels in C++ too (cpp_wrapper): a demo-model step at batch 1 took
    24.1 ms instead of 25.1, for 4 s more of compiling when nothing is cached."""
    if device.type == "cuda":
        graphs = steps_run_whole(device)
        # A graph's rung is one batch size: each compiles for its own (the compiler's dynamic batch
        # size, which it chose after a second size, failed for FlexAttention's block masks on an
        # H200, and a graph would have recorded eager FlexAttention, which a capture refuses).
        return DecodeCompilation({"dynamic": False} if graphs else {}, graphs=graphs)
    require_cxx_compiler("compile=True on CPU", "leave compile off")
    return DecodeCompilation({"dynamic": True, "options": {"cpp_wrapper": True}}, graphs=False)


def steps_run_whole(device: torch.device) -> bool:
    """Whether compiled decoding steps run whole on device, each recorded as a CUDA graph: on CUDA,
    where a graph can hold the job's collectives."""
    return device.type == "cuda" and graphs_hold_collectives()


def graphs_hold_collectives() -> bool:
    """Whether a CUDA graph can capture this job's collectives: NCCL's, or none at world size 1.
    gloo's (LLAMA_TP_BACKEND=gloo) copy through the host, which a capture refuses."""
    return not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "nccl"


# torch's int4 GPU kernel (tinygemm, kernels/tinygemm.py) multiplies on bf16 tensor cores, which
# NVIDIA GPUs have from compute capability 8.0 (Ampere) on; on older ones it does not run.
INT4_MIN_CAPABILITY = BF16_CAPABILITY


def check_int4_device(device: torch.device) -> None:
    """Refuse int4 layers up front on a device without an int4 kernel: CPUs have ours, GPUs of
    compute capability 8.0 or newer torch's tinygemm; other accelerators (MPS, ...) none."""
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(
            f"quantize='int4' runs on CPUs and on CUDA GPUs of compute capability 8.0 or newer, not on {device}; "
            "leave quantize unset or use quantize='int8' to halve the weights' memory"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < INT4_MIN_CAPABILITY:
        raise ValueError(
            f"quantize='int4' runs on GPUs through torch's tinygemm kernel, which needs compute capability "
            f"8.0 (Ampere) or newer; {device} is a {torch.cuda.get_device_name(device)} of compute capability "
            f"{capability[0]}.{capability[1]}: leave quantize unset or use quantize='int8' to halve the weights' memory"
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
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # cuDNN's attention, which torch prefers on Hopper, builds a plan on the host for each new
        # shape (35 ms each on an H200, against 0.03 ms for flash attention), and every prompt
        # chunk brings new shapes: a server's first 16-client burst ran at half speed (docs/gpu.md).
        torch.backends.cuda.enable_cudnn_sdp(False)
    if not dist.is_initialized():
        backend = backend_for(device)
        timeout = collective_timeout()
        # device_id binds NCCL's communicator to this GPU now, rather than guessing it at the first collective.
        bound = {"device_id": device} if backend == "nccl" else {}
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout, **bound)
        else:
            # A plain `python` run: a one-process group needs no network rendezvous.
            store = tempfile.NamedTemporaryFile(prefix="llama_tp_rendezvous_", delete=False).name
            os.unlink(store)
            dist.init_process_group(
                backend, init_method=f"file://{store}", rank=0, world_size=1, timeout=timeout, **bound,
            )
        if world_size > 1:
            # Made now, on every rank together: creating a group is itself a collective.
            _host_groups.append(dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None)
            if device.type == "cuda":  # a GPU can wait for a lost rank where no timeout reaches
                watch_peers(dist.new_group(backend="gloo", timeout=timeout), rank, world_size, timeout.total_seconds())
            _start_launcher_watchdog()
    if not fairscale_mp.model_parallel_is_initialized():
        with _quiet(), _groups_with_timeout(collective_timeout()):
            fairscale_mp.initialize_model_parallel(model_parallel_size)
    return Placement(rank, world_size, local_rank, device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


@contextmanager
def _groups_with_timeout(timeout: timedelta) -> Iterator[None]:
    """Give the groups fairscale makes our timeout: it calls new_group without one, which means
    NCCL's 10 minutes (gloo's 30), after which NCCL's watchdog kills the process before our
    messages, the server's error answers or a clean exit can happen."""
    original = dist.new_group

    def new_group(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("timeout", timeout)
        return original(*args, **kwargs)

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = original


def print0(*args: Any, **kwargs: Any) -> None:
    """print on global rank 0 only, so a job's output appears once."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def model_parallel_rank() -> int:
    return fairscale_mp.get_model_parallel_rank()


def model_parallel_size() -> int:
    return fairscale_mp.get_model_parallel_world_size()


def host_group() -> Any:
    """The group for host objects: gloo beside NCCL (as vLLM and SGLang keep a CPU group), so that
    a pickle is not copied to a GPU, sent and synced back, and a rank with a broken GPU does not
    hold up the others' messages; None (the default group) where that is gloo already."""
    return _host_groups[0] if _host_groups else None


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank src's value of obj, on every rank (for decisions only rank 0 can make)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=host_group())
    return holder[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's obj, in rank order, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj, group=host_group())
    return gathered


def gather_objects_if_any(obj: Any, anything: bool) -> Optional[list[Any]]:
    """gather_objects(obj) if any rank has `anything` to say, else None: then only a byte a rank
    travels, and nothing is pickled (a serving step without news)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj] if anything else None
    flags = [torch.zeros(1, dtype=torch.uint8) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, torch.tensor([anything], dtype=torch.uint8), group=host_group())
    return gather_objects(obj) if any(flag.item() for flag in flags) else None


_launcher: Optional[int] = None  # torchrun's pid, where a watchdog watches it


def launcher_gone_message() -> Optional[str]:
    """What to say if the torchrun that started this rank has died, else None."""
    if _launcher is None or os.getppid() == _launcher:
        return None
    return f"the launcher (pid {_launcher}) is gone; stopping this rank too"


def _start_launcher_watchdog(poll_seconds: float = 1.0) -> None:
    """Exit if torchrun dies (e.g. killed with SIGKILL), so no rank is left behind as an orphan.

    A thread, because the main thread may be blocked inside a collective where Python runs no
    signal handlers; os._exit works from any thread.
    """
    global _launcher
    _launcher = os.getppid()

    def watch() -> None:
        while (message := launcher_gone_message()) is None:
            time.sleep(poll_seconds)
        print(f"llama_tp error on rank {global_rank()}: {message}", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="llama_tp-launcher-watchdog", daemon=True).start()


@contextmanager
def _quiet() -> Iterator[None]:
    """fairscale prints three lines per rank on initialisation; keep job output to rank 0."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield
