"""``torchrec.models``: DLRM, DLRM_DCN and DLRMTrain with TorchRec's signatures."""

from recopt.torchrec.models import dlrm  # noqa: F401
