"""Thm 6: the loss Hessian of the paper's block, per parameter block and whole.

Z = LN(S), S = relu(Y W_1) W_2 + Y, Y = LN(S0), S0 = X + F; loss l = ||Z - Target||_F^2 / (L d), so
(§3.8) H(i, j)[D_i, D_j] = c [<J_Z dS_i, J_Z dS_j> + <r, H_Z[dS_i, dS_j]> + <u, d2S[D_i, D_j]>], c = 2/(L d),
r = vec(Z - Target), u = J_Z^T r, dS_i = B_i D_i.

As stated: ||H(i,j)|| <= c ||dZ/dW_i|| ||dZ/dW_j|| + ||R^tr|| ||H_tr^(i,j)||, ||H_tr^(i,j)|| <= ||J_Z|| ||xi_ij||
+ ||B_i|| ||H_Z|| ||B_j||, with the paper's ingredients (its ||G_k||, ||Phi_kl|| with uniform
attention's 1/L (E11) and Lemma 2's 2/(L d) (E8), ||xi_12|| <= sqrt(d) ||Y||, Lemma 4 with the row std
(E14), Prop 10's ||Y|| <= sqrt(L d)), ||R^tr|| = ||Z - Target||_F without its 2/(L d) (E13), and
M_tr = 5 max_ij. The paper never writes the (k,1), (k,2) ingredients out (E6): we follow its pattern.

Corrected [ours], rho = ||Z - Target||_F, norms spectral:
* ||J_Z|| <= 1/sigma_min(S), ||H_Z|| <= Lemma 4's corrected bound at sigma_min(S); likewise J_Y, H_Y at S0;
* b_1 = ||W_2|| ||Y|| (dS = (D o (Y D_1)) W_2), b_2 = ||relu(Y W_1)||, b_k = (1 + ||W_1|| ||W_2||) ||J_Y|| g_k
  with g_k Thm 1's corrected ||G_k|| (bounds.attention);
* s_ij bounds ||d2S[D_i, D_j]||_F (ReLU'' = 0 a.e.): s_11 = s_22 = 0, s_12 = ||Y|| (d2S = (D o (Y D_1)) D_2),
  s_1k = ||W_2|| ||J_Y|| g_k, s_2k = ||W_1|| ||J_Y|| g_k, s_kl = (1 + ||W_1|| ||W_2||)(||H_Y|| g_k g_l + ||J_Y|| phi_kl)
  with phi Thm 1's corrected second-derivative bounds;
* ||H(i,j)|| <= c [(||J_Z||^2 + rho ||H_Z||) b_i b_j + ||J_Z|| rho s_ij], and ||H|| <= the spectral norm of the
  5 x 5 matrix of those.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..block import _check_params, _eps
from . import attention as attn
from ._bound import Bound
from ._float import overflow_is_inf
from ._norms import ITERATIONS, TOL, block_norms
from ._paper_block import Sample, block_sample, paper_params, samples_of
from .layernorm import hessian_bound, stated_hessian_bound, stated_jacobian_bound

NAMES = ("W_Q", "W_K", "W_V", "W_1", "W_2")
PAIRS = tuple((a, b) for i, a in enumerate(NAMES) for b in NAMES[i:])  # the 15 blocks
_ATTENTION = ("W_Q", "W_K", "W_V")


def corrected_blocks(s: Sample) -> dict[tuple[str, str], float]:
    c, rho = 2 / (s.L * s.d), s.residual_frobenius
    J_Y, H_Y = 1 / s.sigma_min_S0, hessian_bound(s.sigma_min_S0, s.d)
    J_Z, H_Z = 1 / s.sigma_min_S, hessian_bound(s.sigma_min_S, s.d)
    J_SY = 1 + s.W_1 * s.W_2
    g, phi = attn.first_derivative_bounds(s), attn.second_derivative_bounds(s)
    b = {k: J_SY * J_Y * g[k] for k in _ATTENTION} | {"W_1": s.W_2 * s.Y, "W_2": s.relu}
    second = {("W_1", "W_1"): 0.0, ("W_2", "W_2"): 0.0, ("W_1", "W_2"): s.Y}
    for k in _ATTENTION:
        second[k, "W_1"] = s.W_2 * J_Y * g[k]
        second[k, "W_2"] = s.W_1 * J_Y * g[k]
        for l in _ATTENTION:
            second[k, l] = J_SY * (H_Y * g[k] * g[l] + J_Y * phi[k, l])
    return {(i, j): c * ((J_Z**2 + rho * H_Z) * b[i] * b[j] + J_Z * rho * second[i, j]) for i, j in PAIRS}


def stated_blocks(s: Sample) -> dict[tuple[str, str], float]:
    c, R = 2 / (s.L * s.d), s.residual_frobenius
    Y = np.sqrt(s.L * s.d)  # Prop 10
    J_Y, H_Y = stated_jacobian_bound(s.S0, s.sigma_min_S0, s.d), stated_hessian_bound(s.S0, s.sigma_min_S0, s.L, s.d)
    J_Z, H_Z = stated_jacobian_bound(s.S, s.sigma_min_S, s.d), stated_hessian_bound(s.S, s.sigma_min_S, s.L, s.d)
    J_SY = 1 + s.W_1 * s.W_2
    G, Phi = attn.stated_first_derivative_bounds(s), attn.stated_second_derivative_bounds(s)
    B = {k: J_SY * J_Y * G[k] for k in _ATTENTION} | {"W_1": s.W_2 * Y, "W_2": s.relu}
    xi = {("W_1", "W_1"): 0.0, ("W_2", "W_2"): 0.0, ("W_1", "W_2"): np.sqrt(s.d) * Y}
    for k in _ATTENTION:
        xi[k, "W_1"] = np.sqrt(s.d_ff) * s.W_2 * J_Y * G[k]
        xi[k, "W_2"] = np.sqrt(s.d) * s.W_1 * J_Y * G[k]
        for l in _ATTENTION:
            xi[k, l] = J_SY * (G[k] * H_Y * G[l] + J_Y * Phi[k, l])
    return {(i, j): c * J_Z * B[i] * J_Z * B[j] + R * (J_Z * xi[i, j] + B[i] * H_Z * B[j]) for i, j in PAIRS}


@overflow_is_inf
def theorem6(X: Any, target: Any, params: Any, *, eps: float | None = None, iterations: int = ITERATIONS,
             tol: float = TOL) -> list[Bound]:
    """Thm 6 for the paper's block (``BlockSpec()``) at X (L, d) or a batch (B, L, d) with an mse
    target of Z's shape: the 15 parameter blocks and M_tr. For a batch the loss is the batch mean and
    every bound the mean of the per-sample bounds. ``eps``: the LayerNorms' (default: the spec's);
    ``iterations``, ``tol``: power iteration's, for the exact norms beyond block_norms's DENSE_LIMIT."""
    if not _check_params(params).spec.is_paper_block:
        raise ValueError(f"theorem6 is about the paper's block, BlockSpec(); got {params.spec}")
    W, eps = paper_params(params), _eps(eps, params)
    # The exact norms first: they check X, target (mse's, of X's shape) and params.
    exact = block_norms(X, target, params, eps=eps, iterations=iterations, tol=tol)
    samples = [block_sample(x, t, W, eps) for x, t in zip(samples_of(X), samples_of(target, "target"))]
    corrected = attn._mean([corrected_blocks(s) for s in samples])
    stated = attn._mean([stated_blocks(s) for s in samples])
    bounds = [Bound(f"Thm 6: ||H{attn.pair_label(a, b)}||", exact[a, b], stated[a, b], corrected[a, b],
                    erratum="E11", source="Thm 6") for a, b in PAIRS]
    bounds.append(Bound("Thm 6: M_tr >= ||H||", exact["all", "all"], 5 * max(stated.values()),
                        attn.block_matrix_bound(corrected, NAMES), erratum="E11", source="Thm 6"))
    return bounds
