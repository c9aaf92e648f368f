"""The one place that knows about processes: backend, device, process groups, parallel layers.

Everything else asks this module; nothing else imports torch.distributed or reads the
torchrun environment. NCCL and `cuda:LOCAL_RANK` when CUDA is present, gloo and CPU otherwise.
"""

import contextlib
import functools
import hashlib
import io
import json
import os
import pickle
import platform
import shutil
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Literal, Optional

import torch
import torch.distributed as dist
from fairscale.nn.model_parallel import initialize as fairscale_mp
from fairscale.nn.model_parallel import layers as fairscale_layers
from fairscale.nn.model_parallel import mappings as fairscale_mappings

from . import matmul
from .shared_memory import SharedMemorySum, new_buffer_path

# Llama 2 checkpoints split the token embedding along the model dimension (fairscale's
# ParallelEmbedding), Llama 3 along the vocabulary (VocabParallelEmbedding).
EmbeddingLayout = Literal["dim", "vocab"]

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
    the same shapes every step); on CPU, code generation for a step whose length may grow."""
    if device.type == "cuda":
        return DecodeCompilation({"mode": "reduce-overhead"}, static_shapes=True)
    if not (os.environ.get("CXX") or any(shutil.which(c) for c in ("g++", "c++", "clang++"))):
        raise ValueError(
            "compile=True on CPU needs a C++ compiler for torch.compile's generated code, and none "
            "was found (g++, c++, clang++ or $CXX); install one (e.g. apt install g++) or leave compile off"
        )
    return DecodeCompilation({"dynamic": True}, static_shapes=False)


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


@contextmanager
def agreement(step: str) -> Iterator[None]:
    """Run a block on every rank, then fail on every rank if it failed on any.

    Without this, a rank whose own file is bad raises while the others walk on into the next
    collective and wait for it until the timeout. The failing rank re-raises its own exception;
    the others raise the same type naming that rank, so every rank reports the cause.
    """
    failure: Optional[Exception] = None
    try:
        yield
    except Exception as error:  # any failure, bug or not, must reach the other ranks
        failure = error
    verdicts = _all_gather_object(None if failure is None else _verdict(failure))
    if failure is not None:
        raise failure
    for rank, verdict in enumerate(verdicts):
        if verdict is not None:
            kind, message = verdict
            raise kind(f"rank {rank} failed while {step}: {message}")


def _verdict(failure: Exception) -> tuple[type, str]:
    """What the other ranks raise for failure: the same kind of user error, else RuntimeError."""
    for kind in (FileNotFoundError, ValueError):  # built-in classes: they pickle everywhere
        if isinstance(failure, kind):
            return kind, str(failure)
    return RuntimeError, f"{type(failure).__name__}: {failure}"


def is_peer_failure(error: BaseException) -> bool:
    """Whether error is a collective failing because another rank is gone or too slow.

    NCCL and the process-group store raise DistError; gloo raises a plain RuntimeError
    ("Connection closed by peer", "Timed out waiting ...") whose text names its gloo source file.
    """
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo" in str(error))


def check_same_on_every_rank(what: str, value: Any) -> None:
    """Raise on every rank if value is not the same on all of them.

    Ranks given different prompts run different numbers of steps, and one then waits for the
    others in a collective until the timeout; comparing a digest first turns that into a message.
    """
    digests = _all_gather_object(hashlib.sha256(pickle.dumps(value)).hexdigest())
    differing = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
    if differing:
        raise ValueError(
            f"{what} on rank(s) {', '.join(map(str, differing))} differ from rank 0's; every rank "
            "must make the same call with the same arguments (e.g. read the same prompts)"
        )


def describe_peer_failure(error: BaseException) -> str:
    """What a failed collective means for the user, in one line."""
    detail = next(iter(str(error).strip().splitlines()), type(error).__name__)
    if "timed out" in detail.lower() or "timeout" in detail.lower():
        waited = collective_timeout().total_seconds()
        return (
            f"gave up waiting for the other processes of this job after {waited:g} s (one may be "
            "stuck, e.g. reading a slow disk, or was never started); set LLAMA_TP_TIMEOUT to wait "
            f"longer. torch.distributed reported: {detail}"
        )
    return (
        "lost contact with another process of this job, which failed or was stopped (see its "
        f"message above, or the launcher's summary). torch.distributed reported: {detail}"
    )


def report_failure(message: str) -> None:
    """Hand message to torchrun, which shows it in its failure summary instead of a link to its docs."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # The layout torchrun's own @record writes; the summary prints py_callstack as "traceback".
        details = {"py_callstack": message, "timestamp": str(int(time.time()))}
        with open(error_file, "w") as file:
            json.dump({"message": {"message": message, "extraInfo": details}}, file)


