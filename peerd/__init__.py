"""peerd: pool volunteers' GPUs over the internet to train one model."""

import warnings

# peerd never converts tensors to numpy (nothing here needs it, and CI's fresh install has none), yet torch warns
# at import when numpy is missing; keep that noise out of every peer's log.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

__version__ = "0.1.0"
