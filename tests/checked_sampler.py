"""Run by test_sampler_kernel.py in a process of its own: sampler_kernel.cpp built alone with
libstdc++'s bounds checks (_GLIBCXX_ASSERTIONS) and AddressSanitizer, then fed rows with nothing
to choose (every logit -inf, or NaN) beside ordinary ones, greedy and sampled. Undefined behaviour
aborts the process; a clean run prints each row's token.

    LD_PRELOAD=$(gcc -print-file-name=libasan.so) python tests/checked_sampler.py BUILD_DIR
"""

import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

from llama_tp.kernels import cpu_kernels

KERNEL = Path(cpu_kernels.__file__).with_name("sampler_kernel.cpp")
ISA = (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"] if cpu_kernels.ON_THIS_CPU
       else ["-mavx2", "-mfma", "-mf16c"])
CHECKS = ["-D_GLIBCXX_ASSERTIONS", "-fsanitize=address", "-fno-omit-frame-pointer"]


def main(build_directory: str) -> None:
    cpp_extension.load(name="llama_tp_checked_sampler", sources=[str(KERNEL)], build_directory=build_directory,
                       extra_cflags=["-O1", "-g", *ISA, "-fopenmp", *CHECKS],
                       extra_ldflags=["-fopenmp", "-fsanitize=address"], is_python_module=False)
    vocab = 1000
    logits = torch.full((6, vocab), float("-inf"))
    logits[1, 5] = 2.0  # one token allowed
    logits[3] = float("nan")
    logits[4] = torch.linspace(-3, 3, vocab)  # an ordinary row
    logits[5, 7] = float("inf")
    # greedy, then sampled with top-p, with top-k, and without a cut; -inf, one token, -inf, NaN, ordinary, +inf
    settings = torch.tensor([[1 / 0.7, 0.9, 0.0, 1.0], [1 / 0.7, 0.9, 0.0, 1.0], [0.0, 1.0, 0.0, 1.0],
                             [1.0, 0.5, 0.0, 1.2], [1.0, 1.0, 0.05, 1.0], [1.0, 0.9, 0.0, 1.0]])
    history = torch.tensor([[3, 4, -1]] * 6)
    tokens = torch.ops.llama_tp.sample_rows(logits, history, settings, torch.tensor([0, 0, 0, 40, 0, 0]),
                                            torch.full((6,), 0.5, dtype=torch.float64), 256)
    print(" ".join(map(str, tokens.tolist())))


if __name__ == "__main__":
    main(sys.argv[1])
