"""Thm 1: the loss Hessian of a lone self-attention layer (docs/errata.md E11, E12).

F = A X W_V, A = softmax_rows(X W_Q W_K^T X^T / sqrt(d_k)), loss l = ||F - Target||_F^2 / (L d_V); the
Hessian over (W_Q, W_K, W_V) is c [G_i^T G_j + <R, d2F/dW_i dW_j>], c = 2/(L d_V), R = F - Target.

As stated, the theorem bounds the blocks (V,V), (Q,Q), (V,Q), (Q,K) by the four arguments of its max and
||H|| by M = 3 max(...). Its proof rests on ||dA/dT|| <= 1/L, true only for uniform attention (E11):
the appendix's intermediate bound ||H_o(Q,Q)|| <= 2 ||W_K||^2 ||W_V||^2 ||X||^6 / (L^3 d_V d_K) fails for
peaked attention. It omits the (K,K) and (V,K) blocks and its constants differ from its proof (E12).

Corrected [ours], with norms spectral unless named, x = ||X||, and two numbers that say how peaked the
attention is: a = max_ij A_ij (1/L when uniform, up to 1) and k = the largest column sum of A (1 when
uniform, up to L):

* the row softmax Jacobian diag(a_i) - a_i a_i^T is positive semi-definite and below diag(a_i), and by
  Gershgorin below 1/2: ||dA/dT|| <= s1 := min(1/2, a). Uniform attention gives the paper's 1/L;
* its second derivative along u is a_i o ((u - u_bar)^2 - Var(u)), of 1-norm <= 2 Var(u), and
  Var(u) <= min(|u|^2/2 (Popoviciu), a |u|^2): the bilinear map d2A has norm <= s2 := min(1, 2a)
  (Frobenius in and out, by polarisation);
* ||A||^2 <= ||A||_1 ||A||_inf = k (A is row-stochastic);
* first derivatives (G_k D = dF): ||G_V|| <= sqrt(k) x; dT = X D_Q W_K^T X^T / sqrt(d_k) gives
  ||G_Q|| <= s1 ||W_V|| ||W_K|| x^3 / sqrt(d_k), and ||G_K|| likewise with ||W_Q||;
* second derivatives (phi_kl bounds ||d2F[D_k, D_l]||_F for unit D): phi_VV = 0,
  phi_VQ = s1 ||W_K|| x^3 / sqrt(d_k), phi_QQ = s2 ||W_V|| ||W_K||^2 x^5 / d_k,
  phi_QK = ||W_V|| (s2 ||W_Q|| ||W_K|| x^5 / d_k + s1 x^3 / sqrt(d_k)) (the second term from
  d2T = X D_Q D_K^T X^T / sqrt(d_k)), and K for Q with W_Q for W_K;
* R = F - Target, rho = ||R||_F (the paper bounds it by sqrt(rank) (L x ||W_V|| + ||Target||));

so ||H(k, l)|| <= c (g_k g_l + rho phi_kl), and ||H|| <= the spectral norm of the 3 x 3 matrix of those
block bounds. With the worst case a = 1/2 the 1/L^3 of the stated (Q,Q) term becomes 1/(4L); for
uniform attention it is the paper's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._bound import Bound, as_bound
from ._float import overflow_is_inf
from ._norms import ITERATIONS, TOL, block_norms
from ._paper_block import Sample, attention_sample, paper_params, samples_of

PAIRS = (("W_V", "W_V"), ("W_Q", "W_Q"), ("W_Q", "W_V"), ("W_Q", "W_K"), ("W_K", "W_K"), ("W_K", "W_V"))
# What each block's corrected bound fixes: the uniform-attention 1/L (E11), a block the max omits (E12).
_ERRATA = {("W_V", "W_V"): None, ("W_Q", "W_Q"): "E11", ("W_Q", "W_V"): "E11", ("W_Q", "W_K"): "E11",
           ("W_K", "W_K"): "E12", ("W_K", "W_V"): "E12"}
_SHORT = {"W_Q": "Q", "W_K": "K", "W_V": "V", "W_1": "1", "W_2": "2"}


def pair_label(a: str, b: str) -> str:
    return f"({_SHORT[a]},{_SHORT[b]})"


def softmax_constants(s: Sample) -> tuple[float, float]:
    """(s1, s2): the norms of the row softmax's first and second derivatives, bounded by how peaked
    the attention is (module docstring)."""
    return min(0.5, s.attention_max), min(1.0, 2 * s.attention_max)


def first_derivative_bounds(s: Sample) -> dict[str, float]:
    """Corrected bounds on ||G_k|| = ||dF/dW_k||."""
    s1, _ = softmax_constants(s)
    x, r = s.X, s1 / np.sqrt(s.d_k)
    return {"W_V": np.sqrt(s.key_max) * x, "W_Q": r * s.W_V * s.W_K * x**3, "W_K": r * s.W_V * s.W_Q * x**3}


def second_derivative_bounds(s: Sample) -> dict[tuple[str, str], float]:
    """Corrected bounds on ||d2F[D_k, D_l]||_F over unit D_k, D_l (both orders)."""
    s1, s2 = softmax_constants(s)
    x, dk = s.X, s.d_k
    first = s1 / np.sqrt(dk)
    phi = {
        ("W_V", "W_V"): 0.0,
        ("W_Q", "W_V"): first * s.W_K * x**3,
        ("W_K", "W_V"): first * s.W_Q * x**3,
        ("W_Q", "W_Q"): s2 * s.W_V * s.W_K**2 * x**5 / dk,
        ("W_K", "W_K"): s2 * s.W_V * s.W_Q**2 * x**5 / dk,
        ("W_Q", "W_K"): s.W_V * (s2 * s.W_Q * s.W_K * x**5 / dk + first * x**3),
    }
    return phi | {(b, a): v for (a, b), v in phi.items()}


def stated_first_derivative_bounds(s: Sample) -> dict[str, float]:
    """The paper's ||G_k|| bounds (Thm 6's ingredients; uniform-attention 1/L, E11)."""
    x = s.X
    return {"W_V": s.L * x, "W_Q": s.W_V * s.W_K * x**3 / (s.L * np.sqrt(s.d_k)),
            "W_K": s.W_V * s.W_Q * x**3 / (s.L * np.sqrt(s.d_k))}


def stated_second_derivative_bounds(s: Sample) -> dict[tuple[str, str], float]:
    """The paper's ||Phi_kl|| bounds as printed (Thm 6's ingredients, with Lemma 2's 2/(L d_V), E8);
    the blocks it calls "analogous" by the Q <-> K swap."""
    x, L, d, dk = s.X, s.L, s.d, s.d_k
    a, b = 12 / (L * d * dk), 2 / (L**2 * np.sqrt(d * dk))
    phi = {
        ("W_V", "W_V"): 0.0,
        ("W_Q", "W_V"): b * s.W_K * x**3,
        ("W_K", "W_V"): b * s.W_Q * x**3,
        ("W_Q", "W_Q"): a * s.W_V * s.W_K**2 * x**5,
        ("W_K", "W_K"): a * s.W_V * s.W_Q**2 * x**5,
        ("W_Q", "W_K"): a * s.W_V * s.W_K * s.W_Q * x**5 + b * s.W_V * x**3,
    }
    return phi | {(q, p): v for (p, q), v in phi.items()}


def corrected_blocks(s: Sample) -> dict[tuple[str, str], float]:
    c, rho = 2 / (s.L * s.d), s.residual_frobenius
    g, phi = first_derivative_bounds(s), second_derivative_bounds(s)
    return {(a, b): c * (g[a] * g[b] + rho * phi[a, b]) for a in g for b in g}


def stated_blocks(s: Sample) -> dict[tuple[str, str], float]:
    """The four arguments of Thm 1's max, by block."""
    x, L, d, dk = s.X, s.L, s.d, s.d_k
    r = np.sqrt(min(L, d))
    rho = L * x * s.W_V + s.target_frobenius
    return {
        ("W_V", "W_V"): 2 * L / d * x**2,
        ("W_Q", "W_Q"): (8 / (L**3 * d * dk) * s.W_K**2 * s.W_V**2 * x**6
                         + 12 / (d * dk) * r * rho * s.W_V * s.W_K**2 * x**5),
        ("W_Q", "W_V"): (4 / (L * d * np.sqrt(dk)) * s.W_V * s.W_K * x**4
                         + 4 * r / (L**2 * np.sqrt(dk)) * rho * s.W_K * x**3),
        ("W_Q", "W_K"): (8 / (L**3 * d * dk) * s.W_K * s.W_Q * s.W_V**2 * x**6
                         + 4 * r * rho / (L * d * np.sqrt(dk)) * s.W_V * (3 * L * s.W_K * s.W_Q * x**5 + d / L * x**3)),
    }


