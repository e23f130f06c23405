"""blockhess: exact, closed-form Jacobians and Hessians of full Transformer blocks.

Conventions: ``vec_r(A) = A.reshape(-1)`` (row-major); Jacobians in numerator layout with shape
``(out.size, param.size)``; second derivatives in the paper's layout ``(out.size * p.size, q.size)``.

>>> import numpy as np, blockhess
>>> X = np.random.default_rng(0).standard_normal((4, 8))
>>> blockhess.layernorm_jacobian(X, layout="blocks").shape
(4, 8, 8)
"""

from __future__ import annotations

from importlib.metadata import version as _version

try:
    from . import _core
except ImportError as err:  # pragma: no cover - only without a build
    raise ImportError(
        "blockhess._core is missing: install the package with `pip install .` "
        "(developers: pip install --no-build-isolation -Cbuild-dir=build/dev -e .)"
    ) from err

from ._backend import cuda_available
from ._config import get_memory_budget, memory_budget, set_memory_budget
from ._paths import get_cmake_dir, get_include
from ._memory_cache import cached_memory, get_memory_cache_limit, release_memory, set_memory_cache_limit
from ._threads import get_num_threads, set_num_threads
from ._errors import NonFiniteError, OutputTooLargeError
from .layernorm import layernorm, layernorm_hessian, layernorm_hessian_contract, layernorm_jacobian
from .commutation import commutation_matrix, commutation_permutation, commute, kron_apply, unvec_r, vec_r
from .softmax import softmax, softmax_hessian, softmax_jacobian
from .attention import attention, attention_jacobian
from .ffn import ffn, ffn_cross_hessian, ffn_jacobian
from .block import (
    BlockParams,
    block_forward,
    block_jacobian,
    block_output_hessian,
    loss_gradient,
    loss_hessian,
    loss_value,
)
from .hvp import HessianOperator, hessian_operator, loss_hvp
from .estimate import Estimate
from .dataset import DatasetHessianOperator, dataset_hessian_operator
from . import spectrum
from .spec import BlockSpec
from .model import ModelSpec
from .from_torch import from_torch
from .patches import image_patches

__version__ = _version("blockhess")

__all__ = [
    "image_patches",
    # the Transformer block and its loss
    "BlockParams",
    "BlockSpec",
    "ModelSpec",
    "from_torch",
    "HessianOperator",
    "Estimate",
    "hessian_operator",
    "DatasetHessianOperator",
    "dataset_hessian_operator",
    "spectrum",
    "loss_hvp",
    "block_forward",
    "block_jacobian",
    "block_output_hessian",
    "loss_gradient",
    "loss_hessian",
    "loss_value",
    "NonFiniteError",
    "OutputTooLargeError",
    "__version__",
    "cuda_available",
    "get_cmake_dir",
    "get_include",
    "cached_memory",
    "get_memory_budget",
    "get_memory_cache_limit",
    "get_num_threads",
    "layernorm",
    "layernorm_hessian",
    "layernorm_hessian_contract",
    "layernorm_jacobian",
    "memory_budget",
    "release_memory",
    "set_memory_budget",
    "set_memory_cache_limit",
    "set_num_threads",
    # commutation / softmax / attention / FFN
    "attention",
    "attention_jacobian",
    "commutation_matrix",
    "commutation_permutation",
    "commute",
    "ffn",
    "ffn_cross_hessian",
    "ffn_jacobian",
    "kron_apply",
    "softmax",
    "softmax_hessian",
    "softmax_jacobian",
    "unvec_r",
    "vec_r",
]


def __dir__() -> list[str]:
    return list(__all__)
