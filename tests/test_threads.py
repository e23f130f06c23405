"""The core's thread pool: results bit-identical for every thread count and under concurrent calls,
no deadlock when several Python threads (or a forked child) use it, the thread-count setting and its
environment variables."""

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import reference as ref

import blockhess
from blockhess import _threads

MNIST = (49, 16, 16, 64)  # (L, d, d_k, d_ff): large enough for every parallel loop of the Hessian


@pytest.fixture(autouse=True)
def restore_thread_count():
    before = _threads.get_num_threads()
    yield
    _threads.set_num_threads(before)


def _calls():
    """Named zero-argument calls, each large enough to run its loops in parallel."""
    rng = np.random.default_rng(9)
    X, W, target, _ = ref.random_block(rng, *MNIST)
    Xb, Wb, targetb, classesb = ref.random_block(rng, 8, 16, 8, 32, B=3)
    params, paramsb = blockhess.BlockParams(*W), blockhess.BlockParams(*Wb)
    LN = rng.standard_normal((64, 128))
    S = rng.standard_normal((64, 32))
    A = [rng.standard_normal(s) for s in [(16, 32), (32, 32), (32, 32), (32, 32)]]
    # Every option on: the bias and gamma/beta rows are column sums, whose bits once depended on
    # where they sat in the output (and so on the thread count).
    everything = blockhess.BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True,
                                     activation="gelu", causal=True)
    pe = blockhess.BlockParams.random(everything, d=8, d_k=4, d_ff=16, seed=3)
    Xe = rng.standard_normal((3, 16, 8))
    ve = rng.standard_normal(pe.size)
    head = (rng.standard_normal((8, 3)), rng.standard_normal(3))
    stack = blockhess.ModelSpec(everything, n_layers=2)
    ps = blockhess.BlockParams.random(stack, d=8, d_k=4, d_ff=16, seed=4)
    return {
        # The dense Hessians of a block with many pieces (heads) are assembled block by block on
        # the pool; the pooled head's site then adds to all of it between two rounds of blocks.
        "loss_hessian_everything": lambda: blockhess.loss_hessian(Xe, Xe, pe),
        "loss_hessian_everything_pooled": lambda: blockhess.loss_hessian(Xe, np.array([0, 2, 1]), pe,
                                                                         loss="pooled_cross_entropy", head=head),
        "loss_hvp_everything": lambda: blockhess.loss_hvp(Xe, Xe, pe, ve),
        "loss_gradient_everything": lambda: blockhess.loss_gradient(Xe, Xe, pe),
        "hessian_diagonal_everything": lambda: blockhess.hessian_operator(Xe, Xe, pe).diagonal(),
        "loss_hessian": lambda: blockhess.loss_hessian(X, target, params),
        "loss_hessian_f32": lambda: blockhess.loss_hessian(X.astype(np.float32), target.astype(np.float32),
                                                           blockhess.BlockParams(*(w.astype(np.float32) for w in W))),
        "loss_hessian_batch_ce": lambda: blockhess.loss_hessian(Xb, classesb, paramsb, loss="cross_entropy"),
        "loss_hessian_functional": lambda: blockhess.loss_hessian(Xb, targetb, paramsb, part="functional"),
        "layernorm_jacobian": lambda: blockhess.layernorm_jacobian(LN, layout="dense"),
        "layernorm_hessian_blocks": lambda: blockhess.layernorm_hessian(LN[:16, :64], layout="blocks"),
        "softmax_hessian_blocks": lambda: blockhess.softmax_hessian(S, layout="blocks"),
        "attention_jacobian": lambda: blockhess.attention_jacobian(*A, "W_K"),
        "block_jacobian": lambda: blockhess.block_jacobian(X, params, "W_1"),
        # A lower layer's: one forward tangent per entry, the columns shared among the threads.
        "block_jacobian_lower_layer": lambda: blockhess.block_jacobian(Xe[0], ps, "h.0.W_1"),
    }


CALLS = _calls()


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", sorted(CALLS))
def test_bit_identical_for_every_thread_count(name):
    results = {}
    for n in (1, 2, 3):
        _threads.set_num_threads(n)
        assert _threads.get_num_threads() == n
        results[n] = CALLS[name]()
        assert _same_bits(CALLS[name](), results[n]), "two calls with the same thread count differ"
    assert _same_bits(results[2], results[1])
    assert _same_bits(results[3], results[1])


def test_hessian_symmetric_and_finite_with_three_threads():
    _threads.set_num_threads(3)
    H = CALLS["loss_hessian"]()
    assert np.isfinite(H).all()
    assert _same_bits(H, np.ascontiguousarray(H.T))