def stated_outer_QQ(s: Sample) -> float:
    """The appendix's intermediate bound on ||H_o(Q,Q)|| (the one E11's counterexample breaks)."""
    return 2 / (s.L**3 * s.d * s.d_k) * s.W_K**2 * s.W_V**2 * s.X**6


def block_matrix_bound(blocks: dict[tuple[str, str], float], names: tuple[str, ...]) -> float:
    """||H|| <= the spectral norm of the matrix of its blocks' norm bounds (inf when one of them is:
    past the float range)."""
    N = np.array([[blocks[a, b] if (a, b) in blocks else blocks[b, a] for b in names] for a in names])
    return float(np.linalg.norm(N, 2)) if np.isfinite(N).all() else np.inf


@overflow_is_inf
def theorem1(X: Any, target: Any, params: Any, *, iterations: int = ITERATIONS, tol: float = TOL) -> list[Bound]:
    """Thm 1 for the lone attention layer ``params`` (``BlockSpec(attention_only=True)``, paper
    sizes: W_V square) at X (L, d) or a batch (B, L, d) with the mse target of Z's shape: the six
    blocks, the appendix's H_o(Q,Q) bound and M. For a batch the loss is the batch mean, and every
    bound is the mean of the per-sample bounds (the triangle inequality). ``iterations``, ``tol``:
    power iteration's, for the exact norms beyond block_norms's DENSE_LIMIT."""
    W = paper_params(params)
    if not params.spec.attention_only:
        raise ValueError("theorem1 is about the lone attention layer: pass BlockParams of BlockSpec(attention_only=True)")
    # The exact norms first: they check X, target (mse's, of X's shape) and params.
    exact = block_norms(X, target, params, iterations=iterations, tol=tol)
    outer = block_norms(X, target, params, part="outer", names=("W_Q",), iterations=iterations, tol=tol)
    samples = [attention_sample(x, t, W) for x, t in zip(samples_of(X), samples_of(target, "target"))]
    corrected = _mean([corrected_blocks(s) for s in samples])
    stated = _mean([stated_blocks(s) for s in samples])
    bounds = []
    for a, b in PAIRS:
        bounds.append(Bound(f"Thm 1: ||H{pair_label(a, b)}||", exact[a, b], stated.get((a, b)), corrected[a, b],
                            erratum=_ERRATA[a, b], source="Thm 1"))
    bounds.append(Bound("Thm 1: ||H_o(Q,Q)|| (appendix's 2/L^3 bound)", outer["W_Q", "W_Q"],
                        float(np.mean([stated_outer_QQ(s) for s in samples])),
                        float(np.mean([corrected_blocks_outer_QQ(s) for s in samples])), erratum="E11", source="Thm 1"))
    bounds.append(Bound("Thm 1: M >= ||H||", exact["all", "all"], 3 * max(stated.values()),
                        block_matrix_bound(corrected, ("W_Q", "W_K", "W_V")), erratum="E12", source="Thm 1"))
    return bounds


def corrected_blocks_outer_QQ(s: Sample) -> float:
    return 2 / (s.L * s.d) * first_derivative_bounds(s)["W_Q"] ** 2


def _mean(dicts: list[dict]) -> dict:
    """The per-key mean of per-sample bounds (NaN, from an overflow, as inf: a max over them must see it)."""
    return {key: as_bound(np.mean([d[key] for d in dicts])) for key in dicts[0]}
