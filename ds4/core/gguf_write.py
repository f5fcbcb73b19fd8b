"""Write a DS4-layout GGUF (metadata from a ModelConfig, tensors as raw block bytes), atomically."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from .atomic import atomic_path
from .config import ARCH, ModelConfig
from .quants import GGMLType, row_bytes


def _add_metadata(w: GGUFWriter, cfg: ModelConfig, tokens: list[str], merges: list[str]) -> None:
    w.add_name(cfg.name or "ds4-synthetic")
    for key, vtype, value in cfg.to_metadata():
        if isinstance(value, list):
            w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=vtype)
        else:
            w.add_key_value(key, value, vtype)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("joyai-llm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)


def write_gguf(path: str | os.PathLike, cfg: ModelConfig,
               tensors: dict[str, tuple[GGMLType, tuple[int, ...], np.ndarray]],
               tokens: list[str], merges: list[str]) -> Path:
    """tensors: name -> (type, GGUF dims, uint8 block bytes). Written to a temporary name, fsynced, renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, private=False) as tmp:
        w = GGUFWriter(tmp, ARCH)
        _add_metadata(w, cfg, tokens, merges)
        for name, (ttype, dims, data) in tensors.items():
            rb = row_bytes(ttype, dims[0])
            shaped = np.ascontiguousarray(data, dtype=np.uint8).reshape(*reversed(dims[1:]), rb)
            w.add_tensor(name, shaped, raw_dtype=GGMLQuantizationType(int(ttype)))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return path



def write_sparse_gguf(path: str | os.PathLike, cfg: ModelConfig, types: dict[str, GGMLType],
                      tokens: list[str], merges: list[str]) -> Path:
    """A full DS4 GGUF whose tensor data is a hole: the header is real, the file is extended to
    its full size without writing data. Used to check that opening a full-size model reads
    only its directory, and as the shape source for weights generated on a device."""
    from .layout import expected_tensors

    path = Path(path)
    w = GGUFWriter(path, ARCH)
    _add_metadata(w, cfg, tokens, merges)
    for name, spec in expected_tensors(cfg).items():
        ttype = types.get(name, spec.shipped)
        nbytes = row_bytes(ttype, spec.dims[0]) * int(np.prod(spec.dims[1:], dtype=np.int64))
        w.add_tensor_info(name, list(reversed(spec.dims)), np.dtype(np.float32), nbytes,
                          raw_dtype=GGMLQuantizationType(int(ttype)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    # tensor data: each tensor padded to the alignment, starting at the aligned end of the header
    total = sum(ti.nbytes + (-ti.nbytes) % w.data_alignment for ti in w.tensors[0].values())
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size + (-size) % w.data_alignment + total)
    return path
