"""Direct tests of the compiled module: strict dtypes, exception translation, version, GIL release."""

import threading
import time

import numpy as np
import pytest

import blockhess
from blockhess import _core


def test_version_has_one_source():
    assert blockhess.__version__ == _core.__cpp_version__


def test_public_api_is_exported():
    mine = {
        "vec_r", "unvec_r", "commutation_matrix", "commutation_permutation", "commute", "kron_apply",
        "softmax", "softmax_jacobian", "softmax_hessian", "attention", "attention_jacobian",
        "ffn", "ffn_jacobian", "ffn_cross_hessian",
    }
    assert mine <= set(blockhess.__all__)
    assert len(blockhess.__all__) == len(set(blockhess.__all__))
    for name in blockhess.__all__:
        assert hasattr(blockhess, name), name
    assert set(dir(blockhess)) == set(blockhess.__all__)


@pytest.mark.parametrize(
    "call",
    [
        lambda T, out: _core.softmax_forward(T, out),
        lambda T, out: _core.softmax_jacobian(T, 0, np.empty((3, 4, 4), dtype=out.dtype)),
        lambda T, out: _core.commute(T, 3, 1, out),  # 3 rows of 4 columns
    ],
)
def test_wrong_dtype_or_layout_is_refused_without_copy(call):
    T, out = np.ones((3, 4)), np.empty((3, 4))
    call(T, out)  # the accepted form
    strided = np.ones((3, 8))[:, ::2]
    for bad in (T.astype(np.int64), T.astype(np.float16), T.astype(np.complex128), np.asfortranarray(T), strided):
        with pytest.raises(TypeError, match="incompatible function arguments"):
            call(bad, out)
    with pytest.raises(TypeError, match="incompatible function arguments"):
        call(T.astype(np.float32), out)  # mixed float widths: no overload matches, nothing is cast


def test_every_binding_rejects_integer_arrays():
    i = np.ones((2, 2), dtype=np.int64)
    f = np.zeros((4, 4))
    calls = [
        lambda: _core.kron_apply(i, i, i, f.reshape(-1)[:4]),
        lambda: _core.commutation_dense(2, 2, f.astype(np.int64)),
        lambda: _core.softmax_hessian(i, 0, f),
        lambda: _core.attention_forward(i, i, i, i, f[:2, :2]),
        lambda: _core.attention_jacobian(i, i, i, i, 3, f),
        lambda: _core.ffn_forward(i, i, i, f[:2, :2]),
        lambda: _core.ffn_jacobian(i, i, i, 0, f),
        lambda: _core.ffn_cross_hessian(i, i, i, 0, f),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="incompatible function arguments"):
            call()


def test_cpp_invalid_argument_becomes_value_error():
    X, W = np.ones((3, 4)), np.ones((4, 2))
    with pytest.raises(ValueError, match="wrt must be 0..3"):
        _core.attention_jacobian(X, W, W, np.ones((4, 4)), 7, np.empty((12, 8)))
    with pytest.raises(ValueError, match="'out' has the wrong shape"):
        _core.attention_jacobian(X, W, W, np.ones((4, 4)), 3, np.empty((12, 8)))
    with pytest.raises(ValueError, match="'W_K' has the wrong shape"):
        _core.attention_forward(X, W, np.ones((4, 3)), np.ones((4, 4)), np.empty((3, 4)))
    with pytest.raises(ValueError, match="'W_2' has the wrong shape"):
        _core.ffn_forward(X, W, np.ones((3, 4)), np.empty((3, 4)))
    with pytest.raises(ValueError, match="unknown kind"):
        _core.softmax_hessian(X, 2, np.empty((3, 4, 4, 4)))
    with pytest.raises(ValueError, match="m and n must be >= 1"):
        _core.commutation_dense(0, 3, np.empty((0, 0)))
    with pytest.raises(ValueError, match="m\\*n rows"):
        _core.commute(np.ones(5), 2, 3, np.empty(5))
    read_only = np.empty((3, 4))
    read_only.setflags(write=False)
    with pytest.raises(ValueError, match="not writeable"):
        _core.softmax_forward(X, read_only)


def test_registries_are_the_cores_and_refuse_unknown_codes():
    """The names BlockSpec and loss= accept are the core's registries (params.hpp, activation.hpp,
    heads.hpp), a name's code its index; a code the core does not have is a ValueError naming it."""
    from blockhess import BlockSpec
    from blockhess.spec import activation_names, loss_names, norm_names, norm_position_names

    assert norm_position_names() == ("post", "pre") and norm_names() == ("layernorm", "rmsnorm")
    assert "gelu_tanh" in activation_names() and "pooled_cross_entropy" in loss_names()
    spec = BlockSpec(norm_position="pre", norm="rmsnorm", activation="silu")._core()
    assert spec[:2] == (1, 1) and spec[6] == activation_names().index("silu")
    core = BlockSpec()._core()
    for at, kind in ((0, "norm_position"), (1, "norm"), (6, "activation")):
        with pytest.raises(ValueError, match=f"{kind}: unknown code 9"):
            _core.block_parameters(core[:at] + (9,) + core[at + 1:], 4, 2, 4, 8)
    X, Wk = np.ones((1, 2, 4)), [np.ones((4, 2)), np.ones((4, 2)), np.ones((4, 4)), np.ones((4, 8)), np.ones((8, 4))]
    with pytest.raises(ValueError, match="loss: unknown code 5"):
        _core.loss_gradient(X, core, Wk, 0.0, 5, X, None, None)


def test_bindings_release_the_gil():
    # While two threads run a long binding, this thread must keep running Python: with the GIL
    # held, its heartbeat would stall for a whole call.
    rng = np.random.default_rng(0)
    L, d = 96, 32
    X = rng.standard_normal((L, d))
    W = rng.standard_normal((d, d)) / np.sqrt(d)
    expected = np.empty((L * d, L * d))
    start = time.perf_counter()
    _core.attention_jacobian(X, W, W, W, 3, expected)
    single = time.perf_counter() - start

    outs = [np.empty_like(expected) for _ in range(2)]
    threads = [threading.Thread(target=_core.attention_jacobian, args=(X, W, W, W, 3, o)) for o in outs]
    beats = [time.perf_counter()]
    for th in threads:
        th.start()
    while any(th.is_alive() for th in threads):
        time.sleep(0.001)
        beats.append(time.perf_counter())
    for th in threads:
        th.join(timeout=60)
    for o in outs:
        np.testing.assert_array_equal(o, expected)
    assert max(np.diff(beats)) < 0.5 * single + 0.02, (max(np.diff(beats)), single)
