"""GPU implementations of the public API (private): CuPy arrays in, CuPy arrays out.

The public functions validate and normalise their inputs (float32/float64, C-contiguous, one
dtype, all on the GPU), then call the function of the same name here. Each one runs on the device
of its first array argument and on CuPy's current stream, allocates its outputs with CuPy, and
enqueues the blockhess kernels (through :mod:`blockhess._gpu_launch`) for every per-token,
structured step; dense matrix products go to cuBLAS through CuPy. Like CuPy itself, nothing here
synchronises, except the few checks that must raise in Python: the zero-variance test of LayerNorm
rows (one reduction) and, for cross-entropy, the class-index range (done by the caller).

The code only uses array operations that NumPy and CuPy share, so the tests can run it on NumPy
arrays with an emulation of the launchers (tests/gpu_emulation.py) on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import numpy as np

from . import _backend
from . import _gpu_launch as _k

# ---- helpers ------------------------------------------------------------------------------------


def _xp(a: Any) -> Any:
    return np if isinstance(a, np.ndarray) else _backend.device_module()


def _device(a: Any) -> Any:
    """The device context of a CuPy array (a no-op for the NumPy emulation)."""
    return contextlib.nullcontext() if isinstance(a, np.ndarray) else a.device


def _same_device(*arrays: Any) -> None:
    ids = {a.device.id for a in arrays if a is not None and not isinstance(a, np.ndarray)}
    if len(ids) > 1:
        raise ValueError(f"inputs live on different GPUs (devices {sorted(ids)}); move them to one device first")


def _c(a: Any) -> Any:
    return _xp(a).ascontiguousarray(a)


def _check_sigma(sigma: Any) -> None:
    """The CPU core's zero-variance error, from the row standard deviations the kernels wrote."""
    positive = sigma > 0
    if not bool(positive.all()):
        row = int(_xp(sigma).flatnonzero(~positive)[0])
        raise ValueError(
            f"layernorm: row {row} has zero variance (it is constant up to rounding at its scale); "
            "pass eps > 0 to make LayerNorm differentiable there"
        )


def _outer(u: Any, v: Any) -> Any:
    """Per-row outer products (n, p) x (n, q) -> (n, p, q)."""
    return u[:, :, None] * v[:, None, :]


# ---- LayerNorm ----------------------------------------------------------------------------------


def layernorm(X: Any, eps: float, gamma: Any, beta: Any) -> Any:
    xp = _xp(X)
    _same_device(X, gamma, beta)
    with _device(X):
        Z = xp.empty_like(X)
        sigma = xp.empty(X.shape[0], dtype=X.dtype)
        _k.ln_forward(X, eps, gamma, beta, Z, sigma)
        _check_sigma(sigma)
    return Z


def layernorm_jacobian(X: Any, eps: float, gamma: Any, layout: str, wrt: str) -> Any:
    xp = _xp(X)
    _same_device(X, gamma)
    L, d = X.shape
    with _device(X):
        sigma = xp.empty(L, dtype=X.dtype)
        if wrt == "X" and layout == "dense":
            out = xp.empty((L * d, L * d), dtype=X.dtype)
            _k.ln_jacobian_dense(X, eps, gamma, out, sigma)
        else:
            out = xp.empty((L, d, d), dtype=X.dtype)
            _k.ln_slab(X, eps, gamma, {"X": 0, "gamma": 1, "beta": 2}[wrt], out, sigma)
            if wrt != "X":
                out = out.reshape(L * d, d)
        _check_sigma(sigma)
    return out


def layernorm_hessian(X: Any, eps: float, gamma: Any, layout: str) -> Any:
    xp = _xp(X)
    _same_device(X, gamma)
    L, d = X.shape
    with _device(X):
        sigma = xp.empty(L, dtype=X.dtype)
        if layout == "dense":
            out = xp.empty(((L * d) ** 2, L * d), dtype=X.dtype)
            _k.ln_hessian_dense(X, eps, gamma, out, sigma)
        else:
            out = xp.empty((L, d, d, d), dtype=X.dtype)
            _k.ln_hessian_blocks(X, eps, gamma, out, sigma)
        _check_sigma(sigma)
    return out


