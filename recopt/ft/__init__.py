"""Fault-tolerant training: the per-replica-group Manager and OptimizerWrapper.

The coordinator runs as ``python -m recopt.ft.lighthouse`` (`recopt.ft.lighthouse.Lighthouse`).

docs/fault_tolerance.md describes the step protocol, healing and the fused-embedding rules.
"""

from recopt.ft.manager import Manager, ManagerConfig, StepParticipant
from recopt.ft.optim import OptimizerWrapper

__all__ = [
    "Manager",
    "ManagerConfig",
    "OptimizerWrapper",
    "StepParticipant",
]
