"""The curvature approximations people use, measured against the exact matrix they approximate.

For a model small enough that its dense loss Hessian H and its Gauss-Newton (outer) part G fit in
memory, :func:`compare` takes both exactly (every cross-layer block; docs/derivation.md §4-5) and
measures, for each parameter's diagonal block,

- ``kronecker``: the best Kronecker-product fit ``A (x) B`` of the exact Gauss-Newton block of a
  weight matrix (the nearest Kronecker product of Van Loan and Pitsianis: the leading singular
  triplet of the block rearranged so that each (row, row') pair of the weight is a row and each
  (column, column') pair a column), the best that any Kronecker-factored method (K-FAC, EKFAC's
  basis, Shampoo's factors) can reach on that block;
- ``diagonal``: the exact diagonal of the Gauss-Newton block;
- ``kfac_expand`` and ``kfac_reduce``: K-FAC's ``A (x) G`` (:func:`kfac`, the type-2 Fisher: the
  loss's exact curvature backpropagated) for the weights applied to every token and their biases;
- ``ekfac``: K-FAC-expand's eigenbasis with the exact Gauss-Newton block's diagonal in it, the
  rescaling that EKFAC estimates from per-example gradients (the best any diagonal in that basis
  does, in Frobenius norm);

and for the whole model ``block_diagonal`` (the Gauss-Newton matrix with every block between two
layers dropped: the layer-wise approximation) and ``diagonal`` (its diagonal), each against the
exact Gauss-Newton matrix and against the exact Hessian. The errors: the relative Frobenius and
spectral errors, the ratio of the largest eigenvalues, and the overlap of the top-k eigenspaces
(``||U_exact^T U_approx||_F^2 / k``: 1 when they coincide). Beside them, how much the functional
part, which no approximation has, weighs: ``||H - G||_F / ||H||_F`` per block and for the whole.
A parameter the loss does not depend on (a key bias: softmax is invariant to it), whose exact blocks
are zero, has no rows.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np

from .block import BlockParams, loss_hessian


@dataclass(frozen=True)
class Errors:
    """How far an approximation M lies from an exact symmetric matrix E."""

    relative_frobenius: float  # ||E - M||_F / ||E||_F
    relative_spectral: float  # ||E - M||_2 / ||E||_2
    top_eigenvalue_ratio: float | None  # lambda_max(M) / lambda_max(E); None where lambda_max(E) = 0
    top_k_overlap: float  # ||U_E^T U_M||_F^2 / k over the k largest eigenvalues' eigenvectors


@dataclass(frozen=True)
class Row:
    """One approximation of one block (a parameter's, or "model" for the whole matrix) against one
    exact reference ("gauss_newton" or "hessian")."""

    block: str
    approximation: str
    reference: str
    errors: Errors


@dataclass
class Comparison:
    """What :func:`compare` measured: a row per block, approximation and reference, and the
    functional part's weight ``||H - G||_F / ||H||_F`` per block (and "model")."""

    rows: list[Row] = field(default_factory=list)
    functional_weight: dict[str, float] = field(default_factory=dict)
    top_k: int = 5

    def to_json(self) -> str:
        return json.dumps({"top_k": self.top_k, "functional_weight": self.functional_weight,
                           "rows": [asdict(r) for r in self.rows]}, indent=1, allow_nan=False)

    def to_markdown(self) -> str:
        """A table: one line per block and approximation, the errors against the Gauss-Newton
        block and against the Hessian block side by side."""
        lines = [f"| block | approximation | rel. Frobenius vs G | rel. spectral vs G | lambda_max ratio vs G | "
                 f"top-{self.top_k} overlap vs G | rel. Frobenius vs H | rel. spectral vs H | functional weight |",
                 "|---|---|---|---|---|---|---|---|---|"]
        against = {(r.block, r.approximation, r.reference): r.errors for r in self.rows}
        for block, approximation in dict.fromkeys((r.block, r.approximation) for r in self.rows):
            g, h = against[block, approximation, "gauss_newton"], against[block, approximation, "hessian"]
            ratio = "n/a" if g.top_eigenvalue_ratio is None else f"{g.top_eigenvalue_ratio:.3g}"
            lines.append(f"| {block} | {approximation} | {g.relative_frobenius:.3g} | {g.relative_spectral:.3g} | "
                         f"{ratio} | {g.top_k_overlap:.3g} | {h.relative_frobenius:.3g} | "
                         f"{h.relative_spectral:.3g} | {self.functional_weight[block]:.3g} |")
        return "\n".join(lines) + "\n"

    def error_table(self, approximation: str, reference: str = "gauss_newton") -> dict[str, float]:
        """{block: relative Frobenius error} of one approximation against one reference."""
        return {r.block: r.errors.relative_frobenius for r in self.rows
                if r.approximation == approximation and r.reference == reference}


def kfac(X: Any, target: Any, params: BlockParams, *, loss: str = "mse", eps: float | None = None,
         head: Any = None, wrt: Any = None, flavour: str = "expand") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """K-FAC's Kronecker factors ``{name: (A, G)}`` of the weights in ``wrt`` (all by default) that the
    model applies to every token (the attention's W_Q, W_K, W_V, W_O, the FFN's W_1 and W_2, a patch
    embedding's W_E, a classifier's W_C, and their biases) or looks up by id (an untied ``wte``, a
    ``wpe``, a class token: a weight whose input is the id's one-hot, A then the ids' frequencies),
    as defined for weights shared over a
    sequence (K-FAC-expand and K-FAC-reduce, Eschenhagen et al. 2023, the definition curvlinops
    implements) with the type-2
    Fisher (engine/kfac.hpp): A from the weight's inputs, G from its outputs' cotangents in one
    reverse pass per column of a square root of the loss's Hessian in the model's output. The weight
    W (rows, cols)'s Gauss-Newton block, in its row-major vec order, is approximated by
    ``np.kron(A, G)``; a bias is a weight whose input is 1 (A = [[1]], curvlinops' separate bias).
    With a per-token loss each reverse pass is seeded by every token's column at once, as curvlinops
    does, so G carries products of different tokens' columns that the exact matrix has not.
    A ``wte`` tied to the LM head has the factors of its use as the head's weight, ``logits_t = h_t
    wte^T``, as curvlinops defines them (it sees the head's Linear, not the lookup): wte's rows are
    the head's outputs, so there A (vocab, vocab) comes from the logits' cotangents and G (d, d)
    from the head's inputs. Arguments as in :func:`blockhess.loss_hessian`; norms have no factors.
    The factors must fit the memory budget with the model's passes (a ``wte``'s A is (vocab,
    vocab))."""
    from . import _backend, _core
    from ._validate import choice, require_output_fits
    from .block import _loss_inputs, _selection, _sizes, _working

    flavour = choice(flavour, "flavour", ("expand", "reduce"))
    params, X3, W, dtype, eps, kind, values, classes, head = _loss_inputs(X, target, params, loss, eps, head=head)
    names, selected, _ = _selection(params, wrt)
    if _backend.on_device(X3):
        raise TypeError("kfac runs on the CPU; pass NumPy arrays (cupy.asnumpy)")
    # Every selected parameter counted as if it had factors (rows^2 + cols^2 entries): an over-count.
    sides = [shape if len(shape) == 2 else (1, shape[0]) for shape, keep in zip(params.shapes, selected) if keep]
    B, L, _ = _sizes(X3, params)
    require_output_fits((sum(r * r + c * c for r, c in sides),), dtype, f"K-FAC's factors of {', '.join(names)}",
                        "pass wrt=(...) with fewer parameters",
                        working=_working(params, B, L, dtype.itemsize, "gradient", kind=kind, head=head))
    factors = _core.kfac_factors(X3, params.spec._core(), list(W), eps, kind, values, classes, selected,
                                 flavour == "reduce", *head)
    return {params.names[p]: (A, G) for p, A, G in factors}


def nearest_kronecker(E: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(A, B), A (rows, rows) and B (cols, cols), minimising ||E - A (x) B||_F for the (rows cols,
    rows cols) block E of a (rows, cols) weight in row-major vec order (E[(i, j), (k, l)] ~
    A[i, k] B[j, l]): the leading singular pair of E rearranged to R[(i, k), (j, l)]."""
    R = E.reshape(rows, cols, rows, cols).transpose(0, 2, 1, 3).reshape(rows * rows, cols * cols)
    U, s, Vt = np.linalg.svd(R, full_matrices=False)
    A = (np.sqrt(s[0]) * U[:, 0]).reshape(rows, rows)
    B = (np.sqrt(s[0]) * Vt[0]).reshape(cols, cols)
    if np.trace(A) < 0:  # the pair's sign is free: take the positive (semi-definite) one
        A, B = -A, -B
    return (A + A.T) / 2, (B + B.T) / 2


# Above this size eigenpairs come from Lanczos (scipy's ARPACK: the top k and the spectral norm
# only) instead of a full dense eigendecomposition.
_DENSE_EIGH = 1500


def _top(E: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest eigenvalues (ascending) of symmetric E and their eigenvectors."""
    if E.shape[0] <= _DENSE_EIGH:
        values, vectors = np.linalg.eigh(E)
        return values[-k:], vectors[:, -k:]
    from scipy.sparse.linalg import eigsh

    values, vectors = eigsh(E, k=k, which="LA", tol=1e-10)
    order = np.argsort(values)
    return values[order], vectors[:, order]


def _spectral_norm(E: np.ndarray) -> float:
    if E.shape[0] <= _DENSE_EIGH:
        return float(np.abs(np.linalg.eigvalsh(E)).max())
    from scipy.sparse.linalg import eigsh

    return float(np.abs(eigsh(E, k=1, which="LM", tol=1e-10, return_eigenvectors=False)).max())


class _Exact(NamedTuple):
    """What every approximation of one exact matrix E is measured against, computed once."""

    E: np.ndarray
    k: int  # the eigenspace's size
    top: tuple[np.ndarray, np.ndarray]  # its k largest eigenvalues and their eigenvectors
    spectral_norm: float


def _exact(E: np.ndarray, top_k: int) -> _Exact:
    k = max(1, min(top_k, E.shape[0] - 1 if E.shape[0] > _DENSE_EIGH else E.shape[0]))
    return _Exact(E, k, _top(E, k), _spectral_norm(E))


def errors(E: np.ndarray, M: np.ndarray, top_k: int) -> Errors:
    """The errors of M against E (both symmetric)."""
    return _errors(_exact(E, top_k), M)


def _errors(exact: _Exact, M: np.ndarray) -> Errors:
    (e_values, e_vectors), k = exact.top, exact.k
    m_values, m_vectors = _top(M, k)
    overlap = np.linalg.norm(e_vectors.T @ m_vectors) ** 2 / k
    ratio = float(m_values[-1] / e_values[-1]) if e_values[-1] != 0 else None  # E = 0: no ratio
    return Errors(_relative(exact.E - M, exact.E), _spectral_norm(exact.E - M) / max(exact.spectral_norm, 1e-300),
                  ratio, float(overlap))


# A model's parameters before its first block (a one-block model's block parameters are unprefixed).
_INPUT = ("wte", "wpe", "W_E", "b_E", "cls_token")


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: "h.<l>", "ln_f", "input" (the embeddings), "head" (a
    classifier), or "block" (the one block of a one-block model, whose names have no prefix)."""
    if name.startswith("h."):
        return name.rsplit(".", 1)[0]
    if name.startswith("ln_f."):
        return "ln_f"
    if name in ("W_C", "b_C"):
        return "head"
    return "input" if name in _INPUT else "block"


def compare(X: Any, target: Any, params: BlockParams, *, loss: str = "mse", eps: float | None = None,
            head: Any = None, top_k: int = 5, progress: Callable[[str], None] | None = None) -> Comparison:
    """The approximations of the module's docstring, measured against the exact Gauss-Newton matrix
    and the exact Hessian of the loss at (X, target, params) (arguments as in
    :func:`blockhess.loss_hessian`). Both dense (P, P) matrices are formed and held at once: for
    small models (each must fit the memory budget: blockhess.OutputTooLargeError otherwise).
    ``progress(text)`` is called before each step."""
    from ._validate import positive_int

    top_k = positive_int(top_k, "top_k")
    step = progress or (lambda text: None)
    step("the exact Hessian")
    H = np.asarray(loss_hessian(X, target, params, loss=loss, eps=eps, head=head))
    step("the exact Gauss-Newton matrix")
    G = np.asarray(loss_hessian(X, target, params, loss=loss, eps=eps, head=head, part="outer"))
    step("K-FAC's factors")
    kfacs = {flavour: kfac(X, target, params, loss=loss, eps=eps, head=head, flavour=flavour)
             for flavour in ("expand", "reduce")}
    result = Comparison(top_k=top_k)
    slices = params.slices()
    for name, shape in zip(params.names, params.shapes):
        step(name)
        where = slices[name]
        G_b, H_b = G[where, where], H[where, where]
        if not G_b.any() and not H_b.any():  # the loss does not depend on it (b_K: softmax's shift invariance)
            continue
        approximations = {"diagonal": np.diag(np.diag(G_b))}
        if len(shape) == 2 and min(shape) > 1:
            A, B = nearest_kronecker(G_b, *shape)
            approximations["kronecker"] = np.kron(A, B)
        if name in kfacs["expand"]:
            for flavour, factors in kfacs.items():
                approximations[f"kfac_{flavour}"] = np.kron(*factors[name])
            approximations["ekfac"] = _ekfac(G_b, *kfacs["expand"][name])
        references = {"gauss_newton": _exact(G_b, top_k), "hessian": _exact(H_b, top_k)}
        for kind, M in approximations.items():
            for reference, exact in references.items():
                result.rows.append(Row(name, kind, reference, _errors(exact, M)))
        result.functional_weight[name] = _relative(H_b - G_b, H_b)
    step("the whole model")
    layer = np.concatenate([[layer_of(n)] * int(np.prod(s)) for n, s in zip(params.names, params.shapes)])
    same_layer = layer[:, None] == layer[None, :]
    references = {"gauss_newton": _exact(G, top_k), "hessian": _exact(H, top_k)}
    for kind, M in (("block_diagonal", np.where(same_layer, G, 0.0)), ("diagonal", np.diag(np.diag(G)))):
        for reference, exact in references.items():
            result.rows.append(Row("model", kind, reference, _errors(exact, M)))
    result.functional_weight["model"] = _relative(H - G, H)
    return result


def _ekfac(G_b: np.ndarray, A: np.ndarray, G: np.ndarray) -> np.ndarray:
    """U diag(s) U^T, U = U_A (x) U_G the eigenbasis of A (x) G, s the diagonal of U^T G_b U."""
    U = np.kron(np.linalg.eigh(A)[1], np.linalg.eigh(G)[1])
    scale = np.einsum("ij,ij->j", U, G_b @ U)
    return (U * scale) @ U.T


def _relative(difference: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(difference) / max(np.linalg.norm(reference), 1e-300))
