"""Our C++ kernels for decoding on CPUs with AVX-512 (cpu_kernels.cpp): matrix products of a few
rows by an fp32 weight (float_product) or by grouped int8 weights (int8.py); products by grouped
4-bit weights and their conversion back for prompts (int4_kernel.cpp, int4.py); an RMS norm in one
pass (norm_kernel.cpp, rms_norm); one new token's attention to the cache (attention_kernel.cpp,
decode_attention), and eagerly the whole step of a few tokens, rotation and cache write included
(decode_step_attention); every row's next token (sampler_kernel.cpp, sample_rows); and a step of
plain int4 or int8 layers in one call of those kernels (layer_step.cpp, model/layer_step.py).
torch.utils.cpp_extension compiles them on first use (a minute or more on a few cores, then cached in
~/.cache/torch_extensions), together with the ranks' exchange through shared memory
(parallel/shared_memory.cpp). CPUs with AVX2 but not AVX-512 build the decoding kernels alone:
the fp32 and quantized products (avx2_float_product.cpp, avx2_kernels.cpp: the same operators on
the same layouts), the norm, the attention and the sampler (built for 8-float registers,
float_lanes.h) and the layers' step; load_decoding_kernels.

All are torch operators (torch.ops.llama_tp.*) with their output shapes registered, so that
torch.compile calls them as they are. LLAMA_TP_CPU_KERNELS=0 in the environment leaves them out
(torch's kernels do the work instead), should they fail to build.
"""

import contextlib
import fcntl
import functools
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import torch

from ..logs import logger


def cxx_compiler_found() -> bool:
    """Whether a C++ compiler is there, for these kernels and torch.compile's CPU code alike."""
    return bool(os.environ.get("CXX") or any(shutil.which(c) for c in ("g++", "c++", "clang++")))


# Asked once, at import: the model asks before every norm and product. A CPU with AVX-512, as
# torch itself detects it, a C++ compiler to build the kernels with, and LLAMA_TP_CPU_KERNELS not 0.
_ALLOWED = os.environ.get("LLAMA_TP_CPU_KERNELS", "1") != "0" and cxx_compiler_found()
ON_THIS_CPU = _ALLOWED and torch.backends.cpu.get_cpu_capability() == "AVX512"
# CPUs with AVX2 (and its FMA and F16C) but not AVX-512 build the decoding kernels alone: without
# them an int4 or int8 layer converts its weight back every step, and rows at different positions
# attend through a gathered copy of their caches.
AVX2_KERNELS = _ALLOWED and torch.backends.cpu.get_cpu_capability() == "AVX2"
# The kernels both builds have: norm, attention and sampling written once for either register width.
DECODING_SOURCES = ("norm_kernel.cpp", "attention_kernel.cpp", "sampler_kernel.cpp", "layer_step.cpp")
# Floats in one of the attention kernel's registers: a head's width must be a multiple of it.
ATTENTION_LANES = 16 if ON_THIS_CPU else 8


def runs_on(device: torch.device) -> bool:
    """Whether all the kernels run on this device (ON_THIS_CPU)."""
    return ON_THIS_CPU and device.type == "cpu"


def decoding_kernels_run_on(device: torch.device) -> bool:
    """Whether our fp32, int4 and int8 products, norm and attention run on this device: with AVX-512 or AVX2."""
    return (ON_THIS_CPU or AVX2_KERNELS) and device.type == "cpu"


