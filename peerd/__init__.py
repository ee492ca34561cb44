"""peerd: pool volunteers' GPUs over the internet to train one model."""

__version__ = "0.1.0"