def layernorm_hessian_contract(X: Any, G: Any, eps: float, gamma: Any) -> Any:
    xp = _xp(X)
    _same_device(X, G, gamma)
    L, d = X.shape
    with _device(X):
        sigma = xp.empty(L, dtype=X.dtype)
        out = xp.empty((L, d, d), dtype=X.dtype)
        _k.ln_hessian_contract(X, eps, gamma, G, out, sigma)
        _check_sigma(sigma)
    return out


# ---- softmax ------------------------------------------------------------------------------------


def _softmax_rows(T: Any) -> Any:
    A = _xp(T).empty_like(T)
    _k.softmax_forward(T, A)
    return A


def softmax(T: Any) -> Any:
    with _device(T):
        return _softmax_rows(T)


def softmax_jacobian(T: Any, layout: str) -> Any:
    xp = _xp(T)
    m, n = T.shape
    with _device(T):
        A = _softmax_rows(T)
        if layout == "dense":
            out = xp.empty((m * n, m * n), dtype=T.dtype)
            _k.softmax_jacobian_dense(A, out)
        else:
            out = xp.empty((m, n, n), dtype=T.dtype)
            _k.softmax_jacobian_blocks(A, out)
    return out


def softmax_hessian(T: Any, layout: str) -> Any:
    xp = _xp(T)
    m, n = T.shape
    with _device(T):
        A = _softmax_rows(T)
        if layout == "dense":
            out = xp.empty(((m * n) ** 2, m * n), dtype=T.dtype)
            _k.softmax_hessian_dense(A, out)
        else:
            out = xp.empty((m, n, n, n), dtype=T.dtype)
            _k.softmax_hessian_blocks(A, out)
    return out


# ---- commutation / Kronecker --------------------------------------------------------------------


def vec_r(A: Any) -> Any:
    with _device(A):
        return _xp(A).array(A, dtype=A.dtype, order="C").reshape(-1)


def unvec_r(v: Any, m: int, n: int) -> Any:
    with _device(v):
        return _xp(v).array(v, dtype=v.dtype, order="C").reshape(m, n)


def commute(v: Any, m: int, n: int) -> Any:
    with _device(v):
        out = _xp(v).empty_like(v)
        _k.commute(v, m, n, out)
    return out


def commutation_matrix(m: int, n: int, dtype: Any, like: Any) -> Any:
    with _device(like):
        out = _xp(like).empty((m * n, m * n), dtype=dtype)
        _k.commutation_dense(m, n, out)
    return out


def kron_apply(A: Any, B: Any, X: Any) -> Any:
    """vec_r(A X B^T), multiplying in the cheaper order (as the CPU core)."""
    _same_device(A, B, X)
    (p, m), (q, n) = A.shape, B.shape
    with _device(A):
        if p * n * (m + q) <= m * q * (n + p):
            out = (A @ X) @ B.T
        else:
            out = A @ (X @ B.T)
        return _c(out).reshape(-1)


# ---- attention ----------------------------------------------------------------------------------


def _attention_forward(X: Any, W_Q: Any, W_K: Any, W_V: Any):
    c = 1.0 / math.sqrt(W_Q.shape[1])
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    A = _softmax_rows(_c(c * (Q @ K.T)))
    return c, Q, K, V, A, A @ V


def attention(X: Any, W_Q: Any, W_K: Any, W_V: Any) -> Any:
    _same_device(X, W_Q, W_K, W_V)
    with _device(X):
        return _attention_forward(X, W_Q, W_K, W_V)[-1]


