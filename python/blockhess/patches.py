"""Images as a ViT's tokens: :func:`image_patches` cuts (B, C, H, W) images into non-overlapping
p x p patches, row-major over the grid of patches, each flattened in (channel, row, column) order:
the order of a ``Conv2d(C, d, kernel_size=p, stride=p)``'s weight, so that the patch embedding of a
Hugging Face ViT is ``image_patches(x, p) @ W.reshape(d, -1).T`` (what ``from_torch`` imports)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._interop import as_array
from ._validate import float_array, positive_int


def image_patches(images: Any, patch_size: int) -> np.ndarray:
    """(B, C, H, W) or (C, H, W) images (NumPy or torch) as (B, n, C p p) or (n, C p p) patches,
    n = (H / p)(W / p); H and W must be multiples of p."""
    p = positive_int(patch_size, "patch_size")
    x = float_array(as_array(images, "images"), "images", ndim=(3, 4))
    single = x.ndim == 3
    x = x[None] if single else x
    B, C, H, W = x.shape
    if H % p or W % p:
        raise ValueError(f"images of {H} x {W} pixels do not split into {p} x {p} patches")
    patches = np.asarray(x).reshape(B, C, H // p, p, W // p, p).transpose(0, 2, 4, 1, 3, 5)
    patches = np.ascontiguousarray(patches).reshape(B, (H // p) * (W // p), C * p * p)
    return patches[0] if single else patches