def wait_for_every_rank(timeout_seconds: float = 5.0) -> None:
    """Wait briefly until every rank gets here, e.g. before exiting on an error.

    torchrun stops the other ranks as soon as one exits, so without this a rank that is a
    moment late can be killed before it has printed its message. A rank that is gone or stuck
    does not hold the others for more than timeout_seconds.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    group = _host_groups[0] if _host_groups else None
    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=timeout_seconds))
    except RuntimeError:  # a rank is gone or stuck: there is nobody to wait for
        pass


def leave() -> None:
    """Leave the process group together with the other ranks, at the end of a job.

    Left to interpreter exit, a rank's gloo threads can be torn down while another rank still
    talks to it, and the rank dies with SIGABRT ("terminate called without an active exception"),
    failing a job that had finished.
    """
    if dist.is_initialized():
        wait_for_every_rank()
        fairscale_mp.destroy_model_parallel()
        _shared_sum.cache_clear()
        dist.destroy_process_group()
        _host_groups.clear()


def _all_gather_object(obj: Any) -> list[Any]:
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


def column_parallel_linear(in_features: int, out_features: int, gather_output: bool) -> torch.nn.Module:
    """y = x W^T with W split by output rows; each rank computes its slice of y."""
    with _skip_weight_init():
        return _ColumnParallelLinear(
            in_features, out_features, bias=False, gather_output=gather_output, init_method=_keep
        )


class _ColumnParallelLinear(fairscale_layers.ColumnParallelLinear):
    """fairscale's layer without its autograd wrapper around the input, which only matters for
    training and cost ~30 us per call: 5 of the ~80 ms of a one-thread decode step."""

    weight_packed = False  # the weight is in oneDNN's layout (matmul.pack); set by the loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul.linear(x, self.weight, self.weight_packed)
        return all_gather_last_dim(y) if self.gather_output else y


def row_parallel_linear(in_features: int, out_features: int) -> torch.nn.Module:
    """y = x W^T with W split by input columns; partial products are summed across ranks."""
    with _skip_weight_init():
        return _RowParallelLinear(
            in_features, out_features, bias=False, input_is_parallel=True, init_method=_keep
        )


class _RowParallelLinear(fairscale_layers.RowParallelLinear):
    """fairscale's layer, summing partial products through all_reduce below (shared memory on CPU)."""

    weight_packed = False  # as _ColumnParallelLinear's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(matmul.linear(x, self.weight, self.weight_packed))


def parallel_embedding(vocab_size: int, dim: int, layout: EmbeddingLayout) -> torch.nn.Module:
    with _skip_weight_init():
        if layout == "dim":
            return _ParallelEmbedding(vocab_size, dim, init_method=_keep)
        return _VocabParallelEmbedding(vocab_size, dim, init_method=_keep)


class _ParallelEmbedding(fairscale_layers.ParallelEmbedding):
    """fairscale's layer (each rank holds some of the model dimension), gathered by all_gather_last_dim."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(torch.nn.functional.embedding(tokens, self.weight))


class _VocabParallelEmbedding(fairscale_layers.VocabParallelEmbedding):
    """fairscale's layer (each rank holds some of the vocabulary), summing through all_reduce."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        elsewhere = (tokens < self.vocab_start_index) | (tokens >= self.vocab_end_index)
        local = torch.where(elsewhere, 0, tokens - self.vocab_start_index)
        rows = torch.nn.functional.embedding(local, self.weight).masked_fill(elsewhere[..., None], 0.0)
        return all_reduce(rows)


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
        return all_reduce
    if isinstance(layer, fairscale_layers.ColumnParallelLinear):
        return all_gather_last_dim if layer.gather_output else _keep
    raise TypeError(f"{type(layer).__name__} is not one of fairscale's parallel linear layers")


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the model-parallel ranks, identical on every rank.

    On CPU with every rank on this host, through shared memory: gloo's loopback TCP takes about
    250 us per call, and decoding one token makes two calls per layer. Elsewhere (NCCL, several
    hosts, tensors too large for the shared buffer) through torch.distributed.
    """
    if model_parallel_size() == 1:
        return x
    return torch.ops.llama_tp.all_reduce(x) if torch.compiler.is_compiling() else _all_reduce(x)


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every model-parallel rank's x [..., n] side by side in rank order: [..., world_size * n]."""
    if model_parallel_size() == 1:
        return x
    return torch.ops.llama_tp.all_gather_last_dim(x) if torch.compiler.is_compiling() else _all_gather(x)


# Registered as operators, opaque to torch.compile: a compiled step calls them without breaking
# its graph around host-side waiting it cannot trace. Eagerly they are called directly, which
# spares the operator dispatch (4-5 us a call, 62 calls a step).
@torch.library.custom_op("llama_tp::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor) -> torch.Tensor:
    return _all_reduce(x)


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    shared = _shared_memory_for(x)
    if shared is not None:
        return shared(x)
    total = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(total, group=fairscale_mp.get_model_parallel_group())
    return total


@_all_reduce_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)  # contiguous whatever x's layout, as both ways above return it


@torch.library.custom_op("llama_tp::all_gather_last_dim", mutates_args=())
def _all_gather_op(x: torch.Tensor) -> torch.Tensor:
    return _all_gather(x)


def _all_gather(x: torch.Tensor) -> torch.Tensor:
    shared = _shared_memory_for(x)
    if shared is not None:
        return shared.gather(x)
    return fairscale_mappings.gather_from_model_parallel_region(x).contiguous()


@_all_gather_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] * model_parallel_size())


def _shared_memory_for(x: torch.Tensor) -> Optional[SharedMemorySum]:
    """The shared buffer, if the ranks have one and x fits it."""
    shared = _shared_sum()
    if shared is not None and x.dtype == torch.float32 and x.numel() <= SharedMemorySum.CAPACITY:
        return shared
    return None


@functools.cache
def _shared_sum() -> Optional[SharedMemorySum]:
    """Made on the first all_reduce, which every rank reaches together."""
    return _create_shared_sum() if _all_ranks_share_memory() else None


def _all_ranks_share_memory() -> bool:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return x86 and not accelerator_available() and local == dist.get_world_size() == model_parallel_size()


def _create_shared_sum() -> SharedMemorySum:
    """Every rank calls this together; rank 0 names the buffer, all map it, then it is unlinked."""
    group = fairscale_mp.get_model_parallel_group()
    rank = model_parallel_rank()
    holder = [new_buffer_path() if rank == 0 else None]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    shared = SharedMemorySum(holder[0], rank, model_parallel_size(), collective_timeout().total_seconds())
    dist.barrier(group=group)
    if rank == 0:
        os.unlink(holder[0])  # the mappings keep it alive; nothing is left behind on exit
    return shared
