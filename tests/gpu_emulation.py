"""A NumPy stand-in for the ``blockhess._cuda`` kernel entry points, for machines without a GPU.

``FakeCuda`` has the same ``<name>_f32`` / ``<name>_f64`` functions with the same arguments as the
real module (pointers as integers, sizes, scalars, stream). Pointers are the addresses of NumPy
arrays registered by the patched ``_gpu_launch._ptr``; each function resolves them back to views
and computes what the CUDA kernel computes, written straight from the formulas in the launcher
headers (cuda/include/blockhess/cuda/*.hpp), not from the kernels. With it, the real
``blockhess._gpu`` + ``blockhess._gpu_launch`` code runs on NumPy arrays: the tests check the
orchestration, the argument marshalling and the launcher contracts; only the kernel bodies
themselves need a GPU.
"""

from __future__ import annotations

import numpy as np

_DTYPES = {"f32": np.dtype(np.float32), "f64": np.dtype(np.float64)}


class FakeCuda:
    def __init__(self) -> None:
        self._arrays: dict[int, np.ndarray] = {}
        self.calls: list[str] = []

    # -- pointer registry --

    def register(self, a) -> int:
        if a is None:
            return 0
        assert isinstance(a, np.ndarray) and a.flags.c_contiguous, "kernels only ever see C-contiguous arrays"
        self._arrays[id(a)] = a
        return int(a.__array_interface__["data"][0])

    def _view(self, addr: int, dtype, shape, strides=None):
        """The registered memory at addr as an array of the given shape (and byte strides)."""
        if addr == 0:
            return None
        dtype = np.dtype(dtype)
        if strides is None:
            strides = tuple(int(s) * dtype.itemsize for s in _c_strides(shape))
        extent = sum((n - 1) * s for n, s in zip(shape, strides)) + dtype.itemsize if min(shape, default=1) else 0
        seen = False
        for a in self._arrays.values():  # several registered views may share memory: take one that holds it all
            base = int(a.__array_interface__["data"][0])
            if not base <= addr < base + max(a.nbytes, 1):
                continue
            seen = True
            offset = addr - base
            if offset + extent > a.nbytes:
                continue
            assert a.dtype == dtype, f"pointer of a {a.dtype} array passed as {dtype}"
            assert offset % dtype.itemsize == 0
            flat = a.reshape(-1)[offset // dtype.itemsize:]
            return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=strides)
        raise AssertionError("kernel would access past the array" if seen else f"unknown device pointer {addr:#x}")

    def __getattr__(self, name: str):
        base, _, suffix = name.rpartition("_")
        if suffix not in _DTYPES or not hasattr(type(self), "k_" + base):
            raise AttributeError(name)
        dtype = _DTYPES[suffix]
        impl = getattr(self, "k_" + base)

        def call(*args, **kwargs):
            self.calls.append(base)
            return impl(dtype, *args, **kwargs)

        return call

    def device_count(self) -> int:
        return 0

    def synchronize(self, stream) -> None:
        pass

    # -- LayerNorm --

    def _ln(self, dt, X, L, d, eps, gamma):
        x = self._view(X, dt, (L, d))
        g = self._view(gamma, dt, (d,))
        with np.errstate(divide="ignore", invalid="ignore"):
            m = x - x.mean(axis=1, keepdims=True)
            sigma = np.sqrt((m * m).mean(axis=1) + eps)
            y = m / sigma[:, None]
        return y, sigma, (np.ones(d, dtype=dt) if g is None else g)

    def _sigma_out(self, dt, sigma_ptr, L, sigma):
        s = self._view(sigma_ptr, dt, (L,))
        if s is not None:
            s[...] = sigma

    def _ln_jacobian(self, y, sigma, g):
        L, d = y.shape
        with np.errstate(divide="ignore", invalid="ignore"):
            Pc = np.eye(d) - 1.0 / d
            return (g[None, :, None] / sigma[:, None, None]) * (Pc[None] - y[:, :, None] * y[:, None, :] / d)

    def _ln_hessian(self, y, sigma, g):
        L, d = y.shape
        Pc = np.eye(d) - 1.0 / d
        with np.errstate(divide="ignore", invalid="ignore"):
            t = (np.einsum("ab,ic->iabc", Pc, y) + np.einsum("ac,ib->iabc", Pc, y) + np.einsum("bc,ia->iabc", Pc, y)
                 - 3.0 / d * np.einsum("ia,ib,ic->iabc", y, y, y))
            return -(g[None, :, None, None] / (d * sigma[:, None, None, None] ** 2)) * t

    def k_layernorm_forward(self, dt, X, L, d, eps, gamma, beta, Z, sigma, stream):
        y, s, g = self._ln(dt, X, L, d, eps, gamma)
        b = self._view(beta, dt, (d,))
        self._view(Z, dt, (L, d))[...] = g * y + (0 if b is None else b)
        self._sigma_out(dt, sigma, L, s)

    def k_layernorm_jacobian_blocks(self, dt, X, L, d, eps, gamma, kind, out, sigma, stream, tile_elems=0):
        y, s, g = self._ln(dt, X, L, d, eps, gamma)
        o = self._view(out, dt, (L, d, d))
        if kind == 0:
            o[...] = self._ln_jacobian(y, s, g)
        elif kind == 1:
            o[...] = np.eye(d)[None] * y[:, :, None]
        else:
            o[...] = np.eye(d)[None]
        self._sigma_out(dt, sigma, L, s)

    def k_layernorm_jacobian_dense(self, dt, X, L, d, eps, gamma, out, sigma, stream):
        y, s, g = self._ln(dt, X, L, d, eps, gamma)
        o = self._view(out, dt, (L, d, L, d))
        o[...] = 0
        J = self._ln_jacobian(y, s, g)
        for i in range(L):
            o[i, :, i, :] = J[i]
        self._sigma_out(dt, sigma, L, s)

    def k_layernorm_hessian_blocks(self, dt, X, L, d, eps, gamma, out, sigma, stream):
        y, s, g = self._ln(dt, X, L, d, eps, gamma)
        self._view(out, dt, (L, d, d, d))[...] = self._ln_hessian(y, s, g)
        self._sigma_out(dt, sigma, L, s)

    def k_layernorm_hessian_dense(self, dt, X, L, d, eps, gamma, out, sigma, stream):
        y, s, g = self._ln(dt, X, L, d, eps, gamma)
        o = self._view(out, dt, (L, d, L, d, L, d))
        o[...] = 0
        H = self._ln_hessian(y, s, g)
        for i in range(L):
            o[i, :, i, :, i, :] = H[i]
        self._sigma_out(dt, sigma, L, s)

    def k_layernorm_hessian_contract(self, dt, X, L, d, eps, gamma, G, out, sigma, stream):
        y, s, g = self._ln(dt, X, L, d, eps, gamma)
        self._view(out, dt, (L, d, d))[...] = np.einsum("ia,iabc->ibc", self._view(G, dt, (L, d)), self._ln_hessian(y, s, g))
        self._sigma_out(dt, sigma, L, s)

    # -- softmax --

    def k_softmax_forward(self, dt, T, m, n, A, stream):
        t = self._view(T, dt, (m, n))
        e = np.exp(t - t.max(axis=1, keepdims=True))
        self._view(A, dt, (m, n))[...] = e / e.sum(axis=1, keepdims=True)

    @staticmethod
    def _sm_jacobian(a):
        n = a.shape[1]
        return a[:, :, None] * (np.eye(n)[None] - a[:, None, :])

    @staticmethod
    def _sm_hessian(a):
        n = a.shape[1]
        I = np.eye(n)
        t = (2 * np.einsum("ik,il->ikl", a, a)[:, None] + np.einsum("jk,jl->jkl", I, I)[None]
             - (I[None, None] * a[:, None, :, None]) - np.einsum("jk,il->ijkl", I, a) - np.einsum("jl,ik->ijkl", I, a))
        return a[:, :, None, None] * t

    def k_softmax_jacobian_blocks(self, dt, A, m, n, out, stream):
        self._view(out, dt, (m, n, n))[...] = self._sm_jacobian(self._view(A, dt, (m, n)))

    def k_softmax_jacobian_dense(self, dt, A, m, n, out, stream):
        o = self._view(out, dt, (m, n, m, n))
        o[...] = 0
        J = self._sm_jacobian(self._view(A, dt, (m, n)))
        for i in range(m):
            o[i, :, i, :] = J[i]

    def k_softmax_hessian_blocks(self, dt, A, m, n, out, stream):
        self._view(out, dt, (m, n, n, n))[...] = self._sm_hessian(self._view(A, dt, (m, n)))

    def k_softmax_hessian_dense(self, dt, A, m, n, out, stream):
        o = self._view(out, dt, (m, n, m, n, m, n))
        o[...] = 0
        H = self._sm_hessian(self._view(A, dt, (m, n)))
        for i in range(m):
            o[i, :, i, :, i, :] = H[i]

    def k_softmax_hessian_contract(self, dt, A, G, m, n, out, stream):
        a, g = self._view(A, dt, (m, n)), self._view(G, dt, (m, n))
        w = a * (g - (a * g).sum(axis=1, keepdims=True))
        self._view(out, dt, (m, n, n))[...] = (np.eye(n)[None] * w[:, None, :]) - a[:, :, None] * w[:, None, :] - w[:, :, None] * a[:, None, :]

    def k_softmax_vjp(self, dt, A, G, m, n, out, stream):
        a, g = self._view(A, dt, (m, n)), self._view(G, dt, (m, n))
        self._view(out, dt, (m, n))[...] = a * (g - (a * g).sum(axis=1, keepdims=True))

    # -- assembly --

    def k_commute(self, dt, v, m, n, cols, out, stream):
        src = self._view(v, dt, (n, m, cols))
        self._view(out, dt, (m, n, cols))[...] = src.transpose(1, 0, 2)

    def k_commutation_dense(self, dt, m, n, out, stream):
        K = self._view(out, dt, (m * n, m * n))
        K[...] = 0
        r = np.arange(m * n)
        K[r, (r % n) * m + r // n] = 1

    def k_token_kron(self, dt, tokens, R, n_first, n_second, vec_on_first, u, M, scale, out, stream):
        n_vec, n_mat = (n_first, n_second) if vec_on_first else (n_second, n_first)
        uu = self._view(u, dt, (tokens, n_vec))
        MM = self._view(M, dt, (tokens, R, n_mat))
        if MM is None:
            assert R == n_mat
            MM = np.broadcast_to(np.eye(R, dtype=dt), (tokens, R, R))
        spec = "to,tar->taor" if vec_on_first else "to,tar->taro"
        self._view(out, dt, (tokens * R, n_first * n_second))[...] = scale * np.einsum(spec, uu, MM).reshape(tokens * R, -1)

    def k_kron_accumulate(self, dt, tokens, i_first, i_second, i_vfirst, u, j_first, j_second, j_vfirst, w, Gamma,
                          alpha, H, ldH, upper_only, stream):
        noi, nri = (i_first, i_second) if i_vfirst else (i_second, i_first)
        noj, nrj = (j_first, j_second) if j_vfirst else (j_second, j_first)
        uu, ww = self._view(u, dt, (tokens, noi)), self._view(w, dt, (tokens, noj))
        G = self._view(Gamma, dt, (tokens, nri, nrj))
        rows = "OR" if i_vfirst else "RO"  # O: vector index, R: matrix index of parameter i
        cols = "PS" if j_vfirst else "SP"
        block = alpha * np.einsum(f"tO,tP,tRS->{rows}{cols}", uu, ww, G).reshape(i_first * i_second, j_first * j_second)
        ni, nj = block.shape
        item = np.dtype(dt).itemsize
        target = self._view(H, dt, (ni, nj), strides=(ldH * item, item))
        if upper_only:
            block = np.triu(block)
        target += block

    def k_mirror_upper(self, dt, H, n, ld, stream):
        item = np.dtype(dt).itemsize
        M = self._view(H, dt, (n, n), strides=(ld * item, item))
        lower = np.tril_indices(n, -1)
        M[lower] = M.T[lower]

    def k_blockdiag_dense(self, dt, blocks, tokens, r, c, out, stream):
        b = self._view(blocks, dt, (tokens, r, c))
        o = self._view(out, dt, (tokens, r, tokens, c))
        o[...] = 0
        for t in range(tokens):
            o[t, :, t, :] = b[t]

    def k_attention_dx(self, dt, A, WV, V, F, Qt, D, L, d, dv, c, out, stream):
        a = self._view(A, dt, (L, L))
        wv = self._view(WV, dt, (d, dv))
        v, f = self._view(V, dt, (L, dv)), self._view(F, dt, (L, dv))
        qt, DD = self._view(Qt, dt, (L, d)), self._view(D, dt, (L, dv, d))
        o = np.einsum("tu,ba->taub", a, wv) + c * np.einsum("tu,tua,tb->taub", a, v[None, :, :] - f[:, None, :], qt)
        for t in range(L):
            o[t, :, t, :] += DD[t]
        self._view(out, dt, (L * dv, L * d))[...] = o.reshape(L * dv, L * d)

    def k_ffn_cross_dense(self, dt, C, L, d, f, e, out, stream):
        CC = self._view(C, dt, (L, d, f))
        o = self._view(out, dt, (L, e, d, f, f, e))
        o[...] = 0
        for g in range(f):
            for c in range(e):
                o[:, c, :, g, g, c] = CC[:, :, g]


def install(monkeypatch) -> FakeCuda:
    """Route blockhess._gpu_launch to a FakeCuda; returns it (its .calls lists the kernels run)."""
    from blockhess import _gpu_launch

    fake = FakeCuda()
    monkeypatch.setattr(_gpu_launch, "_ptr", fake.register)
    monkeypatch.setattr(_gpu_launch, "_stream", lambda: 0)
    monkeypatch.setattr(_gpu_launch, "_fn", lambda name, dtype: getattr(fake, name + {4: "_f32", 8: "_f64"}[np.dtype(dtype).itemsize]))
    return fake


def _c_strides(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))
