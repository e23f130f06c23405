"""``blockhess check --model``: a whole model's exact Hessian-vector products against the module's own
reverse-over-reverse autograd and finite differences, with torch's forward-over-reverse reported beside
them (it is wrong for layer_norm with a weight in torch 2.13: docs/errata.md's appendix)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from blockhess import _check_model, check
from blockhess._progress import Progress

transformers = pytest.importorskip("transformers")


def _tiny_gpt2(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=13, n_positions=8, n_embd=8, n_layer=2, n_head=2, n_inner=12,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # away from the initialisation's tiny weights (and gamma = 1, beta = 0)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def test_check_model_verifies_a_gpt2_language_model():
    model = _tiny_gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    dtype = next(model.parameters()).dtype
    report = _check_model.check_model(model, "tiny", L=6, batch=2, vectors=2, seed=0, progress=Progress(False))
    assert report.ok and report.loss == "next_token" and report.P == sum(p.numel() for p in model.parameters())
    assert report.against_autograd <= 1e-10 and report.against_finite_differences <= 1e-5
    assert all(p.against_autograd <= 1e-10 for p in report.parameters)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the caller's model untouched
    assert next(model.parameters()).dtype == dtype  # checked on float64 copies


def test_check_model_reports_torchs_forward_over_reverse_error():
    """torch.func's forward over reverse disagrees with reverse over reverse on the parameters
    under an affine LayerNorm (torch 2.13), while blockhess agrees with reverse over reverse; the
    report names them as torch's error."""
    report = _check_model.check_model(_tiny_gpt2(1), "tiny", L=5, batch=1, vectors=1, seed=1, progress=Progress(False))
    assert report.ok and report.forward_over_reverse_against_autograd > 1e-6
    wrong = {p.name for p in report.parameters if p.against_forward_over_reverse > 1e-6}
    assert "ln_f.gamma" in wrong or any(n.endswith("gamma_1") or n.endswith("gamma_2") for n in wrong)
    text = _check_model.format_model_report(report)
    assert "torch.func forward-over-reverse (jvp of jacrev, as torch.func.hessian) disagrees" in text and "not blockhess's" in text and "verified" in text


def test_check_model_on_a_saved_encoder_and_from_the_command_line(tmp_path):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, num_layers=2, norm=torch.nn.LayerNorm(8), enable_nested_tensor=False)
    path = tmp_path / "encoder.pt"
    torch.save(encoder, path)
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "blockhess", "check", "--model", str(path), "--L", "5", "--batch", "2",
                           "--vectors", "2", "--json", str(out), "--quiet"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "verified" in done.stdout and "mse" in done.stdout
    report = json.loads(out.read_text())
    assert report["ok"] and report["P"] == sum(p.numel() for p in encoder.parameters())


@pytest.mark.parametrize("argv,message", [
    (["--model", "no-such-model"], "no such file, and not a configuration name (gpt2-tiny, gpt2"),
    (["--model", "gpt2-tiny", "--d", "32"], "--d does not apply"),
    (["--model", "gpt2-tiny", "--d", "32", "--causal"], "--d, --causal do not apply"),
    (["--model", "gpt2-tiny", "--vectors", "0"], "--vectors must be >= 1"),
    (["--model", "gpt2-tiny", "--L", "500"], "the model has 128 positions"),
])
def test_check_model_refuses_bad_options_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        check.main([*argv, "--quiet"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_check_model_refuses_a_file_that_is_not_a_module(tmp_path, capsys):
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, path)
    with pytest.raises(SystemExit) as exit_:
        check.main(["--model", str(path), "--quiet"])
    assert exit_.value.code == 2 and "holds a dict, not a torch.nn.Module" in capsys.readouterr().err


def test_check_model_verifies_a_hugging_face_vit_classifier():
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=8, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=12, num_labels=3, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0, attn_implementation="eager")
    model = transformers.ViTForImageClassification(config)
    report = _check_model.check_model(model, "vit", L=99, batch=2, vectors=2, seed=0, progress=Progress(False))
    assert report.ok and report.loss == "pooled_cross_entropy" and report.tokens == 5  # 4 patches and the class token
    assert report.P == sum(p.numel() for p in model.parameters())
