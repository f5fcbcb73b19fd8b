"""Tensor parallel over two ranks (wire.md §2): the leader (`TPEngine`) and the worker (`TPWorker`).

The split itself is core/tp_split.py; the forward pass's gates are core/graph.py's `Partner`;
the bytes are wire/ds4t/.
"""

from .leader import TPEngine, TPSession
from .link import TRANSPORTS, Options, TPClosed, TPError, TPRefused
from .worker import TPWorker

__all__ = ["TPEngine", "TPSession", "TPWorker", "Options", "TPError", "TPRefused", "TPClosed", "TRANSPORTS"]
