"""bench/triton/parity_full.py's model file: written with a record of what it holds, and kept by
--reuse-gguf only when that record matches the run's model arguments."""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("torch")  # (parity_full imports the engine, whose Triton backend needs torch)

from bench_modules import bench_module  # noqa: E402
from ds4.core.quants import GGMLType as T  # noqa: E402
from ds4.core.tiny import preset_config  # noqa: E402

TYPES = {"ffn_gate_exps.weight": T.IQ2_XXS, "ffn_up_exps.weight": T.IQ2_XXS, "ffn_down_exps.weight": T.Q2_K}


@pytest.fixture(scope="module")
def parity():
    return bench_module("triton", "parity_full")


def test_reuse_keeps_only_a_file_written_with_the_same_arguments(parity, tmp_path):
    path = str(tmp_path / "m.gguf")
    cfg = preset_config("test")
    assert parity.write_model(path, cfg, TYPES, 0, reuse=True)  # nothing there yet: written
    first = open(path, "rb").read()
    record = json.loads(open(path + ".json").read())
    assert record["seed"] == 0 and record["types"]["ffn_down_exps.weight"] == int(T.Q2_K)
    assert not parity.write_model(path, cfg, TYPES, 0, reuse=True)  # same arguments: kept
    assert parity.write_model(path, cfg, TYPES, 1, reuse=True)  # another seed: written again
    assert open(path, "rb").read() != first
    other = dataclasses.replace(cfg, swiglu_clamp=(5.0,) * cfg.n_layer)
    assert parity.write_model(path, other, TYPES, 1, reuse=True)  # another config: written again
    assert parity.write_model(path, other, TYPES, 1, reuse=False)  # no reuse: always written
    (tmp_path / "m.gguf.json").unlink()
    assert parity.write_model(path, other, TYPES, 1, reuse=True)  # no record: written
