"""recopt: sharded recommendation-model training with fused embedding optimizers."""

import warnings

__version__ = "0.1.0"

# ShardedTensor is how recopt exposes sharded weights and optimizer state (DCP reshards it);
# torch marks it deprecated in favour of DTensor. The warning is ours to handle, not the user's.
warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)
