"""Test-session setup.

Without a GPU, Triton's kernels run under its interpreter on CPU tensors. The switch is read when
Triton is imported, and any test module may import the Triton backend first (e.g. while listing
the backends present), so it is set here, before any test module is collected.
"""

import importlib.util
import os

if importlib.util.find_spec("torch") is not None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
