"""dstrain: config-driven DeepSpeed training from one command."""

__version__ = "0.1.0"
