"""pkvbench: what KV-cache compression costs in accuracy, at what budget."""

__version__ = "0.1.0"
