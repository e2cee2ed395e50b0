"""Recommendation models built on recopt's embedding modules: DLRM and DCNv2."""

from recopt.models.dlrm import DLRM, CrossNetwork, DLRMConfig, DotInteraction
from recopt.models.mlp import FusedLinear, mlp

__all__ = ["DLRM", "CrossNetwork", "DLRMConfig", "DotInteraction", "FusedLinear", "mlp"]
