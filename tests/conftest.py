"""Test-session setup.

Without a GPU, Triton's kernels run under its interpreter on CPU tensors. The switch is read when
Triton is imported, and any test module may import the Triton backend first (e.g. while listing
the backends present), so it is set here, before any test module is collected; the interpreter
then drops work it repeats for nothing (fast_interpreter.py).

Random inputs are the same every run (seeds.py), hypothesis' draws too: its "ds4" profile is
derandomized, and `--hypothesis-profile=explore` draws new examples each run.
"""

import importlib.util
import os

if importlib.util.find_spec("torch") is not None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ["TRITON_INTERPRET"] == "1" and importlib.util.find_spec("triton") is not None:
            from fast_interpreter import install

            install()

if importlib.util.find_spec("hypothesis") is not None:
    from hypothesis import settings

    settings.register_profile("ds4", derandomize=True, database=None)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile("ds4")
