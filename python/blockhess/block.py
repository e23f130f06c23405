"""The post-LN Transformer block (docs/derivation.md §2.1) and the exact derivatives of its output and loss.

    T = X W_Q W_K^T X^T / sqrt(d_k),  A = softmax_rows(T),  F = A X W_V
    Y = LN(X + F),  S = relu(Y W_1) W_2 + Y,  Z = LN(S)

LayerNorms have no affine parameters (the paper's gamma = 1, beta = 0) and share ``eps``.
Parameters are ordered W_Q, W_K, W_V, W_1, W_2 and each is flattened row-major (vec_r).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _backend, _core, _gpu_launch, _working_memory
from ._interop import as_array, is_torch_tensor, returns_callers_kind, to_torch
from ._validate import _xp as _array_module
from .model import ModelSpec
from .spec import PAPER_BLOCK, BlockSpec, loss_names
from ._validate import (
    FLOAT_DTYPES,
    choice,
    common_dtype,
    contiguous,
    float_array,
    integer,
    nonneg_scalar,
    output_array,
    owned_copy,
    positive_int,
    require_finite,
    require_output_fits,
)



def _parameter_table(spec: BlockSpec, d: int, d_k: int, d_v: int, d_ff: int) -> list[tuple[str, tuple[int, ...]]]:
    """[(name, shape)] of a block's parameters in the canonical order, from the core's registry
    (params.hpp). A ValueError for a spec the engine does not wire yet."""
    return [(str(name), tuple(int(n) for n in shape))
            for name, shape in _core.block_parameters(spec._core(), d, d_k, d_v, d_ff)]


PARAM_NAMES = tuple(name for name, _ in _parameter_table(PAPER_BLOCK, 1, 1, 1, 1))  # the paper's block
_EMBEDDINGS = ("wte", "wpe")  # a language model's (params.hpp)
_PARTS = {"full": 0, "outer": 1, "functional": 2}


class BlockParams:
    """The parameters of a block: for the paper's block (the default spec) the five weight matrices
    W_Q (d, d_k), W_K (d, d_k), W_V (d, d), W_1 (d, d_ff), W_2 (d_ff, d); for any :class:`BlockSpec`
    use :meth:`from_arrays` or :meth:`random`. Arrays are kept in one float dtype (float32 only if
    all are float32), in the canonical order of :attr:`names`.

    The arrays are the object's own, copied at construction: an optimizer step in place on the
    arrays or tensors given never changes these parameters (nor an operator built from them, which
    keeps copies of its own). Build a new BlockParams for new values."""

    names = PARAM_NAMES

    def __init__(self, W_Q: Any, W_K: Any, W_V: Any, W_1: Any, W_2: Any) -> None:
        self._init(PAPER_BLOCK, dict(zip(PARAM_NAMES, (W_Q, W_K, W_V, W_1, W_2))))

    @classmethod
    def from_arrays(cls, spec: BlockSpec, arrays: dict[str, Any]) -> BlockParams:
        """The parameters of ``spec`` from a dict name -> array (NumPy, CuPy or torch); missing,
        extra or mis-shaped arrays are a ValueError that names them."""
        _check_spec(spec)
        if not isinstance(arrays, dict):
            raise TypeError(f"arrays must be a dict of name -> array, got {type(arrays).__name__}")
        params = cls.__new__(cls)
        params._init(spec, arrays)
        return params

    @classmethod
    def random(cls, spec: BlockSpec = PAPER_BLOCK, *, d: int, d_k: int, d_ff: int | None = None,
               d_v: int | None = None, seed: int = 0, dtype: Any = np.float64) -> BlockParams:
        """Random parameters of ``spec`` (weights ~ N(0, 1/fan_in); a language model's embeddings wte
        and wpe N(0, 1), as ``torch.nn.Embedding``'s; gamma 1 + N(0, 0.1^2), beta and biases
        N(0, 0.1^2)); d_v defaults to d / heads (d_k and d_v are per head). d_ff is required
        unless ``spec.attention_only`` (which has no FFN and ignores it). Sizes are integers >= 1 of
        any integer type, ``seed`` an integer >= 0."""
        _check_spec(spec)
        d, d_k = positive_int(d, "d"), positive_int(d_k, "d_k")
        if spec.attention_only:
            d_ff = 0
        elif d_ff is None:
            raise TypeError(f"BlockParams.random needs d_ff for {spec!r} (only attention_only=True has no FFN)")
        else:
            d_ff = positive_int(d_ff, "d_ff")
        _require_heads_fill_d(spec, d)
        if d_v is None:
            if d % spec.heads:  # with out_proj: d_v is free, but its default is not a whole number
                raise ValueError(f"d_v defaults to d / heads, and heads = {spec.heads} does not divide d = {d}: "
                                 "pass d_v (the value columns per head)")
            d_v = d // spec.heads
        else:
            d_v = positive_int(d_v, "d_v")
            if not spec.out_proj and d_v * spec.heads != d:
                raise ValueError(f"without out_proj the heads' values fill the width d: heads * d_v must equal "
                                 f"d = {d}, got d_v = {d_v} with heads = {spec.heads}")
        seed = integer(seed, "seed", least=0)
        try:
            wanted = np.dtype(dtype)
        except (TypeError, ValueError):  # not a dtype at all
            wanted = None
        if wanted is None or wanted not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be float32 or float64, got {dtype!r}")
        dtype = wanted
        rng = np.random.default_rng(seed)
        arrays = {}
        for name, shape in _parameter_table(spec, d, d_k, d_v, d_ff):
            if name in _EMBEDDINGS:
                a = rng.standard_normal(shape)
            elif len(shape) == 2:
                a = rng.standard_normal(shape) / np.sqrt(shape[0])
            else:
                a = (1.0 if name.rsplit(".", 1)[-1].startswith("gamma") else 0.0) + 0.1 * rng.standard_normal(shape)
            arrays[name] = a.astype(dtype)
        return cls.from_arrays(spec, arrays)

    def _init(self, spec: BlockSpec, given: dict[str, Any]) -> None:
        self.spec = spec
        # The sizes come from (the first layer's) W_Q, W_V and W_1 (an attention-only block has no
        # W_1: d_ff = 0).
        first_layer = spec.layer_prefix(0)
        sized = tuple(first_layer + n for n in (("W_Q", "W_V") if spec.attention_only else ("W_Q", "W_V", "W_1")))
        for name in sized:
            if name not in given:
                raise ValueError(f"the parameters of {spec!r} include {name}; got {', '.join(map(str, given)) or 'none'}")
        first = {n[len(first_layer):]: float_array(given[n], n, ndim=2) for n in sized}
        d, qk_columns = first["W_Q"].shape
        # Without an output projection the heads' values fill the width d exactly.
        v_columns = first["W_V"].shape[1] if spec.out_proj else d
        d_ff = 0 if spec.attention_only else first["W_1"].shape[1]
        if min(d, qk_columns, v_columns) < 1 or (not spec.attention_only and d_ff < 1):
            shapes = ", ".join(f"{n} {tuple(a.shape)}" for n, a in first.items())
            raise ValueError(f"{', '.join(sized)} must have at least one row and one column, got {shapes}")
        _require_heads_fill_d(spec, d)
        for name, columns, per_head in (("W_Q", qk_columns, "d_k"), ("W_V", v_columns, "d_v")):
            if columns % spec.heads:
                raise ValueError(f"{name} has {columns} columns, which heads = {spec.heads} does not divide: they "
                                 f"must be {per_head} * heads ({per_head} columns per head)")
        d_k, d_v = qk_columns // spec.heads, v_columns // spec.heads
        expected = dict(_parameter_table(spec, d, d_k, d_v, d_ff))
        missing = [n for n in expected if n not in given]
        extra = [n for n in given if n not in expected]
        if missing or extra:
            raise ValueError(f"the parameters of {spec!r} are {', '.join(expected)}; "
                             + (f"missing {', '.join(missing)}" if missing else "")
                             + ("; " if missing and extra else "")
                             + (f"unexpected {', '.join(map(str, extra))}" if extra else ""))
        names = tuple(expected)
        arrays = [float_array(given[n], n, ndim=len(expected[n])) for n in names]
        # The caller's own arrays (views of tensors), for the aliasing check of loss_hessian(out=).
        self._sources = tuple(as_array(given[n], n) for n in names)
        self._from_torch = any(is_torch_tensor(given[n]) for n in names)
        _backend.on_device(*arrays)
        # Where every expected shape comes from, so that no message derives a shape from itself.
        values = (f"d_v * heads = {v_columns} from W_V's columns" if spec.out_proj
                  else f"d_v * heads = d = {d} without out_proj")
        ffn = "" if spec.attention_only else f", d_ff = {d_ff} from W_1's columns"
        for name, w in zip(names, arrays):
            if tuple(w.shape) != expected[name]:
                raise ValueError(
                    f"{name} must have shape {expected[name]}, got {tuple(w.shape)} (d = {d} from W_Q's rows, "
                    f"d_k * heads = {qk_columns} from W_Q's columns, {values}{ffn}; heads = {spec.heads})"
                )
        self.names = names
        self.dtype = common_dtype(*arrays)
        self._arrays = tuple(owned_copy(w, self.dtype) for w in arrays)
        self.d, self.d_k, self.d_v, self.d_ff = d, d_k, d_v, d_ff

    @property
    def arrays(self) -> tuple[Any, ...]:
        return self._arrays

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(w.shape) for w in self._arrays)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(w.size) for w in self._arrays)

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def __getitem__(self, name: str) -> Any:
        return self._arrays[_param_index(self, name)]

    def __iter__(self):
        return iter(self._arrays)

    def __repr__(self) -> str:
        spec = "" if self.spec.is_paper_block else f"{self.spec!r}, "
        ffn = "" if self.spec.attention_only else f", d_ff={self.d_ff}"
        return f"BlockParams({spec}d={self.d}, d_k={self.d_k}{ffn}, dtype={self.dtype})"

    def slices(self) -> dict[str, slice]:
        """Where each parameter sits in :meth:`flatten` (and in the rows of a dense loss Hessian)."""
        bounds = np.cumsum((0, *self.sizes))
        return {n: slice(int(a), int(b)) for n, a, b in zip(self.names, bounds[:-1], bounds[1:])}

    def flatten(self) -> Any:
        """All parameters, each vec_r'd, concatenated in the order of :attr:`names` (a torch
        tensor when they were given as tensors)."""
        flat = _array_module(self._arrays[0]).concatenate([w.reshape(-1) for w in self._arrays])
        return to_torch(flat) if self._from_torch else flat

    @classmethod
    def unflatten(cls, v: Any, like: BlockParams) -> BlockParams:
        """Inverse of :meth:`flatten`: parameters of ``like``'s spec, shaped like those of ``like``."""
        if not isinstance(like, BlockParams):
            raise TypeError(f"like must be a BlockParams, got {type(like).__name__}")
        from_torch = is_torch_tensor(v)
        v = float_array(v, "v", ndim=1)
        if v.shape[0] != like.size:
            raise ValueError(f"v must have length {like.size} to match {like!r}, got {v.shape[0]}")
        params = cls.from_arrays(like.spec, {n: v[s].reshape(shape) for (n, s), shape
                                              in zip(like.slices().items(), like.shapes)})
        params._from_torch = from_torch
        return params


