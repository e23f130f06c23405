"""scikit-learn's handwritten digits (1,797 grey 8x8 images, bundled with scikit-learn: no download)
as sequences of 16 tokens: the 2x2 patches of each image, row-major over the 4x4 grid of patches,
each patch's 4 pixels row-major, pixels scaled from 0..16 to [0, 1]."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._optional import require

PATCH = 2
TOKENS = (8 // PATCH) ** 2  # 16
FEATURES = PATCH * PATCH  # 4
CLASSES = 10


class Digits(NamedTuple):
    """Patched images (N, 16, 4) float64 and labels (N,) int64 of the two parts of the split."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


def patchify(images: np.ndarray) -> np.ndarray:
    """(N, 8, 8) -> (N, 16, 4): the 2x2 patches, in reading order."""
    n, rows, cols = images.shape
    grid = images.reshape(n, rows // PATCH, PATCH, cols // PATCH, PATCH)
    return grid.transpose(0, 1, 3, 2, 4).reshape(n, -1, PATCH * PATCH)


def load_digits(*, test_fraction: float = 0.2, seed: int = 0) -> Digits:
    """The digits, patched and scaled, split by a seeded permutation (the same split for a seed)."""
    data = require("sklearn.datasets").load_digits()
    patches = patchify(data.images.astype(np.float64) / 16.0)
    labels = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_test = int(round(test_fraction * len(labels)))
    test, train = order[:n_test], order[n_test:]
    return Digits(patches[train], labels[train], patches[test], labels[test])
