"""Issue 25 ("Trust the newer surfaces"), the bounds package: exact block norms keyed by the blocks
they are, the spec's eps, power iteration that says when it has not converged, bounds past the
float range as inf (never a raw OverflowError), the wrong kind of target named, and NumPy scalars
accepted where Python numbers are (bools refused)."""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

import blockhess as bh
from blockhess import bounds
from blockhess.bounds import layernorm as ln_bounds
from blockhess.bounds._norms import block_norms, hessian_norm


def problem(seed: int = 0, spec: bh.BlockSpec | None = None):
    """X (5, 4), an mse target and the paper block's params (P = 72), with ``spec``'s options."""
    rng = np.random.default_rng(seed)
    params = bh.BlockParams.random(d=4, d_k=2, d_ff=5, seed=seed + 1)
    if spec is not None:
        params = bh.BlockParams.from_arrays(spec, {n: params[n] for n in params.names})
    return rng.standard_normal((5, 4)), rng.standard_normal((5, 4)), params


def attention_layer(params: bh.BlockParams) -> bh.BlockParams:
    return bh.BlockParams.from_arrays(bh.BlockSpec(attention_only=True), {n: params[n] for n in ("W_Q", "W_K", "W_V")})


def torch_hessian(X, target, params, eps=0.0):
    """The dense loss Hessian by autograd (float64), the independent reference."""
    torch = pytest.importorskip("torch")
    from blockhess import _torch_reference as ref

    H = ref.loss_hessian(torch.tensor(X), torch.tensor(target), [torch.tensor(np.asarray(w)) for w in params.arrays],
                         "mse", eps=eps)
    return H.numpy()


def norm2(A: np.ndarray) -> float:
    return float(np.linalg.norm(A, 2))


# ---- block_norms: the blocks named, keyed in the parameters' order ------------------------------


@pytest.mark.parametrize("method", ["dense", "power"])
def test_block_norms_in_callers_order_are_the_named_blocks(method):
    """names=("W_V", "W_Q") slices the (canonically ordered) Hessian at W_V's and W_Q's rows, not at
    the first rows of the caller's order, and keys the pairs in the parameters' order."""
    X, target, params = problem()
    H, s = torch_hessian(X, target, params), params.slices()
    found = block_norms(X, target, params, names=("W_V", "W_Q"), method=method, iterations=2000)
    rel = 1e-10 if method == "dense" else 1e-8
    for a in ("W_V", "W_Q"):
        assert found[a, a] == pytest.approx(norm2(H[s[a], s[a]]), rel=rel), a
    assert list(found) == [("W_Q", "W_Q"), ("W_Q", "W_V"), ("W_V", "W_V"), ("all", "all")]
    assert found["W_Q", "W_V"] == pytest.approx(norm2(H[s["W_Q"], s["W_V"]]), rel=rel)
    both = np.r_[np.arange(params.size)[s["W_Q"]], np.arange(params.size)[s["W_V"]]]
    assert found["all", "all"] == pytest.approx(norm2(H[np.ix_(both, both)]), rel=rel)


# ---- power iteration: checked options, and no unconverged value without a word --------------------


@pytest.mark.parametrize("norms", [block_norms, hessian_norm])
def test_power_iteration_options_are_checked(norms):
    X, target, params = problem()
    with pytest.raises(ValueError, match="iterations must be >= 1, got 0"):
        norms(X, target, params, method="power", iterations=0)
    with pytest.raises(TypeError, match="iterations must be an integer, got bool"):
        norms(X, target, params, method="power", iterations=True)
    with pytest.raises(TypeError, match="iterations must be an integer, got float"):
        norms(X, target, params, method="power", iterations=200.0)
    with pytest.raises(TypeError, match="tol must be a real number, got bool"):
        norms(X, target, params, method="power", tol=True)
    with pytest.raises(ValueError, match="tol must be finite and >= 0"):
        norms(X, target, params, method="power", tol=-1e-9)
    with pytest.raises(ValueError, match="method must be one of"):
        norms(X, target, params, method="lanczos")