def _check_spec(spec: Any) -> None:
    if not isinstance(spec, (BlockSpec, ModelSpec)):
        raise TypeError(f"spec must be a blockhess.BlockSpec or ModelSpec, got {type(spec).__name__}")


def _param_index(params: BlockParams, name: Any) -> int:
    if name not in params.names:
        raise ValueError(f"parameter name must be one of {', '.join(params.names)}, got {name!r}")
    return params.names.index(name)


def _require_heads_fill_d(spec: BlockSpec, d: int) -> None:
    """Without an output projection the heads' values fill the width d: heads must divide d."""
    if not spec.out_proj and d % spec.heads:
        raise ValueError(f"heads = {spec.heads} does not divide d = {d}: without out_proj the heads' values fill "
                         "the width d (heads * d_v must equal d); use a spec with out_proj=True for other widths")


def _selection(params: BlockParams, wrt: Any, argument: str = "wrt") -> tuple[tuple[str, ...], list[bool], int]:
    """(names in the canonical order, a flag per parameter, their total size P) for ``wrt`` (the
    caller's ``argument``, named in the error): parameter names, or whole groups of them by their
    prefix, a model's layer ("h.3": every h.3.* parameter) or its final norm ("ln_f")."""
    try:
        given = params.names if wrt is None else tuple(wrt)
    except TypeError:  # not iterable, e.g. wrt=3
        given = ()
    if isinstance(wrt, str) or not given:
        raise ValueError(f"{argument} must be a non-empty sequence of distinct names from {params.names}, got {wrt!r}")
    names = []
    for n in given:
        group = [p for p in params.names if isinstance(n, str) and p.startswith(n.rstrip(".") + ".")]
        if n not in params.names and not group:
            groups = tuple(dict.fromkeys(p.rsplit(".", 1)[0] for p in params.names if "." in p))
            if not groups:  # a block: its parameters are all there is
                _param_index(params, n)
            raise ValueError(f"{argument}: {n!r} is neither a parameter ({', '.join(params.names)}) nor a group of "
                             f"them ({', '.join(groups)})")
        names.extend([n] if n in params.names else group)
    if len(set(names)) != len(names):
        raise ValueError(f"{argument} must name each parameter once, got {wrt!r}")
    selected = [n in names for n in params.names]
    names = tuple(n for n in params.names if n in names)  # the Hessian follows the canonical order
    return names, selected, sum(s for s, keep in zip(params.sizes, selected) if keep)


