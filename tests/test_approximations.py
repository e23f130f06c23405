"""blockhess.approximations and ``blockhess approximations``: every error is computed from the exact
blocks (whose correctness test_model_curvature.py proves against autograd), so what is tested here
is each approximation and each measure against its definition, written independently:

- the nearest Kronecker product against the rearrangement of Van Loan and Pitsianis written entry
  by entry and a dense SVD of it: the fit's squared error is the sum of the trailing squared
  singular values, it recovers an exact Kronecker product, and no perturbation of its factors
  improves it;
- the errors on matrices whose answers are known by hand;
- the whole-model comparison's rows against the same quantities computed here from the dense
  Gauss-Newton matrix and Hessian.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import blockhess
from blockhess import BlockParams, BlockSpec, ModelSpec
from blockhess.approximations import compare, errors, kfac, layer_of, nearest_kronecker


def _rearranged(E, rows, cols):
    """R[(i, k), (j, l)] = E[(i, j), (k, l)], entry by entry from the definition."""
    R = np.empty((rows * rows, cols * cols))
    for i in range(rows):
        for j in range(cols):
            for k in range(rows):
                for l in range(cols):
                    R[i * rows + k, j * cols + l] = E[i * cols + j, k * cols + l]
    return R


def test_the_nearest_kronecker_product_is_the_leading_singular_pair(rng):
    rows, cols = 3, 4
    M = rng.standard_normal((rows * cols, rows * cols))
    E = M @ M.T
    A, B = nearest_kronecker(E, rows, cols)
    assert A.shape == (rows, rows) and B.shape == (cols, cols)
    s = np.linalg.svd(_rearranged(E, rows, cols), compute_uv=False)
    residual = np.linalg.norm(E - np.kron(A, B)) ** 2
    assert abs(residual - np.sum(s[1:] ** 2)) <= 1e-10 * np.sum(s ** 2)
    for _ in range(20):  # no nearby pair fits better
        dA, dB = 1e-3 * rng.standard_normal(A.shape), 1e-3 * rng.standard_normal(B.shape)
        assert np.linalg.norm(E - np.kron(A + dA, B + dB)) ** 2 >= residual - 1e-12
    # An exact Kronecker product of two positive definite factors is recovered, with its sign.
    P, Q = rng.standard_normal((rows, rows)), rng.standard_normal((cols, cols))
    exact = np.kron(P @ P.T, Q @ Q.T)
    A, B = nearest_kronecker(exact, rows, cols)
    assert np.linalg.norm(np.kron(A, B) - exact) <= 1e-12 * np.linalg.norm(exact)
    assert np.all(np.linalg.eigvalsh(A) > 0) and np.all(np.linalg.eigvalsh(B) > 0)


def test_the_errors_of_hand_made_matrices():
    E, M = np.diag([3.0, 2.0, 1.0]), np.diag([3.0, 2.0, 0.0])
    e = errors(E, M, top_k=2)
    assert e.relative_frobenius == pytest.approx(1 / np.sqrt(14), rel=1e-14)
    assert e.relative_spectral == pytest.approx(1 / 3, rel=1e-14)
    assert e.top_eigenvalue_ratio == pytest.approx(1.0) and e.top_k_overlap == pytest.approx(1.0)
    swapped = errors(np.diag([3.0, 1.0]), np.diag([1.0, 3.0]), top_k=1)  # the top eigenvector moves by 90 degrees
    assert swapped.top_k_overlap == pytest.approx(0.0, abs=1e-15) and swapped.top_eigenvalue_ratio == pytest.approx(1.0)
    assert errors(np.zeros((2, 2)), np.eye(2), top_k=1).top_eigenvalue_ratio is None
    # Above the dense size the top eigenpairs come from Lanczos: the same answers.
    n = 1600
    rng = np.random.default_rng(0)
    Q = np.linalg.qr(rng.standard_normal((n, n)))[0]
    values = np.linspace(0.0, 1.0, n) ** 4
    E = (Q * values) @ Q.T
    M = (Q * (values * 0.5)) @ Q.T
    big = errors(E, M, top_k=3)
    assert big.relative_spectral == pytest.approx(0.5, rel=1e-8) and big.top_k_overlap == pytest.approx(1.0, rel=1e-8)
    assert big.top_eigenvalue_ratio == pytest.approx(0.5, rel=1e-8)
    assert big.relative_frobenius == pytest.approx(0.5, rel=1e-10)


def _model(rng):
    spec = ModelSpec(BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True),
                     n_layers=2, patch_dim=3, n_positions=4, classes=3)
    params = BlockParams.random(spec, d=4, d_k=2, d_ff=5, seed=int(rng.integers(1 << 30)))
    return rng.standard_normal((5, 4, 3)), rng.integers(0, 3, size=5), params


def test_a_models_comparison_matches_its_definition(rng):
    X, labels, params = _model(rng)
    result = compare(X, labels, params, loss="pooled_cross_entropy", top_k=2)
    H = blockhess.loss_hessian(X, labels, params, loss="pooled_cross_entropy")
    G = blockhess.loss_hessian(X, labels, params, loss="pooled_cross_entropy", part="outer")
    rows = {(r.block, r.approximation, r.reference): r.errors for r in result.rows}
    where = params.slices()
    for name, shape in zip(params.names, params.shapes):
        G_b, H_b = G[where[name], where[name]], H[where[name], where[name]]
        if name.endswith("b_K"):  # the loss does not depend on a key bias: no rows
            assert not G_b.any() and not H_b.any() and (name, "diagonal", "hessian") not in rows
            continue
        diag_error = np.linalg.norm(G_b - np.diag(np.diag(G_b))) / np.linalg.norm(H_b)
        assert rows[name, "diagonal", "hessian"].relative_frobenius == pytest.approx(
            np.linalg.norm(H_b - np.diag(np.diag(G_b))) / np.linalg.norm(H_b), rel=1e-12)
        assert diag_error >= 0
        assert result.functional_weight[name] == pytest.approx(np.linalg.norm(H_b - G_b) / np.linalg.norm(H_b),
                                                               rel=1e-12)
        assert ((name, "kronecker", "gauss_newton") in rows) == (len(shape) == 2 and min(shape) > 1)
    layers = np.array([layer_of(n) for n, s in zip(params.names, params.shapes) for _ in range(int(np.prod(s)))])
    off_layer = np.where(layers[:, None] != layers[None, :], G, 0.0)
    assert rows["model", "block_diagonal", "gauss_newton"].relative_frobenius == pytest.approx(
        np.linalg.norm(off_layer) / np.linalg.norm(G), rel=1e-12)
    assert set(layer_of(n) for n in params.names) == {"input", "h.0", "h.1", "head"}
    assert [layer_of(n) for n in ("wte", "cls_token", "W_Q", "gamma_2", "ln_f.beta")] == \
        ["input", "input", "block", "block", "ln_f"]  # a one-block model's block is unprefixed
    assert json.loads(result.to_json())["rows"][0]["block"] == params.names[0]
    table = result.to_markdown()
    assert table.count("\n") == 2 + len({(r.block, r.approximation) for r in result.rows})
    assert "| model | block_diagonal |" in table


def test_the_command_writes_its_table_json_and_figure(tmp_path):
    out = tmp_path / "appr"
    done = subprocess.run([sys.executable, "-m", "blockhess", "approximations", "--layers", "1", "--batch", "4",
                           "--steps", "2", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "| model | block_diagonal |" in done.stdout and "1 block (P = 3514)" in done.stdout
    assert sorted(os.listdir(out)) == ["approximations.json", "approximations.md", "approximations.png"]
    assert json.loads((out / "approximations.json").read_text())["top_k"] == 5


def test_the_command_measures_a_language_model(tmp_path):
    out = tmp_path / "lm"
    done = subprocess.run([sys.executable, "-m", "blockhess", "approximations", "--model", "lm", "--layers", "1",
                           "--batch", "2", "--steps", "2", "--out", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert "language model with 1 block on copy sequences" in done.stdout and "2 sequences" in done.stdout
    # The tied embedding has the LM head's K-FAC, learned positions theirs as a lookup.
    assert "| wte | kfac_expand |" in done.stdout and "| wpe | kfac_reduce |" in done.stdout
    assert json.loads((out / "approximations.json").read_text())["functional_weight"]["wte"] >= 0


def test_copy_sequences_repeat_their_first_half():
    from blockhess.approximations_cli import copy_sequences

    ids = copy_sequences(5, seed=3)
    assert ids.shape == (5, 16) and ids.dtype == np.int64 and np.array_equal(ids[:, :8], ids[:, 8:])
    assert np.array_equal(ids, copy_sequences(5, seed=3)) and not np.array_equal(ids, copy_sequences(5, seed=4))


@pytest.mark.parametrize("argv,message", [
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--batch", "5000"], "--batch must be <= 1437"),
    (["--model", "lm", "--batch", "5000"], "--batch must be <= 2000 (the training sequences)"),
    (["--model", "bert"], "--model must be vit or lm, got 'bert'"),
    (["--steps", "-1"], "--steps must be >= 0"),
    (["--seed", "-3"], "--seed must be >= 0"),
    (["--top-k", "x"], "invalid int value"),
])
def test_bad_options_are_one_line(argv, message):
    done = subprocess.run([sys.executable, "-m", "blockhess", "approximations", *argv], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.parametrize("loss", ["mse", "cross_entropy", "pooled_cross_entropy"])
def test_kfac_of_one_token_is_the_exact_gauss_newton_block(rng, loss):
    """With one sample of one token both K-FAC flavours are exact: the block is
    sum_c (x (x) g_c)(x (x) g_c)^T = (x x^T) (x) (sum_c g_c g_c^T), A (x) G by definition (a bias's
    x = 1; learned positions' x the one-hot of position 0)."""
    if loss == "pooled_cross_entropy":
        spec = ModelSpec(BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True),
                         n_layers=2, patch_dim=3, n_positions=2, classes=3)
        X, target = rng.standard_normal((1, 1, 3)), np.array([1])
    else:
        spec = ModelSpec(BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True),
                         n_layers=2, final_norm=True)
        X = rng.standard_normal((1, 1, 4))
        target = rng.standard_normal((1, 1, 4)) if loss == "mse" else np.array([[2]])
    params = BlockParams.random(spec, d=4, d_k=2, d_ff=5, seed=int(rng.integers(1 << 30)))
    G = blockhess.loss_hessian(X, target, params, loss=loss, part="outer")
    where = params.slices()
    for flavour in ("expand", "reduce"):
        factors = kfac(X, target, params, loss=loss, flavour=flavour)
        weights = [n for n in params.names if n.rsplit(".", 1)[-1][2:] in ("Q", "K", "V", "O", "1", "2", "E", "C")
                   or n in ("wpe", "cls_token")]
        assert list(factors) == weights
        for name, (A, G_out) in factors.items():
            exact = G[where[name], where[name]]
            assert np.linalg.norm(np.kron(A, G_out) - exact) <= 1e-12 * max(np.linalg.norm(exact), 1e-300), name


