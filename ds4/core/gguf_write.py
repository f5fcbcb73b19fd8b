"""Write a DS4-layout GGUF (metadata from a ModelConfig, tensors as raw block bytes), atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from .config import ARCH, ModelConfig
from .quants import GGMLType, row_bytes


def write_gguf(path: str | os.PathLike, cfg: ModelConfig,
               tensors: dict[str, tuple[GGMLType, tuple[int, ...], np.ndarray]],
               tokens: list[str], merges: list[str]) -> Path:
    """tensors: name -> (type, GGUF dims, uint8 block bytes). Written to a temporary name, fsynced, renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        w = GGUFWriter(tmp, ARCH)
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
        for name, (ttype, dims, data) in tensors.items():
            rb = row_bytes(ttype, dims[0])
            shaped = np.ascontiguousarray(data, dtype=np.uint8).reshape(*reversed(dims[1:]), rb)
            w.add_tensor(name, shaped, raw_dtype=GGMLQuantizationType(int(ttype)))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path

