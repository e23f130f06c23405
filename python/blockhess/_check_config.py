"""The configuration of ``blockhess check`` (and ``blockhess spectrum``): :class:`Config`, which
mirrors the block's spec and sizes; the command-line options that fill it and their validation; and
the seeded problem (input, target, parameters) it describes."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._command_line import UsageError, check_seed
from .block import BlockParams, _parameter_table
from .spec import BlockSpec, activation_names, loss_names, norm_names, norm_position_names


@dataclass
class Config:
    L: int = 49
    d: int = 16
    d_k: int = 16
    d_ff: int = 64
    batch: int = 1
    loss: str = "mse"
    dtype: str = "float64"
    seed: int = 0
    eps: float = 0.0
    device: str = "cpu"
    reference: str = "auto"
    # The block (BlockSpec; the defaults are the paper's block) and a pooled head's classes.
    norm_position: str = "post"
    norm: str = "layernorm"
    affine: bool = False
    bias: bool = False
    heads: int = 1
    out_proj: bool = False
    activation: str = "relu"
    causal: bool = False
    attention_only: bool = False
    classes: int = 10

    @property
    def spec(self) -> BlockSpec:
        """The block (eps is passed to every call, so the spec keeps the default)."""
        return BlockSpec(norm_position=self.norm_position, norm=self.norm, norm_affine=self.affine, bias=self.bias,
                         heads=self.heads, out_proj=self.out_proj, activation=self.activation, causal=self.causal,
                         attention_only=self.attention_only)

    @property
    def pooled(self) -> bool:
        return self.loss == "pooled_cross_entropy"

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(d, d_k, d_v, d_ff): d_k per head, d_v = d / heads."""
        return self.d, self.d_k, max(1, self.d // self.heads), self.d_ff

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        """[(name, shape)] of the block's parameters in the canonical order."""
        return _parameter_table(self.spec, *self.dims)

    def describe(self) -> str:
        """The block in words: "post-LN Transformer block" for the paper's, its options otherwise."""
        spec = self.spec
        name = (f"{spec.norm_position}-{'LN' if spec.norm == 'layernorm' else 'RMSNorm'} Transformer block"
                if not spec.attention_only else "self-attention layer")
        options = [f"{spec.heads} heads" if spec.heads > 1 else "",
                   "affine norms" if spec.norm_affine else "", "biases" if spec.bias else "",
                   "W_O" if spec.out_proj else "", spec.activation if spec.activation != "relu" else "",
                   "causal" if spec.causal else ""]
        options = [o for o in options if o]
        return name + (f" ({', '.join(options)})" if options else "")


def make_problem(cfg: Config):
    """Seeded input, target, parameters (in the spec's canonical order: weights scaled by
    1/sqrt(fan-in), as at initialisation; gamma 1 + N(0, 0.1^2), betas and biases N(0, 0.1^2)) and,
    for loss="pooled_cross_entropy", the classifier head (W_C (d, classes), b_C); else None."""
    rng = np.random.default_rng(cfg.seed)
    lead = (cfg.L,) if cfg.batch == 1 else (cfg.batch, cfg.L)
    X = rng.standard_normal((*lead, cfg.d))
    weights = []
    for name, shape in cfg.parameters():
        if len(shape) == 2:
            weights.append(rng.standard_normal(shape) / math.sqrt(shape[0]))
        else:
            weights.append((1.0 if name.startswith("gamma") else 0.0) + 0.1 * rng.standard_normal(shape))
    head = None
    if cfg.loss == "mse":
        target = rng.standard_normal((*lead, cfg.d))
    elif cfg.pooled:
        target = rng.integers(0, cfg.classes, size=lead[:-1])
        head = (rng.standard_normal((cfg.d, cfg.classes)) / math.sqrt(cfg.d), 0.1 * rng.standard_normal(cfg.classes))
    else:
        target = rng.integers(0, cfg.d, size=lead)
    dtype = np.dtype(cfg.dtype)
    X = X.astype(dtype)
    weights = [w.astype(dtype) for w in weights]
    if cfg.loss == "mse":
        target = target.astype(dtype)
    if head is not None:
        head = tuple(a.astype(dtype) for a in head)
    return X, target, weights, head


def block_params(weights, cfg: Config) -> BlockParams:
    return BlockParams.from_arrays(cfg.spec, {name: w for (name, _), w in zip(cfg.parameters(), weights)})


def add_block_options(parser: argparse.ArgumentParser) -> None:
    """The sizes, the loss and the block's spec options (shared by ``blockhess spectrum``)."""
    defaults = Config()
    parser.add_argument("--L", type=int, default=defaults.L, help="tokens per sample (default 49, the paper's MNIST block)")
    parser.add_argument("--d", type=int, default=defaults.d, help="model width (default 16)")
    parser.add_argument("--d-k", dest="d_k", type=int, default=defaults.d_k, help="query/key width per head (default 16)")
    parser.add_argument("--d-ff", dest="d_ff", type=int, default=defaults.d_ff, help="FFN width (default 64)")
    parser.add_argument("--batch", type=int, default=1, help="samples; > 1 gives the batch-mean Hessian")
    parser.add_argument("--loss", choices=loss_names(), default="mse",
                        help="pooled_cross_entropy: the paper's ViT classifier (mean over tokens, a fixed "
                        "random linear head of --classes outputs, one class per sample)")
    parser.add_argument("--classes", type=int, default=defaults.classes,
                        help="classes of the pooled head (default 10)")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eps", type=float, default=0.0,
                        help="LayerNorm epsilon (default 0, as in the paper; --d 1 needs eps > 0)")
    block = parser.add_argument_group("the block (defaults: the paper's post-LN block)")
    block.add_argument("--norm-position", dest="norm_position", choices=norm_position_names(), default="post")
    block.add_argument("--norm", choices=norm_names(), default="layernorm")
    block.add_argument("--affine", action="store_true", help="trainable gamma (and beta) in both norms")
    block.add_argument("--bias", action="store_true", help="a bias on every linear map")
    block.add_argument("--heads", type=int, default=1, help="attention heads (d_k per head; d_v = d / heads)")
    block.add_argument("--out-proj", dest="out_proj", action="store_true", help="W_O after the heads")
    block.add_argument("--activation", choices=activation_names(), default="relu")
    block.add_argument("--causal", action="store_true", help="mask keys after the query")
    block.add_argument("--attention-only", dest="attention_only", action="store_true",
                       help="the self-attention sublayer alone, Z = attn(X) (the paper's Thm 1; no norms, no FFN, "
                            "--d-ff ignored)")


