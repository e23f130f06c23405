"""The paper's experiments (§5: Exp1, Exp2, Exp3, Exp5), reproduced on real data that needs no download:
scikit-learn's handwritten digits, cut into 2x2 patches, classified by a one-block ViT whose block is
the blockhess family member ``BlockSpec(norm_affine=True, bias=True)``.

    from blockhess.experiments import run_experiments
    results = run_experiments("figures", quick=True)

Modules: ``digits`` (the data), ``vit`` (the model, its training and its export to blockhess),
``paper`` (one function per experiment and ``run_experiments``). They need the ``paper`` extra
(torch, matplotlib, scikit-learn: ``pip install "blockhess[paper]"``); importing this package does
not import any of them.
"""

from __future__ import annotations

__all__ = ["run_experiments"]


def run_experiments(outdir, *, quick=False, progress=None, seed=0):
    """See :func:`blockhess.experiments.paper.run_experiments` (imported on first use)."""
    from .paper import run_experiments as run

    return run(outdir, quick=quick, progress=progress, seed=seed)