@pytest.mark.parametrize("norms", [block_norms, hessian_norm])
def test_power_iteration_that_has_not_converged_raises_and_says_how_many_iterations(norms):
    """Three steps settle no block to 1e-12: a ValueError naming the block and a step count, which
    (followed, as a user would, until it suffices) gives the dense values."""
    X, target, params = problem()
    with pytest.raises(ValueError, match=r"has not converged in iterations=3 .* pass iterations=\d+") as info:
        norms(X, target, params, method="power", iterations=3)
    message = str(info.value)
    for _ in range(5):
        advised = int(re.search(r"pass iterations=(\d+)", message).group(1))
        try:
            found = norms(X, target, params, method="power", iterations=np.int64(advised), tol=np.float32(1e-12))
            break
        except ValueError as err:
            message = str(err)
    dense = norms(X, target, params, method="dense")
    if isinstance(dense, dict):
        for key, value in dense.items():
            assert found[key] == pytest.approx(value, rel=1e-8), key
    else:
        assert found == pytest.approx(dense, rel=1e-8)
    # A looser tol is met in fewer steps.
    assert norms(X, target, params, method="power", iterations=200, tol=1e-3) == pytest.approx(dense, rel=1e-2)


# ---- LayerNorm's eps: the spec's by default -------------------------------------------------------


def test_theorem6_takes_the_specs_eps():
    X, target, params = problem(spec=bh.BlockSpec(eps=0.3))
    H, s = torch_hessian(X, target, params, eps=0.3), params.slices()
    found = bounds.theorem6(X, target, params)
    short = {"Q": "W_Q", "K": "W_K", "V": "W_V", "1": "W_1", "2": "W_2"}
    for b in found[:-1]:
        a, c = (short[x] for x in re.search(r"H\((\w),(\w)\)", b.quantity).groups())
        assert b.exact == pytest.approx(norm2(H[s[a], s[c]]), rel=1e-10), b.quantity
    assert found[-1].exact == pytest.approx(np.abs(np.linalg.eigvalsh(H)).max(), rel=1e-10)
    # The bounds too: the same as with eps given, and not those of eps = 0.
    default_spec = bh.BlockParams.from_arrays(bh.BlockSpec(), {n: params[n] for n in params.names})
    assert found == bounds.theorem6(X, target, default_spec, eps=0.3)
    assert found != bounds.theorem6(X, target, default_spec)
    assert all(b.corrected_holds for b in found)


def test_proposition10_takes_the_specs_eps():
    torch = pytest.importorskip("torch")
    from blockhess import _torch_reference as ref

    X, _, params = problem(spec=bh.BlockSpec(eps=2.0))
    W = [torch.tensor(np.asarray(params[n])) for n in ("W_Q", "W_K", "W_V")]
    x = torch.tensor(X)
    Y = ref.layernorm(x + ref.attention(x, *W), 2.0).numpy()
    found = bounds.proposition10(X, params)
    assert found[0].quantity == "Prop 10: ||Y||"
    assert found[0].exact == pytest.approx(norm2(Y), rel=1e-10)
    assert found == bounds.proposition10(X, params, eps=np.float32(2.0))


# ---- past the float range: inf bounds or a clear error, never OverflowError ----------------------


def decimal_stated_bounds(X: np.ndarray, c: float) -> tuple[float, float]:
    """Lemma 4's two stated bounds at c X, in Decimal arithmetic (no float range): ||cX|| = c ||X||
    and the smallest centred row norm scales by c."""
    m, n = X.shape
    x = Decimal(norm2(X)) * Decimal(c)
    s = Decimal(float(np.linalg.norm(X - X.mean(axis=1, keepdims=True), axis=1).min())) * Decimal(c)
    rn, rmn = Decimal(n).sqrt(), Decimal(m / n).sqrt()
    J = 1 / s + x**2 / (rn * s**3)
    H = x / s**3 * (1 + rmn) + x**2 / (rn * s**3) + 3 * x**3 / (n * s**5)
    return float(J), float(H)


