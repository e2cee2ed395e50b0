"""``torchrec.optim.optimizers``: the parameter filter and the optimizer classes TorchRec
exports here (torch's own; TorchRec's are thin subclasses of them).

Applied in backward to an embedding table, ``SGD`` and ``Adagrad`` map to recopt's fused
kernels; ``Adam`` (a dense update of every row) has no fused equivalent and is refused by
`DistributedModelParallel`, naming it: ``torch.optim.SparseAdam`` is the fused Adam.
"""

from torch.optim import SGD, Adagrad, Adam

from recopt.optim import in_backward_optimizer_filter

__all__ = ["SGD", "Adagrad", "Adam", "in_backward_optimizer_filter"]
