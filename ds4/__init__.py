"""ds4: DeepSeek V4 Flash inference on nodes with different accelerators."""

from .engine import Engine, Session

__all__ = ["Engine", "Session"]
__version__ = "0.1.0"
