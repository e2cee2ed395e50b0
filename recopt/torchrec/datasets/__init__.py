"""``torchrec.datasets``: the batch type TorchRec's training modules take."""

from recopt.torchrec.datasets import utils  # noqa: F401
