"""Operators and block inputs that must not trust the caller (issue 25): an operator answers for
its inputs as they were at construction, every method keeps to the memory budget, nested lists
are arrays, torch in gives torch out, and bad sizes and numbers get messages that name them."""

import fractions
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import blockhess
from blockhess import BlockParams, BlockSpec

B, L, D, DK, DFF, CLASSES = 2, 3, 4, 2, 3, 3
LOSSES = ("mse", "cross_entropy", "pooled_cross_entropy")


def _inputs(seed, loss):
    """(X, target, weights, head) as fresh float64 / int64 NumPy arrays; head is None unless pooled."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((B, L, D))
    weights = [w.copy() for w in BlockParams.random(d=D, d_k=DK, d_ff=DFF, seed=seed).arrays]
    if loss == "mse":
        target = rng.standard_normal((B, L, D))
    elif loss == "cross_entropy":
        target = rng.integers(0, D, size=(B, L))
    else:
        target = rng.integers(0, CLASSES, size=B)
    head = None
    if loss == "pooled_cross_entropy":
        head = (rng.standard_normal((D, CLASSES)), rng.standard_normal(CLASSES))
    return X, target, weights, head


def _operator(X, target, weights, head, loss):
    return blockhess.hessian_operator(X, target, BlockParams(*weights), loss=loss, head=head)


def _answers(op):
    """Everything the operator answers, as NumPy arrays and floats (the diagonal first computed here)."""
    P = op.shape[0]
    v = np.linspace(-1.0, 1.0, P)
    V = np.stack([v, v[::-1] ** 2], axis=1)
    values, vectors = op.eigsh(k=2)
    return {
        "matvec": op.matvec(v), "matmul": op @ v, "matmat": op.matmat(V), "scipy": op.to_scipy().matvec(v),
        "diagonal": np.asarray(op.diagonal()), "trace": op.trace(), "trace_by_block": op.trace(by_block=True),
        "frobenius_norm": op.frobenius_norm(by_block=True), "loss_value": op.loss_value,
        "eigenvalues": np.asarray(values), "eigenvectors": np.asarray(vectors),
    }


def _assert_same_bits(got, want):
    assert got.keys() == want.keys()
    for key in want:
        if isinstance(want[key], np.ndarray):
            assert np.array_equal(got[key], want[key]), key
        else:
            assert got[key] == want[key], key


def _change_in_place(a, how, classes):
    """Change the caller's array or tensor ``a`` in place, as an optimizer step or a reused buffer would."""
    if str(a.dtype).endswith("int64"):  # class indices stay classes
        a[...] = (a + 1) % classes
    elif how == "scale":
        a *= -3.0
    elif how == "shift":
        a += 0.5
    else:
        a[...] = 0.25


# --- 1. an operator answers for its inputs as they were at construction ------------------------

@settings(max_examples=6, deadline=None)
@given(loss=st.sampled_from(LOSSES), kind=st.sampled_from(["numpy", "torch"]), seed=st.integers(0, 2**16),
       changes=st.lists(st.tuples(st.sampled_from(["X", "target", "weight", "head", "params"]),
                                  st.sampled_from(["scale", "shift", "fill"]), st.integers(0, 4)),
                        min_size=1, max_size=4))