@pytest.mark.parametrize("c", [1e150, 1e-150, 1e250])
def test_lemma4_at_large_and_small_scales(c):
    """The stated bounds equal the printed formula (evaluated in Decimal, without a float range);
    the exact and corrected norms follow the eps = 0 scale law (J as 1/c, H as 1/c^2, where that
    is a normal float)."""
    X = np.random.default_rng(5).standard_normal((3, 6))
    at_one, at_c = bounds.lemma4(X), bounds.lemma4(c * X)
    for power, b1, bc in zip((1, 2), at_one, at_c):
        assert bc.corrected_holds
        if power == 1 or abs(np.log10(c)) <= 150:
            assert bc.exact == pytest.approx(b1.exact / c**power, rel=1e-12)
            assert bc.corrected == pytest.approx(b1.corrected / c**power, rel=1e-12)
    J, H = decimal_stated_bounds(X, c)
    assert at_c[0].stated == pytest.approx(J, rel=1e-12)
    assert at_c[1].stated == pytest.approx(H, rel=1e-12)


def test_row_std_at_any_finite_scale():
    X = np.random.default_rng(6).standard_normal((3, 6))
    for c in (1e200, 1e300, 1e-300):
        np.testing.assert_allclose(ln_bounds.row_std(c * X), c * X.std(axis=1), rtol=1e-14)


def test_lemma4_bound_past_the_float_range_is_inf():
    """Rows of scale 1e200 and 1e-100: the stated Hessian bound (3 ||X||^3 / (n sigma^5)) is ~1e1100,
    inf, and holds; the exact norms and the corrected bounds are in range."""
    rng = np.random.default_rng(7)
    X = np.vstack([1e200 * rng.standard_normal(5), 1e-100 * rng.standard_normal(5)])
    J, H = bounds.lemma4(X)
    assert H.stated == np.inf and H.stated_holds
    assert np.isfinite(J.exact) and np.isfinite(H.exact) and J.corrected_holds and H.corrected_holds
    assert J.exact == pytest.approx(1 / ln_bounds.row_std(X).min(), rel=1e-12)  # n >= 3: exact


def test_theorem1_and_theorem6_past_the_float_range():
    """||X|| ~ 1e70: the stated and corrected bounds with ||X||^5, ||X||^6 are inf (they hold,
    vacuously), the others finite; the exact norms are the core's."""
    X, target, params = problem()
    X = 1e70 * X
    for found in (bounds.theorem1(X, target, attention_layer(params)), bounds.theorem6(X, target, params)):
        assert all(np.isfinite(b.exact) and b.corrected_holds and b.stated_holds is not False for b in found)
        assert any(b.corrected == np.inf for b in found)
        assert any(np.isfinite(b.corrected) for b in found)


def test_theorem7_past_the_float_range():
    rhs = bounds.theorem7_rhs([1, 3], 1.0, M=1.0, distance=1e200)
    assert np.all(rhs["stated"] == np.inf) and np.all(rhs["corrected"] == np.inf)
    losses = [1e308, 1.5e308, 0.5e308, 1.75e308]
    k, differences = bounds.running_differences(losses)
    exact = [Fraction(v) for v in losses]
    means = [sum(exact[:i]) / i for i in range(1, 5)]
    np.testing.assert_allclose(differences, [float(abs(b - a)) for a, b in zip(means, means[1:])], rtol=1e-15)
    b = bounds.theorem7(losses, np.zeros(4), M=1.0, distance=1e200)
    assert b.stated == b.corrected == np.inf and b.corrected_holds


