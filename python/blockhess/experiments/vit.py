"""The one-block ViT of the paper's MNIST experiments (Table 1: hidden dim 16, ff dim 64, 1 block),
for the 16 tokens of 4 pixels of :mod:`.digits`, written functionally in PyTorch:

    X = patches W_E + b_E + P              linear patch embedding 4 -> 16, learned positions P (16, 16)
    Z = block(X)                           one post-LN block, BlockSpec(norm_affine=True, bias=True),
                                           d = d_k = 16, d_ff = 64
    logits = mean_tokens(Z) W_C + b_C      mean pooling, a linear classifier 16 -> 10

The paper specifies neither positional embeddings, nor d_k, nor biases, nor the head: the learned
positional embedding, d_k = d, the biases and the affine LayerNorms are our choices. The block's
forward is ``blockhess._torch_reference.family_block``, the package's independent torch definition of
every family member, so the trained block and blockhess's block are the same function by
construction; ``export`` hands its parameters, its input and the head to blockhess, and
``export_model`` the whole ViT (embedding, positions, block, classifier) as one blockhess model.

A model is a plain dict of leaf tensors (no nn.Module, so torch is only imported when a function
runs). Everything is float64: the model is tiny, so the cost is negligible, and blockhess's exact
Hessians are then taken at exactly the trained weights, with the torch and blockhess losses
agreeing to rounding (~1e-15) rather than to float32's 1e-7.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from ..block import BlockParams
from ..model import ModelSpec
from ..spec import BlockSpec
from ._optional import require
from .digits import CLASSES, FEATURES, TOKENS

SPEC = BlockSpec(norm_affine=True, bias=True)
D, D_K, D_FF = 16, 16, 64
BLOCK_NAMES = BlockParams.random(SPEC, d=D, d_k=D_K, d_ff=D_FF).names


class Settings(NamedTuple):
    """Training hyper-parameters: Adam with a cosine-decayed learning rate on minibatches."""

    steps: int
    batch_size: int = 64
    lr: float = 1e-2


FULL = Settings(steps=2000)
QUICK = Settings(steps=300)


class Problem(NamedTuple):
    """The block's loss on a batch, in blockhess's terms: ``blockhess.loss_value(X, labels, params,
    loss="pooled_cross_entropy", head=head)`` is the model's loss on that batch."""

    spec: BlockSpec
    params: BlockParams
    X: np.ndarray  # the block's input (B, 16, 16): embedded patches plus positions
    labels: np.ndarray  # (B,) int64
    head: tuple[np.ndarray, np.ndarray]  # (W_C (16, 10), b_C (10,))


def _torch():
    return require("torch")


def init_vit(seed: int = 0) -> dict[str, Any]:
    """Fresh float64 parameters: the block from ``BlockParams.random`` (weights N(0, 1/fan_in),
    gamma 1 + N(0, 0.01), biases N(0, 0.01)), the embedding and head with the same fan-in scaling,
    positions N(0, 0.1^2)."""
    torch = _torch()
    rng = np.random.default_rng(seed)
    block = BlockParams.random(SPEC, d=D, d_k=D_K, d_ff=D_FF, seed=int(rng.integers(1 << 31)))
    arrays = {name: block[name] for name in block.names}
    arrays.update(
        W_E=rng.standard_normal((FEATURES, D)) / math.sqrt(FEATURES), b_E=np.zeros(D),
        P=0.1 * rng.standard_normal((TOKENS, D)),
        W_C=rng.standard_normal((D, CLASSES)) / math.sqrt(D), b_C=np.zeros(CLASSES),
    )
    return {name: torch.tensor(a, dtype=torch.float64, requires_grad=True) for name, a in arrays.items()}


def embed(model: dict[str, Any], patches: Any) -> Any:
    """The block's input X (B, 16, 16) for patches (B, 16, 4)."""
    torch = _torch()
    return torch.as_tensor(patches, dtype=torch.float64) @ model["W_E"] + model["b_E"] + model["P"]


