"""Fault-tolerant training: the per-replica-group Manager and FaultTolerantOptimizer.

The coordinator runs as ``python -m recopt.ft.lighthouse`` (`recopt.ft.lighthouse.Lighthouse`).

docs/fault_tolerance.md describes the step protocol, healing and the fused-embedding rules.
"""

from recopt.ft.embedding import replica_sync_optimizer
from recopt.ft.manager import Manager, ManagerConfig
from recopt.ft.nonfinite import NonFiniteGradientError
from recopt.ft.optim import FaultTolerantOptimizer
from recopt.ft.steps import StepParticipant, StepTransaction

# torchft's name for the same wrapper, kept for users coming from it.
OptimizerWrapper = FaultTolerantOptimizer

__all__ = [
    "FaultTolerantOptimizer",
    "Manager",
    "ManagerConfig",
    "NonFiniteGradientError",
    "OptimizerWrapper",
    "StepParticipant",
    "StepTransaction",
    "replica_sync_optimizer",
]