def attention_jacobian(X: Any, W_Q: Any, W_K: Any, W_V: Any, wrt: str) -> Any:
    """dF/d(wrt) (L d_v, n_wrt), with the per-token forms of attention.hpp."""
    xp = _xp(X)
    _same_device(X, W_Q, W_K, W_V)
    (L, d), dk, dv = X.shape, W_Q.shape[1], W_V.shape[1]
    with _device(X):
        c, Q, K, V, A, F = _attention_forward(X, W_Q, W_K, W_V)
        if wrt == "W_Q":
            # M_t[a,k] = sum_s A[t,s] V[s,a] (K[s,k] - Kbar_t[k]);  J[t dv + a, b dk + k] = c X[t,b] M_t[a,k]
            M = (A @ _outer(V, K).reshape(L, dv * dk)).reshape(L, dv, dk) - _outer(F, A @ K)
            out = xp.empty((L * dv, d * dk), dtype=X.dtype)
            _k.token_kron(X, _c(M), (d, dk, True), c, out)
        elif wrt == "W_K":
            # N_t[a,b] = sum_s A[t,s] V[s,a] (X[s,b] - Xbar_t[b]);  J[t dv + a, b dk + k] = c q_t[k] N_t[a,b]
            N = (A @ _outer(V, X).reshape(L, dv * d)).reshape(L, dv, d) - _outer(F, A @ X)
            out = xp.empty((L * dv, d * dk), dtype=X.dtype)
            _k.token_kron(_c(Q), _c(N), (d, dk, False), c, out)
        elif wrt == "W_V":
            out = xp.empty((L * dv, d * dv), dtype=X.dtype)
            _k.token_kron(_c(A @ X), None, (d, dv, True), 1.0, out)
        else:
            Qt, Kt = _c(Q @ W_K.T), K @ W_Q.T  # row t: W_K q_t;  row s: W_Q k_s
            D = c * ((A @ _outer(V, Kt).reshape(L, dv * d)).reshape(L, dv, d) - _outer(F, A @ Kt))
            out = xp.empty((L * dv, L * d), dtype=X.dtype)
            _k.attention_dx(A, W_V, _c(V), _c(F), Qt, _c(D), c, out)
    return out


# ---- FFN ----------------------------------------------------------------------------------------


def ffn(Y: Any, W_1: Any, W_2: Any) -> Any:
    xp = _xp(Y)
    _same_device(Y, W_1, W_2)
    with _device(Y):
        H = Y @ W_1
        return xp.where(H > 0, H, 0).astype(Y.dtype, copy=False) @ W_2


def ffn_jacobian(Y: Any, W_1: Any, W_2: Any, wrt: str, layout: str) -> Any:
    xp = _xp(Y)
    _same_device(Y, W_1, W_2)
    (L, d), f, e = Y.shape, W_1.shape[1], W_2.shape[1]
    with _device(Y):
        H = Y @ W_1
        mask = (H > 0).astype(Y.dtype)
        if layout == "kron":  # the per-token Kronecker factors (U, V) of ffn.ffn_jacobian
            if wrt == "W_1":
                return Y.copy(), _c(W_2.T[None, :, :] * mask[:, None, :])
            return _c(H * mask), xp.broadcast_to(xp.eye(e, dtype=Y.dtype), (L, e, e))
        if wrt == "W_1":  # J[t e + c, b f + g] = Y[t,b] (W_2^T D_t)[c,g]
            out = xp.empty((L * e, d * f), dtype=Y.dtype)
            _k.token_kron(Y, _c(W_2.T[None, :, :] * mask[:, None, :]), (d, f, True), 1.0, out)
            return out
        if wrt == "W_2":  # relu(H) (x) I_e
            out = xp.empty((L * e, f * e), dtype=Y.dtype)
            _k.token_kron(_c(H * mask), None, (f, e, True), 1.0, out)
            return out
        blocks = _c((W_2.T[None, :, :] * mask[:, None, :]) @ W_1.T)  # (L, e, d): W_2^T D_t W_1^T
        if layout == "blocks":
            return blocks
        out = xp.empty((L * e, L * d), dtype=Y.dtype)
        _k.blockdiag_dense(blocks, out)
    return out


def ffn_cross_hessian(Y: Any, W_1: Any, W_2: Any, layout: str) -> Any:
    xp = _xp(Y)
    _same_device(Y, W_1, W_2)
    (L, d), f, e = Y.shape, W_1.shape[1], W_2.shape[1]
    with _device(Y):
        C = _c(_outer(Y, ((Y @ W_1) > 0).astype(Y.dtype)))  # (L, d, f): Y[t,b] 1[H[t,g] > 0]
        if layout == "blocks":
            return C
        out = xp.empty((L * e * d * f, f * e), dtype=Y.dtype)
        _k.ffn_cross_dense(C, e, out)
    return out