def _hugging_face_vit(transformers, torch):
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=4, patch_size=2, num_channels=1, hidden_size=8, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=12, num_labels=3,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                    attn_implementation="sdpa")
    model = transformers.ViTForImageClassification(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("flavour", ["expand", "reduce"])
def test_kfac_equals_curvlinops_on_a_hugging_face_vit(flavour):
    """curvlinops' KFACLinearOperator (type-2 Fisher) of a Hugging Face ViT and blockhess's K-FAC of
    the same model imported by from_torch: every Linear of its encoder, A and G (and each bias's G)
    to 1e-10 (float64, sdpa's math kernel: the eager attention's softmax is float32). The classifier and the patch
    embedding are left out: Hugging Face applies its classifier to the class token's row alone and
    its Conv2d to the patches alone, where blockhess's nodes see every token (a class token's row
    of the classifier's input, the class token's zero patch), so their A differ by design."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    curvlinops = pytest.importorskip("curvlinops")
    model = _hugging_face_vit(transformers, torch)
    spec, params = blockhess.from_torch(model)
    images = torch.randn(5, 1, 4, 4, dtype=torch.float64)
    labels = torch.tensor([0, 2, 1, 1, 0])

    class Logits(torch.nn.Module):
        def __init__(self, vit):
            super().__init__()
            self.vit = vit

        def forward(self, pixel_values):
            return self.vit(pixel_values=pixel_values).logits

    wrapped = Logits(model)
    linears = {name: module for name, module in wrapped.named_modules()
               if isinstance(module, torch.nn.Linear) and ".layers." in name}
    ours_of = {"attention.q_proj": "W_Q", "attention.k_proj": "W_K", "attention.v_proj": "W_V",
               "attention.o_proj": "W_O", "mlp.fc1": "W_1", "mlp.fc2": "W_2"}
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        operator = curvlinops.KFACLinearOperator(
            wrapped, torch.nn.CrossEntropyLoss(), [m.weight for m in linears.values()], [(images, labels)],
            fisher_type=curvlinops.FisherType.TYPE2, kfac_approx=flavour, check_deterministic=False)
        operator.compute_kronecker_factors()
    ours = kfac(blockhess.image_patches(images, 2), labels.numpy(), params, loss="pooled_cross_entropy",
                flavour=flavour)
    assert len(linears) == 12
    # K-FAC-reduce's G of a key weight is zero in exact arithmetic (the softmax Jacobian's rows sum to
    # zero, so a sample's key cotangents do too): both sides are rounding noise there, measured
    # against the largest G.
    largest_G = max(np.linalg.norm(operator._gradient_covariances[name].numpy()) for name in linears)
    for name in linears:
        layer, part = name.split(".layers.")[1].split(".", 1)
        A, G = ours[f"h.{layer}.{ours_of[part]}"]
        theirs_A = operator._input_covariances[name].numpy()
        theirs_G = operator._gradient_covariances[name].numpy()
        assert np.linalg.norm(A - theirs_A) <= 1e-10 * np.linalg.norm(theirs_A), name
        scale = largest_G if flavour == "reduce" and part == "attention.k_proj" else np.linalg.norm(theirs_G)
        assert np.linalg.norm(G - theirs_G) <= 1e-10 * scale, name
        # The bias: curvlinops' separate bias has the module's G alone (an input of 1).
        one, bias_G = ours[f"h.{layer}.{ours_of[part].replace('W_', 'b_')}"]
        assert one.tolist() == [[1.0]] and np.linalg.norm(bias_G - theirs_G) <= 1e-10 * scale, name
        assert np.linalg.norm(theirs_G) > 1e-6 * largest_G or (flavour, part) == ("reduce", "attention.k_proj")


@pytest.mark.parametrize("loss", ["mse", "cross_entropy", "pooled_cross_entropy", "first_token"])
def test_kfac_reduce_of_a_bias_is_its_exact_gauss_newton_block(rng, loss):
    """A bias's gradient is the sum of its output cotangents over a sample's tokens, so K-FAC-reduce's
    G of a bias, sum_c sum_b (sum_t g_b,t,c)(...)^T, is its exact Gauss-Newton block wherever each
    sample is one loss term: a pooled or class-token classifier at any number of tokens, a per-token
    loss at one token per sample (with more, the reverse pass seeded by every token's column c at
    once, as curvlinops defines K-FAC, adds products of different tokens' columns that the exact
    matrix does not have). At several samples: the heads' square roots and the reverse passes they
    seed, checked against the exact matrix."""
    block = BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True, causal=True)
    if loss in ("pooled_cross_entropy", "first_token"):
        spec = ModelSpec(block, n_layers=2, patch_dim=3, n_positions=5, classes=3, class_token=loss == "first_token")
        X, target = rng.standard_normal((3, 4, 3)), rng.integers(0, 3, size=3)
        loss = "pooled_cross_entropy"
    else:
        spec = ModelSpec(block, n_layers=2, final_norm=True)
        X = rng.standard_normal((3, 1, 4))
        target = rng.standard_normal((3, 1, 4)) if loss == "mse" else rng.integers(0, 4, size=(3, 1))
    params = BlockParams.random(spec, d=4, d_k=2, d_ff=5, seed=int(rng.integers(1 << 30)))
    biases = tuple(n for n in params.names if n.rsplit(".", 1)[-1] in ("b_Q", "b_K", "b_V", "b_O", "b_1", "b_2"))
    G = blockhess.loss_hessian(X, target, params, loss=loss, part="outer", wrt=biases, layout="blocks")
    factors = kfac(X, target, params, loss=loss, wrt=biases, flavour="reduce")
    assert list(factors) == list(biases)
    scale = max(np.linalg.norm(G[b, b]) for b in biases)  # b_K's block is zero: softmax's shift invariance
    for name, (one, bias_G) in factors.items():
        assert one.tolist() == [[1.0]] and np.linalg.norm(bias_G - G[name, name]) <= 1e-12 * scale, name


@pytest.mark.parametrize("flavour", ["expand", "reduce"])
def test_kfac_of_an_embedding_is_that_of_a_linear_map_of_one_hot_inputs(rng, flavour):
    """A lookup by id is the linear map of the id's one-hot: a language model's wte (untied) and the
    patch embedding W_E of the same model reading one-hot patches (b_E = 0) have the same K-FAC, A
    the ids' frequencies (on the diagonal for expand) from the lookup and from the dense inputs of
    the linear map, whose K-FAC curvlinops checks; wpe is the same lookup in both models."""
    block = BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True, causal=True)
    V, B, L = 7, 3, 5
    lm = BlockParams.random(ModelSpec(block, n_layers=2, vocab_size=V, n_positions=L, final_norm=True),
                            d=4, d_k=2, d_ff=5, seed=int(rng.integers(1 << 30)))
    patches = ModelSpec(block, n_layers=2, patch_dim=V, n_positions=L, final_norm=True)
    arrays = {("W_E" if n == "wte" else n): lm[n] for n in lm.names}
    linear = BlockParams.from_arrays(patches, {**arrays, "b_E": np.zeros(4)})
    ids = rng.integers(0, V, size=(B, L))
    one_hot = np.eye(V)[ids]
    target = rng.integers(0, 4, size=(B, L))
    looked_up = kfac(ids, target, lm, loss="cross_entropy", flavour=flavour)
    mapped = kfac(one_hot, target, linear, loss="cross_entropy", flavour=flavour)
    for ours, theirs in (("wte", "W_E"), ("wpe", "wpe")):
        for a, b in zip(looked_up[ours], mapped[theirs]):
            assert np.linalg.norm(a - b) <= 1e-12 * np.linalg.norm(b), ours
    A = looked_up["wte"][0]
    if flavour == "expand":
        assert np.array_equal(A, np.diag(np.bincount(ids.ravel(), minlength=V) / (B * L)))


@pytest.mark.parametrize("flavour", ["expand", "reduce"])
def test_kfac_of_a_class_token_is_a_one_row_lookup(rng, flavour):
    """The class token is a table of one row that each sample's first token looks up: A = [[1/L]]
    (expand: one token in L) or [[1/L^2]] (reduce: the per-sample frequency squared), and G the sum
    over every token of its output's cotangents (K-FAC's definition, whatever the input), the same
    cotangents learned positions after it see: their G are equal."""
    block = BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True)
    L = 4
    spec = ModelSpec(block, n_layers=2, patch_dim=3, n_positions=L, classes=3, class_token=True)
    params = BlockParams.random(spec, d=4, d_k=2, d_ff=5, seed=int(rng.integers(1 << 30)))
    X, target = rng.standard_normal((3, L - 1, 3)), rng.integers(0, 3, size=3)  # the class token the L-th token
    factors = kfac(X, target, params, loss="pooled_cross_entropy", flavour=flavour, wrt=("cls_token", "wpe"))
    (A_c, G_c), (A_p, G_p) = factors["cls_token"], factors["wpe"]
    assert A_c.shape == (1, 1) and A_c[0, 0] == pytest.approx(1 / L if flavour == "expand" else 1 / L**2, rel=1e-15)
    expected_A_p = np.eye(L) / L if flavour == "expand" else np.full((L, L), 1 / L**2)
    assert np.allclose(A_p, expected_A_p, rtol=1e-15, atol=0)
    assert np.linalg.norm(G_c - G_p) <= 1e-14 * np.linalg.norm(G_p) and np.linalg.norm(G_p) > 0


@pytest.mark.parametrize("flavour", ["expand", "reduce"])
def test_kfac_of_a_tied_lm_head_equals_curvlinops_on_a_hugging_face_gpt2(flavour):
    """A wte tied to the LM head has K-FAC's factors of its use as the head's weight, logits_t =
    h_t wte^T, as curvlinops defines them (it hooks the LM head's Linear, not the embedding): wte's
    rows are the head's outputs, so its A (vocab, vocab) is curvlinops' gradient covariance and its
    G (d, d) the head's input covariance; to 1e-10 (float64, sdpa's math kernel) on a Hugging Face
    GPT-2 with the next-token loss."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    curvlinops = pytest.importorskip("curvlinops")
    torch.manual_seed(0)
    V = 11
    config = transformers.GPT2Config(vocab_size=V, n_positions=6, n_embd=8, n_layer=2, n_head=2, n_inner=12,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    _, params = blockhess.from_torch(model)
    ids = torch.randint(0, V, (3, 6))

    class ShiftedLogits(torch.nn.Module):  # the logits that predict a next token, one row each
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids).logits[:, :-1].reshape(-1, V)

    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        operator = curvlinops.KFACLinearOperator(
            ShiftedLogits(model), torch.nn.CrossEntropyLoss(), [model.lm_head.weight], [(ids, ids[:, 1:].reshape(-1))],
            fisher_type=curvlinops.FisherType.TYPE2, kfac_approx=flavour, check_deterministic=False)
        operator.compute_kronecker_factors()
    (name,) = operator._input_covariances
    A, G = kfac(ids.numpy(), ids.numpy(), params, loss="next_token", flavour=flavour, wrt=("wte",))["wte"]
    theirs_A, theirs_G = operator._gradient_covariances[name].numpy(), operator._input_covariances[name].numpy()
    assert A.shape == (V, V) and G.shape == (8, 8)
    assert np.linalg.norm(A - theirs_A) <= 1e-10 * np.linalg.norm(theirs_A)
    assert np.linalg.norm(G - theirs_G) <= 1e-10 * np.linalg.norm(theirs_G)
