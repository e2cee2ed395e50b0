"""Fault-tolerant training on torchft: a manager per replica group and FaultTolerantOptimizer.

The engine is torchft's Manager and Rust lighthouse (the ``ft`` extra; its lighthouse is the
``torchft_lighthouse`` command); recopt adds the fused-table rollback, embedding replica sync,
the non-finite vote and a tensor-only healing transport. ``Manager`` / ``ManagerConfig`` are
the torchft-backed `TorchftManager` / `TorchftConfig`.

docs/fault_tolerance.md describes the step protocol, healing and the fused-embedding rules.
"""

from recopt.ft.launch import make_fault_tolerant
from recopt.ft.nonfinite import NonFiniteGradientError
from recopt.ft.optim import FaultTolerantOptimizer
from recopt.ft.replica_sync import replica_sync_optimizer
from recopt.ft.steps import StepParticipant, StepTransaction
from recopt.ft.torchft_manager import TorchftConfig, TorchftManager

# torchft's name for the same wrapper, kept for users coming from it.
OptimizerWrapper = FaultTolerantOptimizer
# The one engine left: the names of recopt's retired engine now mean the torchft one.
Manager = TorchftManager
ManagerConfig = TorchftConfig

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
    "make_fault_tolerant",
    "replica_sync_optimizer",
]