def _run_threads(target, count, timeout=120):
    errors = []

    def guarded(k):
        try:
            target(k)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(k,), daemon=True) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish: deadlock?"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_concurrent_calls_from_four_python_threads(threads):
    _threads.set_num_threads(threads)
    names = ["loss_hessian", "layernorm_jacobian", "softmax_hessian_blocks", "loss_hessian_batch_ce"]
    expected = {name: CALLS[name]() for name in names}
    barrier = threading.Barrier(4)
    outputs = {k: [] for k in range(4)}

    def work(k):
        barrier.wait()
        for r in range(3):
            name = names[(k + r) % len(names)]
            outputs[k].append((name, CALLS[name]()))

    _run_threads(work, 4)
    for k in range(4):
        assert len(outputs[k]) == 3
        for name, out in outputs[k]:
            assert _same_bits(out, expected[name]), f"{name} from a concurrent thread differs"


def test_changing_thread_count_while_other_threads_compute():
    expected = CALLS["loss_hessian"]()
    stop = threading.Event()

    def work(k):
        if k == 0:
            for n in [1, 3, 2, 4, 1, 2] * 3:
                _threads.set_num_threads(n)
                CALLS["layernorm_jacobian"]()
            stop.set()
            return
        while not stop.is_set():
            assert _same_bits(CALLS["loss_hessian"](), expected)

    _run_threads(work, 3)


def test_exception_in_a_parallel_call_leaves_the_pool_usable():
    _threads.set_num_threads(2)
    rng = np.random.default_rng(1)
    X, W, target, _ = ref.random_block(rng, *MNIST)
    with pytest.raises((ValueError, TypeError)):
        blockhess.loss_hessian(X, target[:3], blockhess.BlockParams(*W))
    assert _same_bits(CALLS["loss_hessian"](), CALLS["loss_hessian"]())


@pytest.mark.parametrize("bad", [0, -1, -(2**40)])
def test_set_num_threads_rejects_non_positive(bad):
    with pytest.raises(ValueError, match="between 1 and"):
        _threads.set_num_threads(bad)


@pytest.mark.parametrize("bad", [1.5, 2.0, "2", None, True, [2]])
def test_set_num_threads_rejects_non_integers(bad):
    with pytest.raises(TypeError, match="must be an int"):
        _threads.set_num_threads(bad)


def test_set_num_threads_accepts_numpy_integers_and_rejects_huge_counts():
    _threads.set_num_threads(np.int64(3))
    assert _threads.get_num_threads() == 3
    with pytest.raises(ValueError):
        _threads.set_num_threads(10**6)
    assert _threads.get_num_threads() == 3


def _child(code, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("BLOCKHESS_NUM_THREADS", "OMP_NUM_THREADS")}
    full.update(env)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("env,expected", [
    ({"BLOCKHESS_NUM_THREADS": "1"}, 1),
    ({"BLOCKHESS_NUM_THREADS": "3", "OMP_NUM_THREADS": "1"}, 3),
    ({"OMP_NUM_THREADS": "3,2"}, 3),
    ({"BLOCKHESS_NUM_THREADS": "zero", "OMP_NUM_THREADS": "2"}, 2),
])
def test_thread_count_from_the_environment(env, expected):
    assert _child("from blockhess import _threads; print(_threads.get_num_threads())", **env) == str(expected)


def test_default_thread_count_is_the_affinity_mask():
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity mask on this platform")
    out = _child("from blockhess import _threads; print(_threads.get_num_threads())")
    assert out == str(len(os.sched_getaffinity(0)))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_workers_start_lazily_and_follow_set_num_threads():
    out = _child("""
        import os, numpy as np
        from blockhess import _threads, layernorm_jacobian
        count = lambda: len(os.listdir("/proc/self/task"))
        X = np.random.default_rng(0).standard_normal((64, 128))
        base = count()
        layernorm_jacobian(X, layout="blocks")   # 3 threads: starts 2 workers
        started = count() - base
        _threads.set_num_threads(1)
        layernorm_jacobian(X, layout="blocks")   # stops them
        print(started, count() - base)
    """, BLOCKHESS_NUM_THREADS="3")
    assert out == "2 0"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_can_use_the_pool():
    # A process pool forks after the parent has started its workers; the child must not wait for
    # threads that do not exist there.
    out = _child("""
        import os, signal, numpy as np, blockhess
        g = np.random.default_rng(3)
        X, target = g.standard_normal((49, 16)), g.standard_normal((49, 16))
        p = blockhess.BlockParams(*(0.3 * g.standard_normal(s) for s in [(16, 16), (16, 16), (16, 16), (16, 64), (64, 16)]))
        H = blockhess.loss_hessian(X, target, p)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # never outlive the test if it hangs
            ok = blockhess.loss_hessian(X, target, p).tobytes() == H.tobytes()
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
        os.close(w)
        got = os.read(r, 1)
        os.waitpid(pid, 0)
        print(got.decode())
    """, BLOCKHESS_NUM_THREADS="2")
    assert out == "1"