def logits(model: dict[str, Any], patches: Any) -> Any:
    from .. import _torch_reference

    Z = _torch_reference.family_block(embed(model, patches), SPEC, {n: model[n] for n in BLOCK_NAMES})
    return Z.mean(-2) @ model["W_C"] + model["b_C"]


def loss(model: dict[str, Any], patches: Any, labels: Any) -> Any:
    """The mean cross-entropy over the batch."""
    torch = _torch()
    return torch.nn.functional.cross_entropy(logits(model, patches), torch.as_tensor(labels))


def accuracy(model: dict[str, Any], patches: Any, labels: Any) -> float:
    torch = _torch()
    with torch.no_grad():
        return float((logits(model, patches).argmax(-1) == torch.as_tensor(labels)).double().mean())


def train(model: dict[str, Any], patches: np.ndarray, labels: np.ndarray, settings: Settings = FULL, *,
          seed: int = 0, callback: Callable[[int, dict[str, Any]], None] | None = None,
          progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train ``model`` in place on seeded minibatches. ``callback(step, model)`` runs before the first
    step (step 0) and after each step (1, 2, ...). Runs on one torch thread (restored afterwards).
    Returns the steps, the final training-batch loss, the seconds spent training and, apart, those
    spent in the callback."""
    if settings.steps < 1:
        raise ValueError(f"settings.steps must be >= 1, got {settings.steps}")
    torch = _torch()
    parameters = list(model.values())
    optimizer = torch.optim.Adam(parameters, lr=settings.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=settings.steps)
    rng = np.random.default_rng(seed)
    recording = 0.0  # seconds spent in the callback, kept apart from the training's own

    def call_back(step):
        nonlocal recording
        if callback is not None:
            started = time.perf_counter()
            callback(step, model)
            recording += time.perf_counter() - started

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # this model is far too small to gain from more, and the machine is shared
    start = time.perf_counter()
    try:
        call_back(0)
        for step in range(1, settings.steps + 1):
            batch = rng.choice(len(labels), settings.batch_size, replace=False)
            optimizer.zero_grad()
            value = loss(model, patches[batch], labels[batch])
            value.backward()
            optimizer.step()
            schedule.step()
            call_back(step)
            if progress is not None and step % max(1, settings.steps // 10) == 0:
                progress(f"training: step {step}/{settings.steps}, batch loss {float(value.detach()):.3f}")
    finally:
        torch.set_num_threads(threads)
    return {"steps": settings.steps, "final_batch_loss": float(value.detach()),
            "seconds": time.perf_counter() - start - recording, "callback_seconds": recording}


def export(model: dict[str, Any], patches: np.ndarray, labels: np.ndarray) -> Problem:
    """The block's loss on this batch as a blockhess problem (NumPy float64 copies of the current
    weights)."""
    torch = _torch()
    with torch.no_grad():
        params = BlockParams.from_arrays(SPEC, {n: model[n].detach().numpy().copy() for n in BLOCK_NAMES})
        X = embed(model, patches).numpy().copy()
        head = (model["W_C"].detach().numpy().copy(), model["b_C"].detach().numpy().copy())
    return Problem(SPEC, params, X, np.asarray(labels, dtype=np.int64), head)


# The whole ViT as a blockhess model: the patch embedding (W_E, b_E), the learned positions (P, as
# wpe), the block, and the classifier (W_C, b_C) on the mean token, all of them parameters.
MODEL = ModelSpec(SPEC, patch_dim=FEATURES, n_positions=TOKENS, classes=CLASSES)


def export_model(model: dict[str, Any]) -> tuple[ModelSpec, BlockParams]:
    """(MODEL, its parameters): NumPy float64 copies of the current weights, ``P`` named ``wpe``.
    ``blockhess.loss_value(patches, labels, params, loss="pooled_cross_entropy")`` is then
    :func:`loss`, and its derivatives are with respect to every parameter of the model."""
    torch = _torch()
    with torch.no_grad():
        arrays = {("wpe" if n == "P" else n): t.detach().numpy().copy() for n, t in model.items()}
    return MODEL, BlockParams.from_arrays(MODEL, arrays)
