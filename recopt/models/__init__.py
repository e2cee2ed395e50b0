"""Recommendation models built on recopt's embedding modules: DLRM and DCNv2."""

from recopt.models.dlrm import DLRM, CrossNetwork, DLRMConfig, DotInteraction

__all__ = ["DLRM", "CrossNetwork", "DLRMConfig", "DotInteraction"]