def test_bound_records_read_an_overflowed_bound_as_inf_and_need_a_finite_exact_value():
    """A NaN bound can only be an overflow times 0 (the inputs are finite): it is inf, and holds;
    a NaN stated bound read as "fails" or a max that skips it would be a silent wrong answer."""
    b = bounds.Bound("q", 1.0, float("nan"), np.float64("nan"), extra={"other": float("nan")})
    assert b.stated == b.corrected == b.extra["other"] == np.inf and b.stated_holds and b.corrected_holds
    assert type(bounds.Bound("q", np.float64(1.0), None, np.float64(2.0)).corrected) is float
    with pytest.raises(bh.NonFiniteError, match="q: the exact value is inf"):
        bounds.Bound("q", np.inf, 1.0, 1.0)


# ---- the wrong kind of target ---------------------------------------------------------------------


def test_bounds_name_a_target_of_the_wrong_kind():
    X, target, params = problem()
    classes = np.arange(5) % 4  # one class per token: cross_entropy's target, not mse's
    with pytest.raises(TypeError, match="target must have dtype float32 or float64"):
        bounds.theorem1(X, classes, attention_layer(params))
    with pytest.raises(TypeError, match="target must have dtype float32 or float64"):
        bounds.theorem6(X, classes, params)
    with pytest.raises(ValueError, match="target must have the shape of X"):
        bounds.theorem6(np.stack([X, X]), target, params)  # a batch of X, one sample of target
    for method in ("dense", "power"):
        with pytest.raises(TypeError, match="target must hold integer class indices"):
            block_norms(X, target, params, loss="cross_entropy", method=method)
        with pytest.raises(TypeError, match="target must have dtype float32 or float64"):
            block_norms(X, classes, params, method=method)
    with pytest.raises(TypeError, match="sample_losses must hold real numbers"):
        bounds.theorem7(["0.1", "0.2"], [0.0, 0.0], M=1.0, distance=1.0)
    with pytest.raises(TypeError, match="sample_curvatures must hold real numbers"):
        bounds.quadratic_model_differences([0.1, 0.2], [True, False])
    with pytest.raises(ValueError, match="sample_losses contains NaN or Inf"):
        bounds.running_differences([0.1, np.nan])


# ---- NumPy scalars accepted, bools refused --------------------------------------------------------


def test_bounds_take_numpy_scalars_and_refuse_bools():
    expected = bounds.theorem7_rhs(np.array([1, 3]), 2.0, M=4.0, distance=0.5)
    found = bounds.theorem7_rhs(np.array([1, 3], dtype=np.uint8), np.float32(2.0), M=np.int64(4),
                                distance=np.float16(0.5))
    for key in ("stated", "corrected"):
        np.testing.assert_array_equal(found[key], expected[key])
    assert bounds.theorem7_rhs(np.int64(3), 2.0)["corrected"] == pytest.approx(0.5)
    for name in ("loss_bound", "M", "distance"):
        with pytest.raises(TypeError, match=f"{name} must be a real number, got bool"):
            bounds.theorem7_rhs(1, **(dict(loss_bound=1.0, M=1.0, distance=1.0) | {name: True}))
    with pytest.raises(TypeError, match="k must hold integers, got dtype bool"):
        bounds.theorem7_rhs(True, 1.0)
    with pytest.raises(TypeError, match="k must hold integers, got dtype float64"):
        bounds.theorem7_rhs(1.5, 1.0)
    X, target, params = problem()
    assert bounds.theorem6(X, target, params, eps=np.float32(0.25)) == bounds.theorem6(X, target, params, eps=0.25)
    assert bounds.lemma4(X, eps=np.float32(0.25)) == bounds.lemma4(X, eps=0.25)
    for call in (lambda: bounds.theorem6(X, target, params, eps=True),
                 lambda: bounds.proposition10(X, params, eps=True), lambda: bounds.lemma4(X, eps=True)):
        with pytest.raises(TypeError, match="eps must be a real number, got bool"):
            call()
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        bounds.proposition10(X, params, eps=-0.1)
