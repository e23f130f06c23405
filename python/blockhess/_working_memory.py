"""Working memory of the core's calls, in bytes: what each C++ entry point allocates besides its
result, so that the memory budget covers every allocation that grows with the input.

Each function mirrors the buffers of the C++ code named in its docstring (a slight over-count is
intended: the budget is a guard, not an accountant). tests/test_trust.py checks them against the
peak memory of real calls.
"""

from __future__ import annotations

# kron::accumulate packs at most 2^22 Gamma entries per chunk and forms per-task products of about
# the same size on each of (at most) a few threads.
_KRON_CHUNK = 2**22


def layernorm(L: int, d: int, itemsize: int, *, dense_hessian: bool = False) -> int:
    """bind_layernorm.cpp: y (L, d) and sigma (L); a (d, d, d) row for the dense second derivative."""
    return itemsize * (L * d + L + (d**3 if dense_hessian else 0))


def softmax(m: int, n: int, itemsize: int) -> int:
    """bind_softmax.cpp: A (m, n)."""
    return itemsize * m * n


def attention(L: int, d: int, dk: int, dv: int, itemsize: int, wrt: str | None = None) -> int:
    """components.hpp on the engine's attention node: copies of X and the weights, Q, K, V, the
    logits and A (L, L), F; for a weight's Jacobian its tangent factors at F (engine/derivatives.hpp
    jacobian), for X the node's closed form's Q W_K^T and K W_Q^T (AttentionNode::input_jacobian)."""
    cache = 2 * L * L + L * (d + 2 * dk + 2 * dv) + d * (2 * dk + dv)
    extra = {None: 0, "W_Q": L * dv * dk + dv * d * dk, "W_K": L * dk + L * dv * d + dv * d * d, "W_V": L * d,
             "X": 2 * L * d}[wrt]
    return itemsize * (cache + extra)


def ffn(L: int, d: int, f: int, e: int, itemsize: int, what: str | None = None, threads: int = 1) -> int:
    """components.hpp on the engine's linear and relu nodes: copies of Y and the weights, H = Y W_1,
    relu(H) and relu'(H), F; for W_1's Jacobian or factors its tangent factors (L, e, f) at F, for Y
    one forward tangent per thread and the (L, e, d) blocks, for the cross second derivative W_1's
    factor at relu(H), a mask per thread and ("cross_dense") the (L, d, f) values."""
    cache = L * d + d * f + f * e + 3 * L * f + L * e
    cross = L * f + threads * f
    extra = {None: 0, "W_1": L * e * f + L * f, "W_2": L * f, "Y": threads * (L * d + 2 * L * f + L * e) + L * e * d,
             "cross": cross, "cross_dense": cross + L * d * f}[what]
    return itemsize * (cache + extra)