def config_from_args(args: Any, **extra: Any) -> Config:
    return Config(L=args.L, d=args.d, d_k=args.d_k, d_ff=args.d_ff, batch=args.batch, loss=args.loss,
                  dtype=args.dtype, seed=args.seed, eps=args.eps, norm_position=args.norm_position, norm=args.norm,
                  affine=args.affine, bias=args.bias, heads=args.heads, out_proj=args.out_proj,
                  activation=args.activation, causal=args.causal, attention_only=args.attention_only,
                  classes=args.classes, **extra)


def validate_block(cfg: Config) -> None:
    """The sizes, seed, eps and block options (shared with ``blockhess spectrum``): UsageError."""
    for name in ("L", "d", "d_k", "d_ff", "batch", "heads", "classes"):
        value = getattr(cfg, name)
        if value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    check_seed(cfg.seed)
    if not math.isfinite(cfg.eps) or cfg.eps < 0:
        raise UsageError(f"--eps must be a finite number >= 0, got {cfg.eps}")
    if cfg.d == 1 and cfg.eps == 0 and not cfg.attention_only:
        raise UsageError("--d 1 with --eps 0: LayerNorm of a single feature has zero variance (0/0); "
                         "pass --eps > 0, e.g. --eps 1e-5")
    try:
        cfg.spec  # options that mean nothing together (e.g. --attention-only with --norm rmsnorm)
    except ValueError as err:
        raise UsageError(f"the block options do not go together: {err}") from None
    try:
        cfg.parameters()  # the spec's own constraints (e.g. heads * d_v == d without --out-proj)
    except ValueError as err:
        raise UsageError(f"the block options do not fit the sizes: {err}") from None
