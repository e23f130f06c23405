"""Settings of the CPU suite: seeds, threads, LayerNorm eps, problem sizes and the dense-output limit.

float64 unless a benchmark says otherwise, and THREADS threads for every library (blockhess's own
thread pool, ``torch.set_num_threads`` for PyTorch, numpy's BLAS for the GEMM floor).
"""

SEED = 20240611
THREADS = 2
EPS = 0.0  # LayerNorm eps everywhere (the blockhess default)

# Sizes: small enough for torch autograd to finish, large enough to show the scaling.
LN_JACOBIAN_SHAPES = [(16, 64), (64, 128)]  # (L, d)
LN_HESSIAN_SHAPES = [(8, 32), (16, 64)]  # (L, d)
FFN_SHAPES = [(16, 64, 256), (49, 16, 64)]  # (L, d, d_ff)
ATTENTION_SHAPES = [(16, 32, 32), (49, 16, 16)]  # (L, d, d_k)
BLOCK_SHAPES = [(8, 16, 16, 32), (49, 16, 16, 64), (16, 32, 32, 64)]  # (L, d, d_k, d_ff)

# Dense outputs above this many bytes are not attempted (this machine has 24 GiB; torch needs several
# copies of its output).
DENSE_LIMIT_BYTES = 2 * 2**30

# blockhess and PyTorch share one OpenMP runtime (libgomp), which reads OMP_WAIT_POLICY once, when
# it is first loaded; neither library sets it. The benchmarks load PyTorch first so that PyTorch's
# bundled libgomp is the one both use, as in a PyTorch user's process. The peak-memory child skips this.
TORCH_FIRST = True
