"""The products and other kernels a decoding step runs: our C++ kernels for CPUs with AVX-512
(cpu_kernels, its .cpp sources), the choice of kernel per linear product (matmul), and grouped
int8 and int4 weights (int8, int4). Nothing here knows about processes or ranks."""