def _selected_sizes(params: BlockParams, names: tuple[str, ...]) -> tuple[int, ...]:
    """The sizes of the named parameters, in the order of ``names``."""
    return tuple(params.sizes[params.names.index(n)] for n in names)


def _working(params: BlockParams, B: int, L: int, itemsize: int, call: str, *, kind: int | None = None,
             head: tuple = (None, None), **options: Any) -> int:
    """The core's working-memory estimate of ``call`` on the block or model of ``params``
    (_working_memory.model): kind the loss's code, head a pooled head's (W_C, b_C)."""
    return _working_memory.model(params.spec, (params.d, params.d_k, params.d_v, params.d_ff), B, L, itemsize, call,
                                 loss=None if kind is None else loss_names()[kind],
                                 head_classes=0 if head[0] is None else int(head[0].shape[1]), **options)


def _eps(eps: Any, params: BlockParams) -> float:
    """eps as given, or the spec's when not given."""
    return nonneg_scalar(params.spec.eps if eps is None else eps, "eps")


def _check_params(params: Any) -> BlockParams:
    if not isinstance(params, BlockParams):
        raise TypeError(f"params must be a blockhess.BlockParams, got {type(params).__name__}")
    return params


def _batch(X: Any, params: BlockParams, *, single: bool = False, promote_with: tuple[Any, ...] = ()):
    """(X3, weights, dtype, shape): X as a C-contiguous (B, L, d) array in the common dtype of X,
    the weights and the float arrays in ``promote_with`` (a float target), the weights in that
    dtype, and X's own shape, (L, d) or (B, L, d). A language model's X is token ids, (L,) or
    (B, L): X3 is then their (B, L) int64 array, and the dtype the weights' and ``promote_with``'s."""
    spec = params.spec
    if spec.reads_tokens:
        return _tokens(X, params, single, promote_with)
    X = float_array(X, "X", ndim=(2,) if single else (2, 3))
    if spec.patch_dim and X.shape[-1] != spec.patch_dim:
        raise ValueError(f"X has {X.shape[-1]} features (shape {tuple(X.shape)}) but the patch embedding W_E takes "
                         f"patch_dim = {spec.patch_dim}")
    if not spec.patch_dim and X.shape[-1] != params.d:
        raise ValueError(f"X has {X.shape[-1]} features (shape {tuple(X.shape)}) but W_Q has d = {params.d} rows")
    if X.shape[-2] < 1 or (X.ndim == 3 and X.shape[0] < 1):
        raise ValueError(f"X must hold at least one token, got shape {tuple(X.shape)}")
    if spec.n_positions and spec.tokens(X.shape[-2]) > spec.n_positions:
        raise ValueError(f"X has {X.shape[-2]} tokens per sample{' and a class token' if spec.class_token else ''}, "
                         f"but wpe has only n_positions = {spec.n_positions} rows")
    _backend.on_device(X, *params.arrays)  # TypeError for host and device arrays mixed
    dtype = common_dtype(X, *params.arrays, *promote_with)
    weights = tuple(contiguous(w, dtype) for w in params.arrays)
    X3 = contiguous(X.reshape((1, *X.shape)) if X.ndim == 2 else X, dtype)
    if spec.class_token:  # the class token's place, first in every sample (the core fills it)
        X3 = _array_module(X3).concatenate([_array_module(X3).zeros_like(X3[:, :1]), X3], axis=1)
    return X3, weights, dtype, tuple(X.shape)


