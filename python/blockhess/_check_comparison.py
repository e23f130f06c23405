"""How ``blockhess check`` compares the closed form with a reference: the tolerances, the
rounding-noise floor that keeps a comparison meaningful when the Hessian is zero, and the norms
(accumulated over row chunks in float64)."""

from __future__ import annotations

import math

import numpy as np

from ._check_config import Config
from ._check_references import FD_STEP


# Relative Frobenius error allowed against each reference, by dtype.
TOLERANCE = {
    ("torch", "float64"): 1e-10,
    ("torch", "float32"): 1e-4,
    ("finite-differences", "float64"): 1e-5,
    ("finite-differences", "float32"): 1e-2,
}

# Relative tolerance of outer + functional == full (both parts come from the same closed form).
SPLIT_TOLERANCE = {"float64": 1e-12, "float32": 1e-4}
# Relative tolerance of the matrix-free product H V against the dense H times V (one closed form
# against another, both in the check's dtype).
HVP_TOLERANCE = {"float64": 1e-12, "float32": 1e-4}
HVP_VECTORS = 4

# The absolute floor of every comparison: error <= tolerance * max(||reference||_F, floor), with
# tolerance * floor = NOISE_MULTIPLE * the problem's rounding-noise scale (rounding_noise).
# When the true Hessian is exactly zero (d=1 with eps > 0, where LayerNorm returns 0, or d=2 with
# eps=0, where it maps every row to +-1: either way the block's output does not depend on the
# weights), the closed form and the reference are both pure rounding noise, and a relative error
# is noise divided by noise. That noise is of order
#     machine epsilon x sqrt(P) x max(|loss|, 1) x max(1, 1/sigma_min)^2
# (terms of the size of the loss, sqrt(P) of them in a Frobenius norm, that cancel exactly,
# amplified by LayerNorm's second derivative, 1/sigma^2 for the smallest row standard deviation
# sigma_min of either LayerNorm's input; finite differences add their rounded gradients divided by
# the step). Measured over 40 seeds and many sizes (L 5..300, d_k, d_ff, batch, both losses,
# float32 and float64, d = 2 and normal d = 4..16), ||H - H_ref||_F stayed below 0.3 of that
# scale, degenerate or not, so 3 leaves a margin of 10. On a normal problem the floor stays below
# tolerance x ||H_ref||_F (float64: about 1000 times below; float32: 1.2-6 times), so the relative
# tolerance decides, and a real error, even 1e-3 relative, still fails.
NOISE_MULTIPLE = 3.0


def smallest_layernorm_sigma(X, weights, cfg: Config) -> float:
    """The smallest row standard deviation (with eps) of the inputs of both LayerNorms, in float64,
    for the paper's block. Other specs use 1: their floor is then sqrt(P) |loss| machine-epsilon,
    far below the relative tolerance of a normal problem; the degenerate sizes that the floor
    exists for were measured on the paper's block."""
    if not cfg.spec.is_paper_block:
        return 1.0
    X = np.asarray(X, dtype=np.float64)
    WQ, WK, WV, W1, W2 = (np.asarray(w, dtype=np.float64) for w in weights)
    T = X @ WQ @ (X @ WK).swapaxes(-1, -2) / math.sqrt(cfg.d_k)
    A = np.exp(T - T.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    S1 = X + A @ X @ WV
    sigma1 = np.sqrt(S1.var(-1) + cfg.eps)
    Y = (S1 - S1.mean(-1, keepdims=True)) / np.where(sigma1 > 0, sigma1, 1.0)[..., None]
    S2 = np.maximum(Y @ W1, 0.0) @ W2 + Y
    sigma2 = np.sqrt(S2.var(-1) + cfg.eps)
    return float(min(sigma1.min(), sigma2.min()))


def rounding_noise(P: int, loss: float, sigma_min: float, dtype: str, reference: str) -> float:
    """The rounding-noise scale of a comparison (see NOISE_MULTIPLE): sqrt(P) |loss| times the
    relative rounding error of each side. The closed form's, in its dtype (torch's float64 is
    finer), is amplified by LayerNorm's second derivative, a^2 with a = 1/sigma_min; finite
    differences divide rounded gradients, amplified by LayerNorm's first derivative (a), by the step."""
    a = 1.0 / sigma_min if sigma_min > 0 else math.inf
    a = max(a, 1.0)
    unit = float(np.finfo(np.dtype(dtype)).eps)
    relative = unit * a * a
    if reference == "finite-differences":
        relative += unit / FD_STEP[dtype] * a
    return math.sqrt(P) * max(abs(loss), 1.0) * relative


def fro(a: np.ndarray, rows: int = 1024) -> float:
    """||a||_F, accumulated over row chunks in float64 (no float32 overflow, no large temporary)."""
    total = 0.0
    for i in range(0, a.shape[0], rows):
        chunk = np.asarray(a[i:i + rows], dtype=np.float64)
        total += float(np.vdot(chunk, chunk).real)
    return math.sqrt(total)


def fro_of_difference(a: np.ndarray, b: np.ndarray, rows: int = 1024) -> float:
    """||a - b||_F in float64, over row chunks (no (P, P) temporary)."""
    total = 0.0
    for i in range(0, a.shape[0], rows):
        diff = np.asarray(a[i:i + rows], dtype=np.float64) - np.asarray(b[i:i + rows], dtype=np.float64)
        total += float(np.vdot(diff, diff).real)
    return math.sqrt(total)


def fro_of_split_residual(outer, functional, full, rows: int = 1024) -> float:
    """||outer + functional - full||_F over row chunks."""
    total = 0.0
    for i in range(0, full.shape[0], rows):
        r = (np.asarray(outer[i:i + rows], dtype=np.float64) + functional[i:i + rows]) - full[i:i + rows]
        total += float(np.vdot(r, r).real)
    return math.sqrt(total)


def max_asymmetry(a: np.ndarray, rows: int = 1024) -> float:
    """max |a - a^T| over row chunks."""
    worst = 0.0
    for i in range(0, a.shape[0], rows):
        part = a[i:i + rows]
        if part.size:
            worst = max(worst, float(np.abs(part - a[:, i:i + rows].T).max()))
    return worst


def spectral_norm(blk: np.ndarray) -> float:
    """||blk||_2: the eigenvalues of an exactly symmetric block (about 4x faster), else the SVD."""
    if blk.size == 0:
        return 0.0
    blk = np.asarray(blk, dtype=np.float64)
    if blk.shape[0] == blk.shape[1] and np.array_equal(blk, blk.T):
        return float(np.abs(np.linalg.eigvalsh(blk)).max())
    return float(np.linalg.svd(blk, compute_uv=False)[0])