def test_operator_does_not_see_the_callers_later_changes(loss, kind, seed, changes):
    """Every method of an operator (products, diagonal, traces, norm, loss, eigsh) answers bit for bit
    like one built afresh on the original values after X, target, weights or head change in place."""
    X, target, weights, head = _inputs(seed, loss)
    want = _answers(_operator(X, target, weights, head, loss))
    given_ = [X.copy(), target.copy(), [w.copy() for w in weights], head and tuple(a.copy() for a in head)]
    if kind == "torch":
        given_ = [torch.from_numpy(given_[0]), torch.from_numpy(given_[1]), [torch.from_numpy(w) for w in given_[2]],
                  head and tuple(torch.from_numpy(a) for a in given_[3])]
    X_, target_, weights_, head_ = given_
    params = BlockParams(*weights_)
    op = blockhess.hessian_operator(X_, target_, params, loss=loss, head=head_)
    for what, how, which in changes:
        classes = CLASSES if loss == "pooled_cross_entropy" else D
        if what == "X":
            _change_in_place(X_, how, classes)
        elif what == "target":
            _change_in_place(target_, how, classes)
        elif what == "weight":
            _change_in_place(weights_[which], how, classes)
        elif what == "params":  # through the arrays BlockParams hands out
            _change_in_place(params.arrays[which], how, classes)
        elif head_ is not None:
            _change_in_place(head_[which % 2], how, classes)
    _assert_same_bits(_answers(op), want)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_block_params_own_their_arrays(kind):
    """BlockParams copies the arrays or tensors it is given: an in-place step on them does not reach it."""
    weights = BlockParams.random(d=D, d_k=DK, d_ff=DFF, seed=3).arrays
    given_ = [torch.tensor(w) for w in weights] if kind == "torch" else [w.copy() for w in weights]
    params = BlockParams.from_arrays(BlockSpec(), dict(zip(BlockParams.names, given_)))
    X, target = np.random.default_rng(0).standard_normal((2, L, D))
    before = blockhess.loss_value(X, target, params)
    for w in given_:
        w *= 2.0  # an optimizer step in place
    assert all(np.array_equal(a, w) for a, w in zip(params.arrays, weights))
    assert not any(np.shares_memory(a, np.asarray(w)) for a, w in zip(params.arrays, given_))
    assert blockhess.loss_value(X, target, params) == before


# --- 2. every method keeps to the memory budget -------------------------------------------------

def _peak_or_refused(call, budget):
    """The peak of the memory NumPy allocates during call() under ``budget``, or None when refused."""
    with blockhess.memory_budget(budget):
        tracemalloc.start()
        try:
            call()
        except blockhess.OutputTooLargeError:
            return None
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    return peak


@pytest.mark.parametrize("method", ["matmat", "frobenius_norm", "eigsh", "loss_hvp"])
def test_every_method_is_refused_or_keeps_to_the_budget(method):
    """matmat, frobenius_norm (its chunks), eigsh (ARPACK's vectors) and loss_hvp with many columns
    either refuse with OutputTooLargeError or allocate no more than the memory budget."""
    X, target, weights, _ = _inputs(1, "mse")
    params = BlockParams(*weights)
    op = blockhess.hessian_operator(X, target, params)
    # float32 columns for a float64 operator: their converted copy counts as well.
    V = np.random.default_rng(2).standard_normal((op.shape[0], 4096)).astype(np.float32)
    call = {"matmat": lambda: op.matmat(V), "frobenius_norm": op.frobenius_norm,
            "eigsh": lambda: op.eigsh(k=3), "loss_hvp": lambda: blockhess.loss_hvp(X, target, params, V)}[method]
    outcomes = {}
    for budget in (int(2 ** (e / 2)) for e in range(20, 50)):  # 1 KiB to 23 MiB
        peak = _peak_or_refused(call, budget)
        outcomes[budget] = peak
        assert peak is None or peak <= budget, (budget, peak)
    assert outcomes[min(outcomes)] is None and outcomes[max(outcomes)] is not None