def _tokens(X: Any, params: BlockParams, single: bool, promote_with: tuple[Any, ...]):
    """_batch for a language model: X the token ids, each in [0, vocab_size), at most n_positions
    per sample where the model has learned positions."""
    spec = params.spec
    ids = as_array(X, "X")
    if ids is None or not hasattr(ids, "dtype"):
        ids = np.asarray(X)
    if np.dtype(ids.dtype).kind not in "iu":
        raise TypeError(f"X must hold integer token ids for a language model, got dtype {ids.dtype}")
    if ids.ndim not in ((1,) if single else (1, 2)):
        raise ValueError(f"X must be token ids of shape (L,){'' if single else ' or (B, L)'}, got shape {tuple(ids.shape)}")
    if ids.size == 0:
        raise ValueError(f"X must hold at least one token, got shape {tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= spec.vocab_size:
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(f"token id {bad} is out of range: ids must lie in [0, {spec.vocab_size}) (wte's rows)")
    if spec.n_positions and ids.shape[-1] > spec.n_positions:
        raise ValueError(f"X has {ids.shape[-1]} tokens per sample, but wpe has only n_positions = "
                         f"{spec.n_positions} rows")
    _backend.on_device(ids, *params.arrays)  # TypeError for host and device arrays mixed
    dtype = common_dtype(*params.arrays, *promote_with)
    weights = tuple(contiguous(w, dtype) for w in params.arrays)
    ids3 = _array_module(ids).ascontiguousarray(ids, dtype=np.int64).reshape(-1, ids.shape[-1])
    return ids3, weights, dtype, tuple(ids.shape)


def _sizes(X3: Any, params: BlockParams) -> tuple[int, int, int]:
    """(B, L, d) of a batch from _batch (a language model's X3 holds ids, a ViT's patches: d is the
    blocks' width)."""
    return int(X3.shape[0]), int(X3.shape[1]), params.d


def _output_width(params: BlockParams) -> int:
    """The width of the model's output Z: d, a language model's vocabulary (its LM head's logits) or
    a classifier's classes."""
    spec = params.spec
    return spec.vocab_size if spec.lm_head else spec.classes or params.d


def _batched(shape: tuple[int, ...], params: BlockParams) -> bool:
    """Whether X (its own shape, from _batch) was a batch."""
    return len(shape) == (2 if params.spec.reads_tokens else 3)


def _target(target: Any, loss: str, X3: np.ndarray, batched: bool, dtype: np.dtype, classes: int | None = None,
            width: int | None = None, output: str = "X"):
    """(values, classes) for the binding; exactly one is an array. ``classes``: the number of
    classes of a pooled head (its W_C's columns); ``width``: Z's (d, or a model's logits'), and
    ``output`` what mse's target must be shaped like."""
    B, L = X3.shape[:2]
    d = X3.shape[2] if width is None else width
    if loss == "mse":
        full = (B, L, d) if batched else (L, d)
        if tuple(target.shape) != full:
            raise ValueError(f"target must have the shape of {output}, {full}, for loss='mse', got {tuple(target.shape)}")
        return contiguous(target, dtype).reshape(B, L, d), None
    pooled = loss == "pooled_cross_entropy"
    target = as_array(target, "target")
    if target is None or not hasattr(target, "dtype"):
        target = np.asarray(target)
    elif _backend.on_device(target):
        # a torch CUDA tensor (its dtype is torch's, not NumPy's) as a CuPy array: zero copy
        target = _backend.device_module().asarray(target)
    kind = np.dtype(target.dtype).kind
    if kind not in "iu":
        raise TypeError(f"target must hold integer class indices for loss={loss!r}, got dtype {target.dtype}")
    if pooled:
        want, what = ((B,) if batched else ()), "one class per sample"
    elif loss == "next_token":
        want, what = ((B, L) if batched else (L,)), "one label per token, the loss reading the next one's"
    else:
        want, what = ((B, L) if batched else (L,)), "one class per token"
    if tuple(target.shape) != want:
        raise ValueError(f"target must have shape {want} ({what}) for loss={loss!r}, got {tuple(target.shape)}")
    n_classes = classes if pooled else d
    # next_token's labels of -100 are ignored (Hugging Face's ignore_index), as is every sample's first
    counted = target[target != _IGNORED] if loss == "next_token" else target
    if counted.size and (int(counted.min()) < 0 or int(counted.max()) >= n_classes):
        bad = int(counted.min()) if int(counted.min()) < 0 else int(counted.max())
        where = (f"the head's W_C has {n_classes} columns" if pooled
                 else f"the rows of Z have {n_classes} logits")
        ignored = " or -100 (ignored)" if loss == "next_token" else ""
        raise ValueError(f"class index {bad} is out of range: classes must lie in [0, {n_classes}){ignored} ({where})")
    if loss == "next_token" and L > 1 and not np.any(np.asarray(target).reshape(B, L)[:, 1:] != _IGNORED):
        raise ValueError("loss='next_token' needs a label that is not -100 at some position after the first")
    shape = (B,) if pooled else (B, L)
    return None, _array_module(target).ascontiguousarray(target, dtype=np.int64).reshape(shape)


_IGNORED = -100  # a next_token label that counts for nothing (engine/heads/cross_entropy.hpp)


def _head(head: Any, loss: str, d: int, own_classes: int = 0) -> tuple[Any, Any]:
    """The classifier (W_C (d, C), b_C (C,)) of loss='pooled_cross_entropy', checked; (None, None)
    for the other losses, which take no head, and for a model with a classifier of its own
    (``own_classes`` classes: ModelSpec.classes)."""
    if own_classes:
        if head is not None:
            raise ValueError(f"head=(W_C, b_C) is for a block's pooled loss; this model has its own classifier "
                             f"(W_C, b_C among its parameters, {own_classes} classes)")
        return None, None
    if loss != "pooled_cross_entropy":
        if head is not None:
            raise ValueError(f"head=(W_C, b_C) is for loss='pooled_cross_entropy' only, not loss={loss!r}")
        return None, None
    if not isinstance(head, (tuple, list)) or len(head) != 2:
        raise TypeError("loss='pooled_cross_entropy' needs head=(W_C, b_C): the classifier's weight (d, C) "
                        f"and bias (C,); got {type(head).__name__}")
    W_C, b_C = float_array(head[0], "W_C", ndim=2), float_array(head[1], "b_C", ndim=1)
    if W_C.shape[0] != d or W_C.shape[1] < 1 or tuple(b_C.shape) != (W_C.shape[1],):
        raise ValueError(f"head=(W_C, b_C) must have shapes (d, C) = ({d}, C) and (C,) with C >= 1, got "
                         f"{tuple(W_C.shape)} and {tuple(b_C.shape)}")
    return W_C, b_C


@returns_callers_kind
def block_forward(X: Any, params: BlockParams, *, eps: float | None = None) -> np.ndarray:
    """The block output Z for X of shape (L, d) or (B, L, d); same shape as X."""
    params = _check_params(params)
    eps = _eps(eps, params)
    X3, W, dtype, shape = _batch(X, params)
    B, L, d = _sizes(X3, params)
    width = _output_width(params)
    require_output_fits((B, L, width), dtype, "the block output", "pass fewer samples or tokens at a time",
                        working=_working(params, B, L, dtype.itemsize, "gradient"))

    out = _backend.empty((B, L, width), dtype, like=X3)
    if _backend.on_device(X3):  # the engine on the GPU backend
        with _backend.device_of(X3):
            _gpu_launch.engine_block_forward(X3, params.spec._core(), W, eps, out)
    else:
        _core.block_forward(X3, params.spec._core(), list(W), eps, out)  # the core names any stage that overflows
    return out if _batched(shape, params) else out[0]


@returns_callers_kind
def block_jacobian(X: Any, params: BlockParams, wrt: str, *, eps: float | None = None) -> np.ndarray:
    """dZ/dW_wrt for one sample X (L, d): shape (L*d, n_wrt), numerator layout."""
    params = _check_params(params)
    p = _param_index(params, wrt)
    eps = _eps(eps, params)
    X3, W, dtype, _ = _batch(X, params, single=True)
    _, L, d = _sizes(X3, params)
    shape = (L * _output_width(params), params.sizes[p])
    working = _working(params, 1, L, dtype.itemsize, "jacobian", selected=[k == p for k in range(len(params.names))])
    require_output_fits(shape, dtype, f"the block Jacobian with respect to {wrt}", "use loss_gradient or a smaller L",
                        working=working)

    what = f"the block Jacobian with respect to {wrt}"
    if _backend.on_device(X3):  # the engine on the GPU backend
        out = _backend.empty(shape, dtype, like=X3)
        with _backend.device_of(X3):
            _gpu_launch.engine_block_jacobian(X3, params.spec._core(), W, eps, p, out)
        return require_finite(out, what)
    out = np.empty(shape, dtype=dtype)
    _core.block_jacobian(X3, params.spec._core(), list(W), eps, p, out)
    return require_finite(out, what)


@returns_callers_kind
def block_output_hessian(X: Any, params: BlockParams, wrt_i: str, wrt_j: str, *, eps: float | None = None) -> np.ndarray:
    """d2 Z / dW_i dW_j for one sample, in the paper's layout (L*d*n_i, n_j).

    Row ``o * n_i + a``, column ``b``: d2 Z_o / d(W_i)_a d(W_j)_b. This object is large (L d n_i n_j
    entries) and meant for small sizes; for a loss use :func:`loss_hessian`.
    """
    params = _check_params(params)
    i, j = _param_index(params, wrt_i), _param_index(params, wrt_j)
    eps = _eps(eps, params)
    X3, W, dtype, _ = _batch(X, params, single=True)
    _, L, d = _sizes(X3, params)
    shape = (L * _output_width(params) * params.sizes[i], params.sizes[j])
    working = _working(params, 1, L, dtype.itemsize, "output_hessian",
                       selected=[k in (i, j) for k in range(len(params.names))])
    require_output_fits(shape, dtype, f"d2Z/d{wrt_i}d{wrt_j}", "use loss_hessian, which contracts it with the loss",
                        working=working)
    out = _backend.empty(shape, dtype, like=X3)
    _backend.kernels_for(X3).block_output_hessian(X3, params.spec._core(), list(W), eps, i, j, out)
    return out


def _loss_inputs(X, target, params, loss, eps, promote_with=(), head=None):
    """Everything a loss function passes to the core, validated: (params, X3, weights, dtype, eps,
    loss code, target values, target classes, (W_C, b_C) or (None, None))."""
    params = _check_params(params)
    loss = choice(loss, "loss", loss_names())
    eps = _eps(eps, params)
    if loss == "next_token" and not params.spec.lm_head:
        raise ValueError("loss='next_token' is the loss of a language model's logits: a ModelSpec with lm_head=True")
    if loss == "mse":  # a float target takes part in the dtype promotion like every other array
        target = float_array(target, "target")
    W_C, b_C = _head(head, loss, params.d, params.spec.classes)
    floats = (target,) if loss == "mse" else (W_C, b_C) if W_C is not None else ()
    X3, W, dtype, shape = _batch(X, params, promote_with=(*floats, *promote_with))
    _backend.on_device(X3, target, W_C, b_C)  # TypeError for a target or head on the other side of X
    pooled_classes = params.spec.classes or (None if W_C is None else W_C.shape[1])
    spec = params.spec
    like_X = not (spec.reads_tokens or spec.patch_dim) and _output_width(params) == params.d
    values, classes = _target(target, loss, X3, _batched(shape, params), dtype, pooled_classes,
                              width=_output_width(params), output="X" if like_X else "the model's output Z")
    head = (contiguous(W_C, dtype), contiguous(b_C, dtype))
    return params, X3, W, dtype, eps, loss_names().index(loss), values, classes, head


@returns_callers_kind
def loss_value(X: Any, target: Any, params: BlockParams, *, loss: str = "mse", eps: float | None = None,
               head: Any = None) -> float:
    """The loss of the block output: mean over the batch of the per-sample loss."""
    params, X3, W, dtype, eps, kind, values, classes, head = _loss_inputs(X, target, params, loss, eps, head=head)
    B, L, d = _sizes(X3, params)
    require_output_fits((1,), dtype, "the loss", "pass fewer samples at a time",
                        working=_working(params, B, L, dtype.itemsize, "gradient", kind=kind, head=head))

    if _backend.on_device(X3):  # the engine on the GPU backend
        with _backend.device_of(X3):
            return _gpu_launch.engine_loss_gradient(X3, params.spec._core(), W, eps, kind, values, classes, head, None)
    return float(_core.loss_gradient(X3, params.spec._core(), list(W), eps, kind, values, classes, None, *head))


@returns_callers_kind
def loss_gradient(X: Any, target: Any, params: BlockParams, *, loss: str = "mse", eps: float | None = None,
                  head: Any = None) -> np.ndarray:
    """Gradient of the loss with respect to every parameter, flattened like ``params.flatten()``: (P,).

    ``loss="mse"``: mean of (Z - target)**2 over all entries (per sample 1/(L d) ||Z - T||_F^2);
    ``loss="cross_entropy"``: rows of Z are logits, ``target`` holds integer classes (L,) or (B, L);
    ``loss="pooled_cross_entropy"``: the paper's ViT classifier, logits = mean over tokens of Z times
    W_C plus b_C with ``head=(W_C, b_C)`` fixed (W_C (d, C), b_C (C,)), ``target`` one integer class
    per sample, shape () or (B,). A batch X (B, L, d) gives the gradient of the batch-mean loss.
    """
    params, X3, W, dtype, eps, kind, values, classes, head = _loss_inputs(X, target, params, loss, eps, head=head)
    B, L, d = _sizes(X3, params)
    require_output_fits((params.size,), dtype, "the loss gradient", "pass fewer samples at a time",
                        working=_working(params, B, L, dtype.itemsize, "gradient", kind=kind, head=head))

    out = _backend.empty(params.size, dtype, like=X3)
    if _backend.on_device(X3):  # the engine on the GPU backend
        with _backend.device_of(X3):
            _gpu_launch.engine_loss_gradient(X3, params.spec._core(), W, eps, kind, values, classes, head, out)
    else:
        _core.loss_gradient(X3, params.spec._core(), list(W), eps, kind, values, classes, out, *head)
    return out


@returns_callers_kind
def loss_hessian(
    X: Any,
    target: Any,
    params: BlockParams,
    *,
    loss: str = "mse",
    part: str = "full",
    layout: str = "dense",
    eps: float | None = None,
    wrt: tuple[str, ...] | None = None,
    out: Any = None,
    head: Any = None,
) -> Any:
    """Exact Hessian of the loss with respect to the block's weight matrices.

    part: "full", "outer" (Gauss-Newton, J^T H_loss J) or "functional" (the rest); outer +
    functional == full. layout="dense": a (P, P) array, parameters in the order W_Q, W_K, W_V, W_1,
    W_2 (or those named in ``wrt``), each vec_r'd. layout="blocks": a dict keyed by name pairs,
    ``H["W_Q", "W_V"]`` of shape (n_Q, n_V), views into one symmetric array. A batch X (B, L, d)
    gives the Hessian of the batch-mean loss, the paper's H^(k). Exactly symmetric, bit for bit.
    out: a C-contiguous (P, P) array of the result's dtype, on the same side as X, to write the
    Hessian into (and to return, or view for layout="blocks") instead of allocating one; reusing
    it across calls saves the allocation and first-touch cost of a large result.
    loss and head as in :func:`loss_gradient` (the Hessian is with respect to the block's
    parameters; a pooled head's W_C and b_C stay fixed).

    A model (:class:`ModelSpec`): parameters are named by layer ("h.0.W_Q", ...) and ``wrt`` takes
    names or prefixes ("h.0", "ln_f"). The last block's, a final norm's and a classifier's Hessian is
    assembled from per-token factors; the rows and columns of a parameter below the last block's
    attention (a lower block, an embedding, positions, a class token) come from exact Hessian-vector
    products, one per entry of such parameters (docs/derivation.md §5.4): every cross-layer block is
    exact, at the cost of that many products.
    """
    params, X3, W, dtype, eps, kind, values, classes, head = _loss_inputs(X, target, params, loss, eps, head=head)
    part_code = _PARTS[choice(part, "part", tuple(_PARTS))]
    layout = choice(layout, "layout", ("dense", "blocks"))
    names, selected, P = _selection(params, wrt)
    B, L, d = _sizes(X3, params)
    working = _working(params, B, L, dtype.itemsize, "loss_hessian", kind=kind, head=head, part_code=part_code,
                       selected=selected)
    if out is None:
        require_output_fits(
            (P, P), dtype, f"the loss Hessian over {', '.join(names)} (P = {P})",
            "pass wrt=(...) with fewer parameters, e.g. wrt=('W_Q', 'W_K'), or a preallocated out=",
            working=working,
        )
    else:
        require_output_fits((P, P), dtype, f"the loss Hessian over {', '.join(names)} (P = {P})",
                            "pass fewer samples or tokens at a time", working=working, into_out=True)
        _backend.on_device(X3, out)  # TypeError for an out on the other side of X
        # Checked against the caller's own arrays: the copies made above cannot overlap out.
        callers = (("X", X), *zip(params.names, params._sources), ("target", target),
                   *(zip(("W_C", "b_C"), head) if head[0] is not None else ()))
        out = output_array(out, (P, P), dtype, callers)
    H = _backend.empty((P, P), dtype, like=X3) if out is None else out
    _backend.kernels_for(X3).loss_hessian(X3, params.spec._core(), list(W), eps, kind, values, classes, part_code,
                                          selected, H, *head)
    if layout == "dense":
        return H
    bounds = np.cumsum((0, *_selected_sizes(params, names)))
    where = {n: slice(int(a), int(b)) for n, a, b in zip(names, bounds[:-1], bounds[1:])}
    return {(a, b): H[where[a], where[b]] for a in names for b in names}