# ---- the Transformer block ----------------------------------------------------------------------

W_Q, W_K, W_V, W_1, W_2 = range(5)
_ATTN = (W_Q, W_K, W_V)
_GAMMA_BUDGET = 256 * 2**20  # bytes of per-token Gamma matrices formed at once


def _ln_vjp(y: Any, sigma: Any, g: Any) -> Any:
    """J^T g for LayerNorm rows without affine: (g - mean(g) - y (y.g)/d) / sigma (block.hpp)."""
    d = y.shape[1]
    mean = g.sum(axis=1, keepdims=True) / d
    yg = (y * g).sum(axis=1, keepdims=True) / d
    return (g - mean - y * yg) / sigma[:, None]


class _Block:
    """Forward caches and per-token factors of the block for a batch X3 (B, L, d): the GPU twin of
    block.hpp / block_hessian.hpp (the same per-node decomposition and per-token factors)."""

    def __init__(self, X3: Any, weights: tuple[Any, ...], eps: float) -> None:
        self.xp = _xp(X3)
        _same_device(X3, *weights)
        self.weights = weights
        self.eps = float(eps)
        WQ, WK, WV, W1, W2 = weights
        B, L, d = X3.shape
        dk, dff = WQ.shape[1], W1.shape[1]
        self.B, self.L, self.d, self.dk, self.dff, self.n = B, L, d, dk, dff, B * L
        self.dtype = X3.dtype
        n = self.n
        self.s = 1.0 / math.sqrt(dk)
        self.X3 = X3
        self.X = X = X3.reshape(n, d)
        self.Q, self.K, self.V = X @ WQ, X @ WK, X @ WV
        logits = self.s * (self.Q.reshape(B, L, dk) @ self.K.reshape(B, L, dk).transpose(0, 2, 1))
        self.A = _softmax_rows(_c(logits.reshape(n, L)))  # (n, L): row t is a_t
        self.A3 = self.A.reshape(B, L, L)
        self.F = (self.A3 @ self.V.reshape(B, L, d)).reshape(n, d)
        self.S0 = _c(X + self.F)
        self.Y, self.sigma1 = self._layernorm(self.S0)
        self.H1 = self.Y @ W1
        self.mask = (self.H1 > 0).astype(self.dtype)
        self.R = self.H1 * self.mask
        self.S = _c(self.R @ W2 + self.Y)
        self.Z, self.sigma2 = self._layernorm(self.S)
        self.splits = ((d, dk, True), (d, dk, False), (d, d, True), (d, dff, True), (dff, d, True))
        self._factors: tuple | None = None

    def _layernorm(self, S: Any):
        y = self.xp.empty_like(S)
        sigma = self.xp.empty(S.shape[0], dtype=self.dtype)
        _k.ln_forward(S, self.eps, None, None, y, sigma)
        _check_sigma(sigma)
        return y, sigma

    def _ln_jacobian(self, S: Any) -> Any:
        J = self.xp.empty((self.n, self.d, self.d), dtype=self.dtype)
        _k.ln_slab(S, self.eps, None, 0, J, None)
        return J

    def _ln_contract(self, S: Any, G: Any) -> Any:
        C = self.xp.empty((self.n, self.d, self.d), dtype=self.dtype)
        _k.ln_hessian_contract(S, self.eps, None, _c(G), C, None)
        return C

    # -- losses and the reverse pass --

    def loss(self, kind: int, values: Any, classes: Any, with_hessian: bool):
        """(value, gZ (n, d), omega) with omega = J_Z^T H_l J_Z per token when with_hessian."""
        xp, n, d = self.xp, self.n, self.d
        if kind == 0:
            c = 1.0 / (n * d)
            r = self.Z - values.reshape(n, d)
            value = c * (r * r).sum()
            gZ = (2 * c) * r
            hess = None
        else:
            c = 1.0 / n
            p = _softmax_rows(self.Z)
            onehot = xp.zeros_like(p)
            onehot[xp.arange(n), classes.reshape(n)] = 1
            # log-sum-exp minus the class's logit: -log p[class] is -log 0 = Inf once p[class] underflows.
            top = self.Z.max(axis=1)
            gap = top - (self.Z * onehot).sum(axis=1)
            value = c * (gap + xp.log(xp.exp(self.Z - top[:, None]).sum(axis=1))).sum()
            gZ = c * (p - onehot)
            hess = c * (xp.eye(d, dtype=self.dtype)[None, :, :] * p[:, None, :] - _outer(p, p)) if with_hessian else None
        omega = None
        if with_hessian:
            JZ = self._ln_jacobian(self.S)
            JZt = JZ.transpose(0, 2, 1)
            omega = (2 * c) * (JZt @ JZ) if hess is None else JZt @ hess @ JZ
        return value, _c(gZ), omega

    def reverse(self, gZ: Any) -> dict[str, Any]:
        W1, W2 = self.weights[3], self.weights[4]
        B, L, d, n = self.B, self.L, self.d, self.n
        r: dict[str, Any] = {}
        r["gS"] = gS = _ln_vjp(self.Z, self.sigma2, gZ)
        r["gH1"] = gH1 = (gS @ W2.T) * self.mask
        r["gY"] = gY = gH1 @ W1.T + gS
        r["gF"] = gF = _ln_vjp(self.Y, self.sigma1, gY)
        r["gA"] = gA = _c((gF.reshape(B, L, d) @ self.V.reshape(B, L, d).transpose(0, 2, 1)).reshape(n, L))
        gT = self.xp.empty_like(gA)
        _k.softmax_vjp(self.A, gA, gT)
        r["gT"] = gT
        return r

    def weight_gradient(self, r: dict[str, Any]) -> Any:
        B, L, d, dk = self.B, self.L, self.d, self.dk
        X3t = self.X3.transpose(0, 2, 1)
        gT3 = r["gT"].reshape(B, L, L)
        K3, Q3 = self.K.reshape(B, L, dk), self.Q.reshape(B, L, dk)
        gQ = self.s * (X3t @ (gT3 @ K3)).sum(axis=0)
        gK = self.s * (X3t @ (gT3.transpose(0, 2, 1) @ Q3)).sum(axis=0)
        gV = (X3t @ (self.A3.transpose(0, 2, 1) @ r["gF"].reshape(B, L, d))).sum(axis=0)
        gW1 = self.Y.T @ r["gH1"]
        gW2 = self.R.T @ r["gS"]
        return self.xp.concatenate([g.reshape(-1) for g in (gQ, gK, gV, gW1, gW2)])

    # -- per-token factors (block_hessian.hpp's factorize) --

    def factors(self):
        if self._factors is not None:
            return self._factors
        xp = self.xp
        WQ, WK, WV, W1, W2 = self.weights
        B, L, d, dk, n = self.B, self.L, self.d, self.dk, self.n
        A3 = self.A3
        K3, X3, V3 = self.K.reshape(B, L, dk), self.X3, self.V.reshape(B, L, d)
        AX = (A3 @ X3).reshape(n, d)
        vec = (self.X, _c(self.s * self.Q), _c(AX), self.Y, _c(self.R))
        # Derivatives of F: Mq = s (V^T Jsm K), Mk = V^T Jsm X, I for W_V (Jsm_t = diag(a_t) - a_t a_t^T).
        Kbar = (A3 @ K3).reshape(n, dk)
        Mq = self.s * ((A3 @ _outer(V3.reshape(n, d), K3.reshape(n, dk)).reshape(B, L, d * dk)).reshape(n, d, dk)
                       - _outer(self.F, Kbar))
        Mk = (A3 @ _outer(V3.reshape(n, d), self.X).reshape(B, L, d * d)).reshape(n, d, d) - _outer(self.F, AX)
        UF = (_c(Mq), _c(Mk), None)
        JY = self._ln_jacobian(self.S0)
        W2m = W2.T[None, :, :] * self.mask[:, None, :]  # (n, d, dff): W_2^T diag(mask_t)
        JSY = W2m @ W1.T + xp.eye(d, dtype=self.dtype)[None, :, :]
        UY = (JY @ UF[0], JY @ UF[1], JY)
        US = (JSY @ UY[0], JSY @ UY[1], JSY @ UY[2], _c(W2m), None)
        self._factors = (vec, UF, UY, US)
        return self._factors

    # -- assembly --

    def _accumulate(self, H: Any, off: list[int], i: int, j: int, u: Any, si, w: Any, sj, gamma: Callable,
                    upper: bool = False) -> None:
        """H[block(i, j)] += sum_t u_t (x) w_t (x) Gamma_t, Gamma formed a few samples at a time."""
        ri = si[1] if si[2] else si[0]
        rj = sj[1] if sj[2] else sj[0]
        per_sample = self.L * ri * rj * np.dtype(self.dtype).itemsize
        step = max(1, min(self.B, _GAMMA_BUDGET // max(per_sample, 1)))
        for b0 in range(0, self.B, step):
            b1 = min(self.B, b0 + step)
            t0, t1 = b0 * self.L, b1 * self.L
            G = _c(gamma(b0, b1))
            _k.kron_accumulate(_c(u[t0:t1]), si, _c(w[t0:t1]), sj, G, 1.0, H, off[i], off[j], upper)

    @staticmethod
    def _sandwich(U: Any, OmV: Any) -> Any:
        """U^T (Om V) per token, given Om V; U None stands for the identity."""
        return OmV if U is None else U.transpose(0, 2, 1) @ OmV

    def assemble(self, r: dict[str, Any], gZ: Any, omega: Any, part: str, selected: list[bool], H: Any,
                 off: list[int]) -> None:
        xp = self.xp
        B, L, d, dk, dff, n = self.B, self.L, self.d, self.dk, self.dff, self.n
        vec, UF, UY, US = self.factors()
        sp = self.splits
        sel = [p for p in range(5) if selected[p]]
        outer = part != "functional" and omega is not None
        functional = part != "outer"
        T = lambda a, t0, t1: None if a is None else a[t0:t1]  # noqa: E731

        # Curvature at S: J_Z^T H_l J_Z (outer) + the second LayerNorm contracted with gZ (functional).
        OmS = omega if outer else xp.zeros((n, d, d), dtype=self.dtype)
        if functional:
            OmS = OmS + self._ln_contract(self.S, gZ)
        OmUS = {j: OmS if US[j] is None else OmS @ US[j] for j in sel}  # shared by every pair (i, j)
        for i in sel:
            for j in sel:
                if j >= i:
                    self._accumulate(
                        H, off, i, j, vec[i], sp[i], vec[j], sp[j],
                        lambda b0, b1, i=i, j=j: self._sandwich(T(US[i], b0 * L, b1 * L), OmUS[j][b0 * L:b1 * L]),
                        upper=i == j,
                    )
        if not functional:
            return

        W1 = self.weights[3]
        gS, gH1, gY, gF, gA, gT = r["gS"], r["gH1"], r["gY"], r["gF"], r["gA"], r["gT"]
        # <gY, LN1''[dF, dF]> over the attention weights.
        OmF = self._ln_contract(self.S0, gY)
        OmUF = {j: OmF if UF[j] is None else OmF @ UF[j] for j in _ATTN if selected[j]}
        for i in (p for p in _ATTN if selected[p]):
            for j in (p for p in _ATTN if selected[p] and p >= i):
                self._accumulate(
                    H, off, i, j, vec[i], sp[i], vec[j], sp[j],
                    lambda b0, b1, i=i, j=j: self._sandwich(T(UF[i], b0 * L, b1 * L), OmUF[j][b0 * L:b1 * L]),
                    upper=i == j,
                )
        for i in (p for p in _ATTN if selected[p]):
            UYi = UY[i]
            # 2<gH1, dY dW_1>: W_1 split by columns, vector gH1_t, Gamma_t = UY_i,t^T.
            if selected[W_1]:
                self._accumulate(
                    H, off, i, W_1, vec[i], sp[i], gH1, (d, dff, False),
                    lambda b0, b1, U=UYi: U[b0 * L:b1 * L].transpose(0, 2, 1),
                )
            # 2<gS, dR dW_2>: W_2 split by columns, vector gS_t, Gamma_t = mask_t * (UY_i,t^T W_1).
            if selected[W_2]:
                self._accumulate(
                    H, off, i, W_2, vec[i], sp[i], gS, (dff, d, False),
                    lambda b0, b1, U=UYi: (U[b0 * L:b1 * L].transpose(0, 2, 1) @ W1)
                    * self.mask[b0 * L:b1 * L][:, None, :],
                )
        # 2<gS, dR dW_2> with dR = mask * (Y dW_1): (W_1, W_2), diagonal in the hidden unit k.
        if selected[W_1] and selected[W_2]:
            M = (_outer(self.mask, self.Y).reshape(n, dff * d).T @ gS).reshape(dff, d, d)  # [k, b, c]
            view = _strided(H, off[W_1], off[W_2], shape=(d, dff, d), steps=((dff, 0), (1, d), (0, 1)))
            view += M.transpose(1, 0, 2)  # H[(b dff + k), k d + c] += M[k, b, c]
        # Attention: <gA, softmax''[dT, dT]> with logit factors U_Q = s K (vector x_t), U_K = X (vector s q_t).
        U = {W_Q: self.s * self.K.reshape(B, L, dk), W_K: self.X3}
        qk = [p for p in (W_Q, W_K) if selected[p]]
        if qk:
            Hs = xp.empty((n, L, L), dtype=self.dtype)
            _k.softmax_hessian_contract(self.A, gA, Hs)
            Hs4 = Hs.reshape(B, L, L, L)
            for i in qk:
                for j in (p for p in qk if p >= i):
                    self._accumulate(
                        H, off, i, j, vec[i], sp[i], vec[j], sp[j],
                        lambda b0, b1, i=i, j=j: (
                            U[i][b0:b1, None].transpose(0, 1, 3, 2) @ Hs4[b0:b1] @ U[j][b0:b1, None]
                        ).reshape((b1 - b0) * L, U[i].shape[2], U[j].shape[2]),
                        upper=i == j,
                    )
        # 2<gF, dA dV> with dV = X dW_V: (W_Q or W_K, W_V), W_V split by columns, vector gF_t,
        # Gamma_t = U^T Jsm_t X = U^T diag(a_t) X - (a_t^T U)^T (a_t^T X).
        if selected[W_V]:
            for i in qk:
                def gamma_v(b0: int, b1: int, i: int = i) -> Any:
                    Ui, A3, X3 = U[i][b0:b1], self.A3[b0:b1], self.X3[b0:b1]
                    first = (Ui.transpose(0, 2, 1)[:, None, :, :] * A3[:, :, None, :]) @ X3[:, None, :, :]
                    Ubar, Xbar = (A3 @ Ui).reshape(-1, Ui.shape[2]), (A3 @ X3).reshape(-1, d)
                    return first.reshape(-1, Ui.shape[2], d) - _outer(Ubar, Xbar)

                self._accumulate(H, off, i, W_V, vec[i], sp[i], gF, (d, d, False), gamma_v)
        # 2<gT, dQ dK^T>/sqrt(dk): (W_Q, W_K), diagonal in the key index k.
        if selected[W_Q] and selected[W_K]:
            X3t = self.X3.transpose(0, 2, 1)
            M = self.s * (X3t @ gT.reshape(B, L, L) @ self.X3).sum(axis=0)  # (d, d): [bq, bk]
            view = _strided(H, off[W_Q], off[W_K], shape=(d, dk, d), steps=((dk, 0), (1, 1), (0, dk)))
            view += M[:, None, :]  # H[(bq dk + k), bk dk + k] += M[bq, bk]


def _strided(H: Any, row0: int, col0: int, shape: tuple[int, ...], steps: tuple[tuple[int, int], ...]) -> Any:
    """A writable view of H starting at (row0, col0); axis k advances steps[k] = (rows, cols)."""
    xp = _xp(H)
    ld, item = H.shape[1], H.itemsize
    strides = tuple((r * ld + c) * item for r, c in steps)
    base = H.reshape(-1)[row0 * ld + col0:]
    return xp.lib.stride_tricks.as_strided(base, shape=shape, strides=strides)


def _offsets(sizes: tuple[int, ...], selected: list[bool]) -> tuple[list[int], int]:
    off, total = [], 0
    for size, keep in zip(sizes, selected):
        off.append(total)
        total += size if keep else 0
    return off, total


def _sizes(blk: _Block) -> tuple[int, ...]:
    d, dk, dff = blk.d, blk.dk, blk.dff
    return (d * dk, d * dk, d * d, d * dff, dff * d)


def block_forward(X3: Any, weights: tuple[Any, ...], eps: float) -> Any:
    with _device(X3):
        return _Block(X3, weights, eps).Z.reshape(X3.shape)


def block_jacobian(X3: Any, weights: tuple[Any, ...], eps: float, p: int) -> Any:
    xp = _xp(X3)
    with _device(X3):
        blk = _Block(X3, weights, eps)
        vec, _, _, US = blk.factors()
        JZ = blk._ln_jacobian(blk.S)
        M = JZ if US[p] is None else JZ @ US[p]
        out = xp.empty((blk.n * blk.d, _sizes(blk)[p]), dtype=blk.dtype)
        _k.token_kron(vec[p], _c(M), blk.splits[p], 1.0, out)
    return out


def block_output_hessian(X3: Any, weights: tuple[Any, ...], eps: float, i: int, j: int) -> Any:
    """For each output entry o: the (i, j) block of the Hessian of Z_o (cotangent e_o)."""
    xp = _xp(X3)
    with _device(X3):
        blk = _Block(X3, weights, eps)
        sizes = _sizes(blk)
        selected = [p in (i, j) for p in range(5)]
        off, P = _offsets(sizes, selected)
        ni, nj = sizes[i], sizes[j]
        m = blk.n * blk.d
        out = xp.empty((m * ni, nj), dtype=blk.dtype)
        gZ = xp.zeros((blk.n, blk.d), dtype=blk.dtype)
        flat = gZ.reshape(-1)
        for o in range(m):
            flat[o] = 1
            H = xp.zeros((P, P), dtype=blk.dtype)
            blk.assemble(blk.reverse(gZ), gZ, None, "functional", selected, H, off)
            _k.mirror_upper(H)  # the (i, j) block may lie below the diagonal
            out[o * ni:(o + 1) * ni] = H[off[i]:off[i] + ni, off[j]:off[j] + nj]
            flat[o] = 0
    return out


def loss_value(X3: Any, weights: tuple[Any, ...], eps: float, kind: int, values: Any, classes: Any) -> float:
    with _device(X3):
        return float(_Block(X3, weights, eps).loss(kind, values, classes, False)[0])


def loss_gradient(X3: Any, weights: tuple[Any, ...], eps: float, kind: int, values: Any, classes: Any) -> Any:
    with _device(X3):
        blk = _Block(X3, weights, eps)
        _, gZ, _ = blk.loss(kind, values, classes, False)
        return blk.weight_gradient(blk.reverse(gZ))


def loss_hessian(X3: Any, weights: tuple[Any, ...], eps: float, kind: int, values: Any, classes: Any, part: int,
                 selected: list[bool], out: Any = None) -> Any:
    """The (P, P) symmetric loss Hessian over the selected parameters; part 0 full, 1 outer, 2 functional.
    Written into ``out`` (checked by the caller) when given."""
    xp = _xp(X3)
    part_name = ("full", "outer", "functional")[part]
    with _device(X3):
        blk = _Block(X3, weights, eps)
        _, gZ, omega = blk.loss(kind, values, classes, part_name != "functional")
        off, P = _offsets(_sizes(blk), selected)
        if out is None:
            H = xp.zeros((P, P), dtype=blk.dtype)
        else:
            H = out
            H.fill(0)  # the assembly accumulates
        r = blk.reverse(gZ) if part_name != "outer" else {}
        blk.assemble(r, gZ, omega, part_name, selected, H, off)
        _k.mirror_upper(H)
    return H