@functools.cache
def load() -> None:
    """Compile (or take from torch's extension cache) and load the kernels: call it before
    torch.compile traces a call to them."""
    _build("llama_tp_cpu_kernels",
           [*(Path(__file__).with_name(name) for name in ("cpu_kernels.cpp", "int4_kernel.cpp", *DECODING_SOURCES)),
            Path(__file__).parents[1] / "parallel" / "shared_memory.cpp"],
           # AVX-512 as torch's capability check has it (F, BW, VL, DQ), FMA
           ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"])
    _register_decoding_shapes()

    @torch.library.register_fake("llama_tp::shared_sum")
    def _(x, buffer, rank, world_size, capacity, timeout_seconds):
        return x.new_empty(x.shape)

    @torch.library.register_fake("llama_tp::shared_gather")
    def _(x, buffer, rank, world_size, capacity, timeout_seconds):
        return x.new_empty(*x.shape[:-1], x.shape[-1] * world_size)


@functools.cache
def load_decoding_kernels() -> None:
    """Load the fp32 and quantized products, norm and attention: with all the kernels (AVX-512),
    or built alone for AVX2."""
    if ON_THIS_CPU:
        load()
        return
    _build("llama_tp_avx2_kernels", [Path(__file__).with_name(name)
                                     for name in ("avx2_kernels.cpp", "avx2_float_product.cpp", *DECODING_SOURCES)],
           ["-mavx2", "-mfma", "-mf16c"])
    _register_decoding_shapes()


def _build(name: str, sources: list[Path], isa_flags: list[str]) -> None:
    """Compile (or take from torch's extension cache) and load one extension of torch operators."""
    from torch.utils import cpp_extension  # imported here: it is slow to import and only needed once

    if shutil.which("ninja") is None:  # cpp_extension runs `ninja` from PATH: take the ninja package's
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    # torch's own folder for the extension (~/.cache/torch_extensions/py311_cpu/NAME, or under $TORCH_EXTENSIONS_DIR)
    folder = Path(cpp_extension._get_build_directory(name, verbose=False))
    with _build_lock(folder):
        building = _needs_building(folder / f"{name}.so", sources)
        if building:
            logger.info(f"building llama_tp's CPU kernels ({name}) in {folder}: once, a minute or more on a "
                        "few cores (LLAMA_TP_CPU_KERNELS=0 runs without them)")
        start = time.perf_counter()
        try:
            # OpenMP: at::parallel_for's threads
            cpp_extension.load(name=name, sources=[str(source) for source in sources], build_directory=str(folder),
                               extra_cflags=["-O3", *isa_flags, "-fopenmp"], extra_ldflags=["-fopenmp"],
                               is_python_module=False)
        except Exception as error:  # a compiler, linker or ninja failure, whatever torch raises for it
            raise RuntimeError(
                f"building llama_tp's CPU kernels failed ({type(error).__name__}: {str(error).strip()[:300]}); "
                "fix the C++ toolchain (g++ or $CXX, ninja), or set LLAMA_TP_CPU_KERNELS=0 to use torch's kernels"
            ) from error
    if building:
        logger.info(f"built llama_tp's CPU kernels ({name}) in {time.perf_counter() - start:.0f} s")


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Hold the extension folder for building and loading, against every other llama_tp process.

    torch's own lock (folder/lock, created by cpp_extension.load) outlives a process that is killed
    while it builds, and every later load then waits for it forever. Ours is a kernel lock
    (flock), released when its holder dies however it dies: whoever holds it knows that no other
    llama_tp process is building here, so a `lock` it finds was left by a dead one.
    """
    with open(folder / "llama_tp.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info(f"waiting for another process that is building llama_tp's CPU kernels in {folder}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                logger.info(f"removing {stale}, left by a kernel build that was stopped half-way")
                stale.unlink()
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _needs_building(library: Path, sources: list[Path]) -> bool:
    """Whether the extension is missing or older than a source or header it is built from."""
    if not library.exists():
        return True
    inputs = {source for source in sources} | set(Path(__file__).parent.glob("*.h"))
    return max(path.stat().st_mtime for path in inputs) > library.stat().st_mtime


def _register_decoding_shapes() -> None:
    """The products', norm's and attention's output shapes, for torch.compile."""

    @torch.library.register_fake("llama_tp::float_product")
    def _(x, w):
        return x.new_empty(*x.shape[:-1], w.shape[0])

    @torch.library.register_fake("llama_tp::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("llama_tp::decode_attention")
    def _(q, k_pool, v_pool, tables, lengths, block):
        return torch.empty_like(q)

    @torch.library.register_fake("llama_tp::decode_step_attention")
    def _(qkv, turns, k_pool, v_pool, tables, positions, heads, block):
        return qkv.new_empty(qkv.shape[0], qkv.shape[1], heads * k_pool.shape[-1])

    @torch.library.register_fake("llama_tp::int8_product")
    def _(x, q, scales, zeros, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("llama_tp::int4_product")
    def _(x, codes, scales, mins):
        return x.new_empty(*x.shape[:-1], codes.shape[0])

    @torch.library.register_fake("llama_tp::sample_rows")
    def _(logits, history, settings, top_k, uniform, candidates):
        return logits.new_empty(logits.shape[0], dtype=torch.long)

    @torch.library.register_fake("llama_tp::quantized_layers_step")
    def _(x, operands, bits, out_features, k_pools, v_pools, turns, tables, positions, heads, block, hidden, eps,
          buffer, rank, world_size, capacity, timeout_seconds):
        return torch.empty_like(x)

    @torch.library.register_fake("llama_tp::int4_weight")
    def _(codes, scales, mins):
        return codes.new_empty(codes.shape[0], 2 * codes.shape[1], dtype=torch.float32)


def float_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] times an fp32 weight [out, in] transposed, both fp32."""
    if not torch.compiler.is_compiling():  # compiled code is traced after the loader's load_decoding_kernels()
        load_decoding_kernels()
    return torch.ops.llama_tp.float_product(x.contiguous(), weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm of fp32 x [..., dim] over its last dimension, times an fp32 weight [dim]."""
    load_decoding_kernels()
    return torch.ops.llama_tp.rms_norm(x.contiguous(), weight, eps)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, block: int) -> torch.Tensor:
    """One new token per row attending to its own positions: q [bsz, heads, 1, head_dim] to the
    keys and values of positions [0, lengths[b]) of row b, found through its block table
    (tables [bsz, blocks a row]) in the pools [1, kv heads, blocks * block, head_dim]
    (kv_cache.KVCache); all fp32, head_dim a multiple of ATTENTION_LANES; tables, lengths int64.
    As scaled_dot_product_attention(q, keys, values, enable_gqa=True) row by row."""
    if not torch.compiler.is_compiling():
        load_decoding_kernels()
    bsz, heads, _, head_dim = q.shape
    out = torch.ops.llama_tp.decode_attention(q.reshape(bsz, heads, head_dim).contiguous(), k_pool, v_pool,
                                              tables, lengths, block)
    return out.view(bsz, heads, 1, head_dim)


def decode_step_attention(qkv: torch.Tensor, turns: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          tables: torch.Tensor, positions: torch.Tensor, heads: int, block: int) -> torch.Tensor:
    """A step of a few tokens a row, row b's from position positions[b], from their wqkv product
    qkv [bsz, tokens, (heads + 2 kv heads) * head_dim]: each token's queries and keys turned by
    turns [bsz or 1, tokens, head_dim // 2, 2] (cos, sin), its key and value written at its place in
    the pools (decode_attention's, through the row's block table), then its attention to the row's
    positions up to its own: [bsz, tokens, heads * head_dim]. As apply_rotary, KVCache.write and
    decode_attention do it, in one call, and each token exactly as in a step of its own: fp32,
    head_dim a multiple of ATTENTION_LANES; tables, positions int64."""
    load_decoding_kernels()
    return torch.ops.llama_tp.decode_step_attention(qkv, turns, k_pool, v_pool, tables, positions, heads, block)


def sample_rows(logits: torch.Tensor, history: torch.Tensor, settings: torch.Tensor, top_k: torch.Tensor,
                uniform: torch.Tensor, candidates: int) -> torch.Tensor:
    """Every row's next token by sampler.py's rule: logits [rows, vocab] fp32, history [rows, n]
    int64 (negative ids: padding), settings [rows, 4] fp32 (1 / temperature, 0 for greedy; top_p;
    min_p; repetition penalty), top_k [rows] int64 (0: none; at most candidates), uniform [rows]
    float64 -> [rows] int64."""
    load_decoding_kernels()
    return torch.ops.llama_tp.sample_rows(logits.contiguous(), history.contiguous(), settings, top_k, uniform,
                                          candidates)