def block(B: int, L: int, d: int, dk: int, dff: int, itemsize: int, *, hessian: bool, outer: bool = True,
          heads: int = 1, P: int | None = None, pooled: bool = False, layers: int = 1, vocab: int = 0) -> int:
    """block_model.hpp on the engine (engine/graph.hpp, blocks/post_ln.hpp), the head (engine/heads/): the values and
    caches of the forward pass, the reverse pass's cotangents, the loss derivatives, and for a
    Hessian the per-token factors at every value, the sites' Omegas and kron::accumulate's chunks.
    For the family: dk per head, every (L, L) array once per head, P the spec's parameter count.
    pooled (a pooled head's outer part, assemble.hpp's accumulate_pooled): the factors at Z too, and
    two (samples, d, P) slabs of token-summed Jacobians, a few samples at a time. vocab: a language
    model's LM head (engine/nodes/unembedding.hpp): its logits, their cotangent, the head's softmax
    and gradient, (tokens, vocab) each, and Z's site over the vocabulary (the outer part)."""
    n = B * L
    dk, B_heads = heads * dk, B * heads  # all heads' query columns; the (L, L) arrays of every head
    P = 2 * d * dk + d * d + 2 * d * dff if P is None else P
    # X, F, X + F, Y, Y W_1, relu, R W_2, S, Z; Q, K, V, A and two (L, L) products in flight; two
    # LayerNorm sigmas and the relu mask
    # (A stack of layers holds every layer's values, caches and cotangents; a Hessian, the factors
    # of the last layer's parameters, the ones the factored dense Hessian covers.)
    forward = P + layers * (3 * B_heads * L * L + n * (7 * d + 3 * dff + 2 * dk + d + 2))
    reverse = layers * (2 * B_heads * L * L + n * (6 * d + 2 * dff + 2 * dk + d))  # every value's cotangent, gA, gT
    loss = n * d * (d + 1 if outer else 1)
    if vocab:  # the logits, their cotangent, the head's softmax and gradient; for a Hessian, its site
        loss += 4 * n * vocab + (n * vocab * vocab if hessian and outer else 0)
    total = forward + reverse + loss
    if hessian:
        attention = dk + 2 * d  # the three attention weights' matrix sides
        vectors = n * (dk + d)  # s q_t and (A X)_t (the other vectors are values)
        matrices = n * (4 * d + 2 * dff) * attention + n * dff * (d + 1)
        omegas = 4 * n * d * d
        widest = max(d, dk, dff)
        kron = 3 * min(n * widest * widest, _KRON_CHUNK)
        total += vectors + matrices + omegas + kron
        if pooled and outer:
            total += n * d * (dk + 3 * d + dff) + 2 * max(1, min(B, 128 // d)) * d * P
    return itemsize * total


def hvp(B: int, L: int, d: int, dk: int, dff: int, itemsize: int, columns: int, threads: int, *, heads: int = 1,
        P: int | None = None, layers: int = 1, vocab: int = 0) -> int:
    """engine/loss.hpp's LossOperator: the operator keeps the forward caches, the loss gradient and the reverse pass;
    each product in flight (one per thread) holds the tangents of the values and of their
    cotangents (engine::Tangent) and a copy of its column and product."""
    n = B * L
    kept = block(B, L, d, dk, dff, itemsize, hessian=False, outer=False, heads=heads, P=P, layers=layers,
                 vocab=vocab) // itemsize
    dk, B = heads * dk, B * heads
    P = 2 * d * dk + d * d + 2 * d * dff if P is None else P
    values = layers * n * (8 * d + 2 * dff)  # every varying value, once as a tangent and once as a cotangent's
    attention = layers * (2 * B * L * L + n * (2 * dk + d) + 2 * L * L + L * (2 * dk + d))
    per_product = 2 * values + attention + 2 * P + 2 * n * vocab  # the logits' tangent and its cotangent's
    return itemsize * (kept + per_product * max(1, min(columns, threads)))


def identity_products(B: int, L: int, d: int, dk: int, dff: int, itemsize: int, P_selected: int, threads: int,
                      **family) -> int:
    """engine/loss.hpp's Products::identity_columns (a dense Hessian or diagonal where the factors do
    not reach): the operator's caches and a product in flight per thread (hvp), each with a unit
    vector and its column of P_selected entries."""
    return hvp(B, L, d, dk, dff, itemsize, threads, threads, **family) + 2 * P_selected * threads * itemsize


# The parameters whose factors the diagonal forms together, a group at a time (engine/loss.hpp,
# Graph::factor_groups): a node's, a norm's gamma and beta apart.
_GROUPS = (("W_Q", "b_Q", "W_K", "b_K", "W_V", "b_V"), ("W_O", "b_O"), ("gamma_1",), ("beta_1",), ("W_1", "b_1"),
           ("W_2", "b_2"), ("gamma_2",), ("beta_2",))


def hessian_diagonal(B: int, L: int, d: int, dk: int, dff: int, itemsize: int, selected: list[tuple[str, tuple[int, ...]]],
                     *, heads: int = 1, P: int | None = None, pooled: bool = False, pre_ln: bool = False,
                     layers: int = 1, vocab: int = 0) -> int:
    """engine/diagonal.hpp through engine/loss.hpp: the forward and reverse passes, the sites' Omegas,
    and the factors of one group of selected parameters at a time (the largest group counts), at
    every value downstream of each, its matrix side at most the larger of its two dimensions (heads
    together). Values of width d and d_ff: W_1 2 and 0; W_2 2 and 0; the second norm's gamma and
    beta 1 and 0 post-LN (Z only), 3 and 2 pre-LN; the first norm's 4 and 2 post-LN, 13 and 2 pre-LN
    (it feeds Q, K and V at once). The attention parameters move their head's rows of F alike
    (factor.hpp): one (width, d_v) factor per head and value, 6 and 2, shared by all of them, plus
    each one's fixed right factor (W_K's (d_v, d) per head and token). Checked against the peak RSS
    of a GPT-2-sized block at L = 32 (pre-LN): W_K 1.27 GB against 1.55 estimated, all six attention
    parameters 1.28 against 1.55, gamma_1 1.75 against 1.92, every parameter 3.45 against 3.51."""
    n = B * L
    kept = block(B, L, d, dk, dff, itemsize, hessian=False, outer=False, heads=heads, P=P, layers=layers,
                 vocab=vocab) // itemsize
    omegas = 4 * n * d * d + n * vocab * vocab + 2 * B * heads * L * L * L  # the last layer's (the factored diagonal's)
    hv = max(d, heads * dk)  # the attention output's width (h d_v; d without W_O)

    def factors_of(name: str, shape: tuple[int, ...]) -> int:
        n_mat = max(shape)
        if name in _GROUPS[0]:
            own = {"W_Q": n * hv * dk, "W_K": n * hv * d + n * heads * dk, "W_V": n * heads * d}.get(name, 0)
        elif name in ("W_1", "b_1"):
            own = n * n_mat * (2 * d + 1)
        elif name in ("W_2", "b_2"):
            own = n * n_mat * 2 * d
        elif name in ("gamma_2", "beta_2"):
            own = n * n_mat * ((3 * d + 2 * dff) if pre_ln else d)
        elif name in ("gamma_1", "beta_1"):  # pre-LN: upstream of Q, K and V at once
            own = n * n_mat * ((13 * d + 2 * dff) if pre_ln else (4 * d + 2 * dff))
        else:
            own = n * n_mat * (6 * d + 2 * dff)
        return own + n * n_mat + (L * d * n_mat if pooled else 0)  # and its Gamma diagonals

    shapes = {name.rsplit(".", 1)[-1]: shape for name, shape in selected}  # a stack's "h.<l>." dropped
    factors = 0
    alone = tuple((name,) for name in shapes if not any(name in group for group in _GROUPS))
    for group in _GROUPS + alone:
        chosen = [name for name in group if name in shapes]
        if not chosen:
            continue
        shared = n * hv * (6 * d + 2 * dff + hv) if group is _GROUPS[0] else 0  # the heads' G_t downstream, and at F
        factors = max(factors, shared + sum(factors_of(name, shapes[name]) for name in chosen))
    return itemsize * (kept + omegas + factors)
