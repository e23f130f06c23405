"""The CPU core's cache of large buffers: kept between calls up to its limit, released on request,
and never a change in any result."""

import numpy as np
import pytest

import blockhess


@pytest.fixture(autouse=True)
def restore_limit():
    before = blockhess.get_memory_cache_limit()
    yield
    blockhess.set_memory_cache_limit(before)


SPEC = blockhess.BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True,
                           activation="gelu", causal=True)


def _problem(d=64, d_ff=512):
    """Hidden units of 2 x 64 tokens x 512 columns: 512 KiB buffers, which the cache keeps."""
    params = blockhess.BlockParams.random(SPEC, d=d, d_k=16, d_ff=d_ff, seed=4)
    rng = np.random.default_rng(5)
    X = rng.standard_normal((2, 64, d))
    v = rng.standard_normal(params.size)
    return X, params, v


def test_default_limit_and_buffers_kept_after_a_call():
    assert blockhess.get_memory_cache_limit() == 256 * 2**20
    X, params, v = _problem()
    blockhess.release_memory()
    assert blockhess.cached_memory() == 0
    blockhess.loss_hvp(X, X, params, v)
    held = blockhess.cached_memory()
    assert 0 < held <= blockhess.get_memory_cache_limit()
    assert blockhess.release_memory() == held
    assert blockhess.cached_memory() == 0


def test_results_do_not_depend_on_the_cache():
    X, params, v = _problem()
    Xs, small, _ = _problem(d=16, d_ff=32)  # a dense Hessian of 2,768 parameters (61 MB)
    blockhess.set_memory_cache_limit(0)
    uncached = [blockhess.loss_hvp(X, X, params, v), blockhess.loss_gradient(X, X, params),
                blockhess.loss_hessian(Xs, Xs, small)]
    assert blockhess.cached_memory() == 0
    blockhess.set_memory_cache_limit("64MiB")
    for _ in range(2):  # the second round runs on reused blocks, whatever they held
        cached = [blockhess.loss_hvp(X, X, params, v), blockhess.loss_gradient(X, X, params),
                  blockhess.loss_hessian(Xs, Xs, small)]
        for a, b in zip(uncached, cached):
            assert a.tobytes() == b.tobytes()


def test_lowering_the_limit_frees_what_is_over_it():
    X, params, v = _problem()
    blockhess.loss_hvp(X, X, params, v)
    assert blockhess.cached_memory() > 0
    blockhess.set_memory_cache_limit(0)
    assert blockhess.cached_memory() == 0
    blockhess.loss_hvp(X, X, params, v)
    assert blockhess.cached_memory() == 0
    blockhess.set_memory_cache_limit(2**20)
    blockhess.loss_hvp(X, X, params, v)
    assert blockhess.cached_memory() <= 2**20


@pytest.mark.parametrize("bad, error", [(-1, ValueError), ("lots", ValueError), (1.5, ValueError),
                                        (float("inf"), ValueError), (True, TypeError), (None, TypeError)])
def test_bad_limits_are_refused(bad, error):
    with pytest.raises(error, match="memory cache limit"):
        blockhess.set_memory_cache_limit(bad)
