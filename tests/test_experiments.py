"""blockhess.experiments: the paper's Exp1, Exp2, Exp3 and Exp5 on scikit-learn's digits, in the quick
setting only (one quick run of everything, shared by the tests, about 30 s on 2 cores)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("sklearn")

import blockhess
from blockhess.experiments import digits

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    from blockhess.experiments import run_experiments

    outdir = tmp_path_factory.mktemp("figures")
    messages = []
    return run_experiments(outdir, quick=True, progress=messages.append), outdir, messages


@pytest.fixture(scope="module")
def problem():
    """The blockhess problem of an untrained model on 6 training digits."""
    pytest.importorskip("torch")
    from blockhess.experiments import vit

    data = digits.load_digits()
    return vit.init_vit(0), data.train_x[:6], data.train_y[:6]


def test_data_shapes_and_split():
    data = digits.load_digits()
    assert data.train_x.shape == (1438, 16, 4) and data.test_x.shape == (359, 16, 4)
    assert data.train_y.dtype == np.int64 and set(np.unique(data.train_y)) == set(range(10))
    assert 0 <= data.train_x.min() and data.train_x.max() <= 1
    again = digits.load_digits()
    assert np.array_equal(again.train_x, data.train_x) and np.array_equal(again.test_y, data.test_y)
    other = digits.load_digits(seed=1)
    assert not np.array_equal(other.test_y, data.test_y)
    # The split is a partition of the 1,797 images: together the two parts are all of them, once.
    from sklearn.datasets import load_digits

    def rows_sorted(a):
        a = a.reshape(len(a), -1)
        return a[np.lexsort(a.T[::-1])]

    every = digits.patchify(load_digits().images / 16.0)
    assert np.array_equal(rows_sorted(np.concatenate([data.train_x, data.test_x])), rows_sorted(every))


def test_patchify_reads_2x2_patches_in_order():
    image = np.arange(64.0).reshape(1, 8, 8)
    patches = digits.patchify(image)
    assert patches.shape == (1, 16, 4)
    assert patches[0, 0].tolist() == [0, 1, 8, 9]  # the top-left patch, row-major
    assert patches[0, 1].tolist() == [2, 3, 10, 11]  # its right neighbour
    assert patches[0, 4].tolist() == [16, 17, 24, 25]  # the patch below the first


def test_torch_loss_is_blockhess_loss(problem):
    import torch

    from blockhess.experiments import vit

    model, patches, labels = problem
    spec, params, X, y, head = vit.export(model, patches, labels)
    assert spec == blockhess.BlockSpec(norm_affine=True, bias=True)
    assert params.names == blockhess.BlockParams.random(spec, d=16, d_k=16, d_ff=64).names
    assert X.shape == (6, 16, 16) and X.dtype == np.float64
    assert head[0].shape == (16, 10) and head[1].shape == (10,)
    with torch.no_grad():
        torch_loss = float(vit.loss(model, patches, labels))
    value = blockhess.loss_value(X, y, params, loss="pooled_cross_entropy", head=head)
    assert abs(value - torch_loss) <= 1e-12 * abs(torch_loss)
    from blockhess.experiments import paper

    losses = paper.per_sample_losses(vit.Problem(spec, params, X, y, head))
    assert abs(losses.mean() - value) <= 1e-12 * value
    for i in (0, 5):
        assert abs(losses[i] - blockhess.loss_value(X[i], y[i], params, loss="pooled_cross_entropy",
                                                    head=head)) <= 1e-12 * losses[i]


def test_hessian_is_symmetric_and_laid_out_by_name(problem):
    from blockhess.experiments import paper, vit

    model, patches, labels = problem
    exported = vit.export(model, patches, labels)
    H = paper.loss_hessian(exported)
    assert H.shape == (exported.params.size, exported.params.size) == (3008, 3008)
    assert np.array_equal(H, H.T)
    blocks = blockhess.loss_hessian(exported.X, exported.labels, exported.params, loss="pooled_cross_entropy",
                                    head=exported.head, layout="blocks")
    slices = exported.params.slices()
    for a, b in (("W_Q", "W_V"), ("gamma_1", "W_2"), ("beta_2", "beta_2")):
        assert np.allclose(H[slices[a], slices[b]], blocks[a, b], rtol=0, atol=1e-14 * np.abs(H).max())
    norms = paper.diagonal_block_norms(exported)
    dense_norms = paper.diagonal_block_norms(exported, H)
    for kind in ("spectral", "frobenius"):
        assert np.allclose(list(norms[kind].values()), list(dense_norms[kind].values()), rtol=1e-10, atol=1e-14)


def test_quick_training_beats_chance(quick_run):
    results, _, messages = quick_run
    training = results["training"]
    assert training["test_accuracy"] > 0.8  # chance is 0.1; the quick run reaches about 0.94
    assert training["steps"] == 300 and training["seconds"] > 0
    assert any("training" in m for m in messages) and messages[-1].startswith("done")


def test_results_are_json(quick_run):
    results, _, _ = quick_run
    for key in ("exp1", "exp2", "exp3", "exp5", "training", "figures"):
        json.dumps(results[key], allow_nan=False)
    assert json.loads(json.dumps(results))["exp5"]["slope"] == results["exp5"]["slope"]


def test_figures_are_pngs(quick_run):
    results, outdir, _ = quick_run
    assert set(results["figures"]) == {"exp1", "exp1_blocks", "exp2", "exp3", "exp5"}
    for filename in results["figures"].values():
        path = outdir / filename
        assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 10_000


def test_exp1_layout_follows_the_parameters(quick_run):
    exp1 = quick_run[0]["exp1"]
    params = blockhess.BlockParams.random(blockhess.BlockSpec(norm_affine=True, bias=True), d=16, d_k=16, d_ff=64)
    assert exp1["names"] == list(params.names)
    assert exp1["slices"] == [[s.start, s.stop] for s in params.slices().values()]
    for when in ("init", "trained"):
        table = np.asarray(exp1[f"block_max_abs_{when}"])
        assert np.array_equal(table, table.T)  # H is symmetric, so is the table of its blocks
        assert list(exp1[f"max_abs_{when}"].values()) == np.diag(table).tolist()
        # b_K adds q_i . b_K to every score of row i, which the row's softmax ignores: its blocks are 0.
        assert exp1[f"max_abs_{when}"]["b_K"] == 0.0


def test_exp2_and_exp3_norms(quick_run):
    results = quick_run[0]
    exp2, exp3 = results["exp2"], results["exp3"]
    names = results["exp1"]["names"]
    assert list(exp2["parameter_frobenius"]) == list(exp2["hessian_spectral"]) == names
    for name in names:
        # ||A||_2 <= ||A||_F
        assert exp2["hessian_spectral"][name] <= exp2["hessian_frobenius"][name] * (1 + 1e-12)
    assert exp3["steps"] == [0, 10, 20, 30]
    assert list(exp3["spectral"]) == names and all(len(v) == 4 for v in exp3["spectral"].values())
    assert all(np.all(np.asarray(v) >= 0) for v in exp3["spectral"].values())


def test_exp5_slope_and_theorem7(quick_run):
    exp5 = quick_run[0]["exp5"]
    assert np.isfinite(exp5["slope"]) and exp5["slope"] < 0
    k, difference = np.asarray(exp5["k"]), np.asarray(exp5["difference"])
    corrected, stated = np.asarray(exp5["corrected"]), np.asarray(exp5["stated"])
    assert k.tolist() == list(range(1, exp5["samples"]))
    # At w = w*: |L_{k+1} - L_k| = |l_{k+1} - L_k| / (k+1) <= L_max / (k+1), losses being >= 0.
    assert np.all(difference <= corrected) and np.all(corrected <= stated)
    assert np.allclose(corrected, exp5["loss_max"] / (k + 1), rtol=1e-15)
    assert exp5["max_ratio_to_corrected"] <= 1


def test_missing_package_says_what_to_install(monkeypatch):
    import sys

    from blockhess.experiments import _optional

    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules makes the import fail
    with pytest.raises(ImportError, match=r'needs matplotlib.*pip install "blockhess\[paper\]"'):
        _optional.require("matplotlib.pyplot")


def test_importing_the_experiments_imports_no_optional_package():
    import subprocess
    import sys

    code = ("import sys, blockhess.experiments, blockhess.experiments.vit, blockhess.experiments.paper; "
            "print(sorted({'torch', 'matplotlib', 'sklearn'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
