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

import pytest

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


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (its own CA), made with the openssl tool."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem"), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return d


@pytest.fixture
def private_cache(tmp_path_factory, monkeypatch):
    """A command-line test's environment: a cache of its own, so the embedded default model is
    never written into the user's, and a terminal wide enough that messages are not wrapped."""
    monkeypatch.setenv("DS4_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """The test preset's tiny model, written once per module (a module that needs another seed
    or preset defines its own model_path)."""
    from ds4.core.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("model") / "test.gguf", preset="test")


@pytest.fixture
def read_only_dir(tmp_path, monkeypatch):
    """A directory this process may not create files in: mode 0555. A process that writes there
    anyway (root, CAP_DAC_OVERRIDE) is told no by os.access for it, as any other user is, since
    that is how the commands check a directory before writing (cli/common.py output_file)."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    if os.access(d, os.W_OK):
        real = os.access

        def access(path, mode, *args, **kwargs):
            if mode & os.W_OK and os.path.realpath(path) == os.path.realpath(d):
                return False
            return real(path, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", access)
    yield d
    d.chmod(0o755)
