"""Fault-tolerant training: a manager per replica group and FaultTolerantOptimizer.

The engine is torchft (`TorchftManager`, the ``ft`` extra; its lighthouse is the
``torchft_lighthouse`` command) or recopt's own (`Manager`, ``python -m recopt.ft.lighthouse``).

docs/fault_tolerance.md describes the step protocol, healing and the fused-embedding rules.
"""

from recopt.ft.embedding import replica_sync_optimizer
from recopt.ft.manager import Manager, ManagerConfig
from recopt.ft.nonfinite import NonFiniteGradientError
from recopt.ft.optim import FaultTolerantOptimizer
from recopt.ft.steps import StepParticipant, StepTransaction
from recopt.ft.torchft_manager import TorchftConfig, TorchftManager

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
    "TorchftConfig",
    "TorchftManager",
    "replica_sync_optimizer",
]
