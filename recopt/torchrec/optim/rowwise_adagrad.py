"""``torchrec.optim.rowwise_adagrad``: recopt's dense row-wise Adagrad."""

from recopt.optim import RowWiseAdagrad

__all__ = ["RowWiseAdagrad"]