def test_frobenius_norm_under_a_small_budget_takes_smaller_chunks():
    """A budget smaller than the default 64 MiB chunk of columns needs gives the same norm in chunks."""
    X, target, weights, _ = _inputs(4, "mse")
    op = _operator(X, target, weights, None, "mse")
    want = op.frobenius_norm(by_block=True)
    small = min(b for b in (int(2 ** (e / 4)) for e in range(40, 100))
                if _peak_or_refused(op.frobenius_norm, b) is not None)
    with blockhess.memory_budget(small):
        got = op.frobenius_norm(by_block=True)
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-300) for k in want)
    with blockhess.memory_budget(small // 2), pytest.raises(blockhess.OutputTooLargeError, match="frobenius_norm"):
        op.frobenius_norm()


def test_spectral_density_refuses_a_lanczos_basis_beyond_the_budget():
    """The Lanczos basis spectral_density keeps (steps vectors of length P) counts against the budget."""
    X, target, weights, _ = _inputs(5, "mse")
    op = _operator(X, target, weights, None, "mse")
    with blockhess.memory_budget(8 * op.shape[0] * 20), \
            pytest.raises(blockhess.OutputTooLargeError, match="Lanczos bas"):
        op.spectral_density(probes=1, steps=30, grid=10)


# --- 3. nested lists and tuples are arrays ------------------------------------------------------

def _as_lists(a):
    return None if a is None else a.tolist()


@pytest.mark.parametrize("loss", LOSSES)
def test_every_function_takes_nested_lists(loss):
    """X, target, V, head and weights given as nested lists or tuples give the bits of the arrays."""
    X, target, weights, head = _inputs(6, loss)
    params = BlockParams(*weights)
    listed = BlockParams(*map(_as_lists, weights))
    V = np.random.default_rng(7).standard_normal((params.size, 2))
    head_lists = head and tuple(map(_as_lists, head))
    X_tuple = tuple(tuple(map(tuple, x)) for x in X.tolist())
    same = dict(loss=loss, head=head)
    for X_given in (X.tolist(), X_tuple):
        pairs = [
            (blockhess.loss_value(X_given, target.tolist(), listed, loss=loss, head=head_lists),
             blockhess.loss_value(X, target, params, **same)),
            (blockhess.loss_gradient(X_given, target.tolist(), listed, loss=loss, head=head_lists),
             blockhess.loss_gradient(X, target, params, **same)),
            (blockhess.loss_hessian(X_given, target.tolist(), listed, loss=loss, head=head_lists),
             blockhess.loss_hessian(X, target, params, **same)),
            (blockhess.loss_hvp(X_given, target.tolist(), listed, V.tolist(), loss=loss, head=head_lists),
             blockhess.loss_hvp(X, target, params, V, **same)),
            (blockhess.hessian_operator(X_given, target.tolist(), listed, loss=loss, head=head_lists).diagonal(),
             blockhess.hessian_operator(X, target, params, **same).diagonal()),
        ]
        for got, want in pairs:
            assert np.array_equal(got, want)
    for X_given in (X.tolist(), X_tuple):
        assert np.array_equal(blockhess.block_forward(X_given, listed), blockhess.block_forward(X, params))
    one = X[0]
    assert np.array_equal(blockhess.block_jacobian(one.tolist(), listed, "W_V"),
                          blockhess.block_jacobian(one, params, "W_V"))
    assert np.array_equal(blockhess.block_output_hessian(one.tolist(), listed, "W_Q", "W_1"),
                          blockhess.block_output_hessian(one, params, "W_Q", "W_1"))
    op = blockhess.hessian_operator(X, target, params, **same)
    assert np.array_equal(op.matvec(V[:, 0].tolist()), op.matvec(V[:, 0]))
    assert np.array_equal(op.matmat(V.tolist()), op.matmat(V))
    assert np.array_equal(op @ V.tolist(), op.matmat(V)) and np.array_equal(op @ tuple(V[:, 0]), op.matvec(V[:, 0]))
    assert np.array_equal(BlockParams.unflatten(params.flatten().tolist(), params).flatten(), params.flatten())


def test_dataset_operator_takes_nested_lists():
    """dataset_hessian_operator's batches as nested lists (the helper that read X.shape is shared)."""
    X, target, weights, _ = _inputs(8, "mse")
    params = BlockParams(*weights)
    got = blockhess.dataset_hessian_operator([(X.tolist(), target.tolist())], params)
    assert np.array_equal(got.diagonal(), blockhess.dataset_hessian_operator([(X, target)], params).diagonal())


def test_ragged_lists_and_a_list_out_are_type_errors():
    """A ragged nested list names the argument; out= as a list is refused, not filled into a copy."""
    X, target, weights, _ = _inputs(9, "mse")
    params = BlockParams(*weights)
    with pytest.raises(TypeError, match="X must be a numeric array"):
        blockhess.loss_value([[1.0, 2.0, 3.0, 4.0], [1.0]], target[0], params)
    with pytest.raises(TypeError, match="out must be an array, got list"):
        blockhess.loss_hessian(X, target, params, out=np.zeros((params.size, params.size)).tolist())


# --- 4. torch in, torch out -----------------------------------------------------------------------

def test_a_torch_head_gives_torch_results():
    """head=(W_C, b_C) as tensors, everything else NumPy: array results are tensors, the loss a float."""
    X, target, weights, head = _inputs(10, "pooled_cross_entropy")
    params = BlockParams(*weights)
    thead = tuple(torch.from_numpy(a) for a in head)
    options = dict(loss="pooled_cross_entropy")
    for function, args in ((blockhess.loss_gradient, ()), (blockhess.loss_hessian, ()),
                           (blockhess.loss_hvp, (np.ones(params.size),))):
        got = function(X, target, params, *args, head=thead, **options)
        assert isinstance(got, torch.Tensor), function.__name__
        assert np.array_equal(got.numpy(), function(X, target, params, *args, head=head, **options))
    value = blockhess.loss_value(X, target, params, head=thead, **options)
    assert type(value) is float and value == blockhess.loss_value(X, target, params, head=head, **options)


@pytest.mark.parametrize("torch_argument", ["X", "target", "params", "head"])
def test_an_operator_built_from_tensors_answers_in_tensors(torch_argument):
    """diagonal() and eigsh() of an operator built from any tensor are tensors; floats stay floats;
    a product follows its vector."""
    X, target, weights, head = _inputs(11, "pooled_cross_entropy")
    args = {"X": X, "target": target, "params": BlockParams(*weights), "head": head}
    plain = blockhess.hessian_operator(args["X"], args["target"], args["params"], loss="pooled_cross_entropy",
                                       head=args["head"])
    if torch_argument == "params":
        args["params"] = BlockParams(*map(torch.from_numpy, weights))
    elif torch_argument == "head":
        args["head"] = tuple(map(torch.from_numpy, head))
    else:
        args[torch_argument] = torch.from_numpy(args[torch_argument])
    op = blockhess.hessian_operator(args["X"], args["target"], args["params"], loss="pooled_cross_entropy",
                                    head=args["head"])
    assert isinstance(op.diagonal(), torch.Tensor) and np.array_equal(op.diagonal().numpy(), plain.diagonal())
    values, vectors = op.eigsh(k=2)
    assert isinstance(values, torch.Tensor) and isinstance(vectors, torch.Tensor)
    assert isinstance(op.eigsh(k=2, return_eigenvectors=False), torch.Tensor)
    assert np.array_equal(values.numpy(), plain.eigsh(k=2)[0])
    assert all(type(x) is float for x in (op.trace(), op.frobenius_norm(), op.loss_value))
    v = np.ones(op.shape[0])
    assert isinstance(op.matvec(v), np.ndarray) and isinstance(op.matvec(torch.from_numpy(v)), torch.Tensor)
    assert not isinstance(plain.diagonal(), torch.Tensor)


# --- 5. sizes and numbers: any real or integer type, and messages that name the rule -----------

def test_numpy_scalars_are_accepted_where_python_numbers_are():
    """np.int64 heads and sizes, np.float32 and Fraction eps, np.bool_ flags: the same spec and params."""
    spec = BlockSpec(heads=np.int64(2), eps=np.float32(0.25), bias=np.bool_(True))
    assert spec == BlockSpec(heads=2, eps=float(np.float32(0.25)), bias=True)
    assert hash(spec) == hash(BlockSpec(heads=2, eps=0.25, bias=True)) and type(spec.heads) is int
    assert BlockSpec(eps=fractions.Fraction(1, 4)).eps == 0.25
    params = BlockParams.random(spec, d=np.int64(4), d_k=np.int32(2), d_ff=np.uint8(3), seed=np.int64(1))
    same = BlockParams.random(spec, d=4, d_k=2, d_ff=3, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(params.arrays, same.arrays))


@pytest.mark.parametrize("call,error,message", [
    (lambda: BlockSpec(heads=True), TypeError, "BlockSpec.heads must be an integer, got bool"),
    (lambda: BlockSpec(heads=2.0), TypeError, "BlockSpec.heads must be an integer, got float"),
    (lambda: BlockSpec(eps=np.True_), TypeError, "BlockSpec.eps must be a real number, got bool"),
    (lambda: BlockParams.random(d=2.5, d_k=2, d_ff=3), TypeError, "d must be an integer, got float"),
    (lambda: BlockParams.random(d=True, d_k=2, d_ff=3), TypeError, "d must be an integer, got bool"),
    (lambda: BlockParams.random(d=4, d_k=0, d_ff=3), ValueError, "d_k must be >= 1, got 0"),
    (lambda: BlockParams.random(d=4, d_k=2, d_ff=-3), ValueError, "d_ff must be >= 1, got -3"),
    (lambda: BlockParams.random(d=4, d_k=2, d_ff=3, seed=-1), ValueError, "seed must be >= 0, got -1"),
    (lambda: BlockParams.random(d=4, d_k=2, d_ff=3, seed=1.5), TypeError, "seed must be an integer, got float"),
    (lambda: BlockParams.random(d=4, d_k=2, d_ff=3, dtype="fish"), TypeError, "dtype must be float32 or float64"),
    (lambda: BlockParams.random(BlockSpec(heads=2), d=3, d_k=2, d_ff=3), ValueError,
     r"heads = 2 does not divide d = 3: without out_proj"),
    (lambda: BlockParams.random(BlockSpec(heads=2, out_proj=True), d=3, d_k=2, d_ff=3), ValueError,
     r"d_v defaults to d / heads, and heads = 2 does not divide d = 3: pass d_v"),
    (lambda: BlockParams.random(BlockSpec(heads=2), d=4, d_k=2, d_ff=3, d_v=1), ValueError,
     r"heads \* d_v must equal d = 4, got d_v = 1"),
])
def test_bad_sizes_and_numbers_are_named(call, error, message):
    """Sizes, seeds, dtypes and spec numbers: our TypeError / ValueError naming the argument."""
    with pytest.raises(error, match=message):
        call()


def _arrays(**shapes):
    return {name: np.ones(shape) for name, shape in shapes.items()}


PAPER_SHAPES = dict(W_Q=(4, 2), W_K=(4, 2), W_V=(4, 4), W_1=(4, 6), W_2=(6, 4))


@pytest.mark.parametrize("spec,shapes,message", [
    (BlockSpec(heads=2), {**PAPER_SHAPES, "W_Q": (4, 3), "W_K": (4, 3)},
     r"W_Q has 3 columns, which heads = 2 does not divide: they must be d_k \* heads"),
    (BlockSpec(heads=2), dict(W_Q=(3, 2), W_K=(3, 2), W_V=(3, 3), W_1=(3, 6), W_2=(6, 3)),
     r"heads = 2 does not divide d = 3: without out_proj the heads' values fill the width d"),
    (BlockSpec(heads=2, out_proj=True), {**PAPER_SHAPES, "W_V": (4, 3), "W_O": (3, 4)},
     r"W_V has 3 columns, which heads = 2 does not divide: they must be d_v \* heads"),
    (BlockSpec(), {**PAPER_SHAPES, "W_V": (4, 3)},
     r"W_V must have shape \(4, 4\), got \(4, 3\) \(.*d_v \* heads = d = 4 without out_proj"),
    (BlockSpec(), {**PAPER_SHAPES, "W_2": (6, 5)},
     r"W_2 must have shape \(6, 4\), got \(6, 5\) \(d = 4 from W_Q's rows"),
])
def test_shape_messages_say_where_each_size_comes_from(spec, shapes, message):
    """A shape message derives no shape from the array it refuses, and names widths heads does not divide."""
    with pytest.raises(ValueError, match=message) as err:
        BlockParams.from_arrays(spec, _arrays(**shapes))
    assert "W_V with" not in str(err.value)


def test_booleans_are_not_numbers_for_operator_methods():
    """tol=True and k=True are TypeErrors, not 1."""
    X, target, weights, _ = _inputs(12, "mse")
    op = _operator(X, target, weights, None, "mse")
    with pytest.raises(TypeError, match="tol must be a real number, got bool"):
        op.eigsh(k=2, tol=True)
    with pytest.raises(TypeError, match="k must be an integer, got bool"):
        op.eigsh(k=True)
    with pytest.raises(ValueError, match="wrt must be a non-empty sequence"):
        blockhess.hessian_operator(X, target, BlockParams(*weights), wrt=3)
