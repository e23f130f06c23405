"""The paper's spectral-norm bounds next to the exact norms blockhess computes.

Each function returns :class:`Bound` records: the exact value, the bound as the paper states it, and
a corrected bound that provably holds (the derivation is in each module's docstring and in
docs/errata.md, which also names the erratum it fixes). A bound past the float64 range is inf (it
holds, vacuously); an exact value past it is a NonFiniteError.

- :func:`lemma4`: the LayerNorm Jacobian and Hessian norms;
- :func:`theorem1`: the lone self-attention layer's loss Hessian, per block and whole (M);
- :func:`proposition10`: the norms of Y, FFN(Y) and S;
- :func:`theorem6`: the paper's block, its 15 parameter blocks and M_tr;
- :func:`theorem7`, :func:`theorem7_rhs`: the loss difference |L_{k+1} - L_k|.
"""

from ._bound import Bound
from ._norms import block_norms
from .attention import theorem1
from .block import theorem6
from .layernorm import lemma4
from .loss_difference import quadratic_model_differences, running_differences, theorem7, theorem7_rhs
from .proposition10 import proposition10

__all__ = ["Bound", "block_norms", "lemma4", "proposition10", "quadratic_model_differences", "running_differences",
           "theorem1", "theorem6", "theorem7", "theorem7_rhs"]
