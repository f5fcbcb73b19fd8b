"""Open a DS4 GGUF: memory-map it, read the config, validate every tensor, fingerprint it.

Opening reads the metadata and the tensor directory only. Tensor data stays in the page cache
behind numpy memmap views until a backend touches it, so a 153 GB file opens as fast as a tiny one.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType

from .config import ConfigError, ModelConfig
from .layout import expected_tensors
from .quants import GGMLType, block_format, row_bytes


class ModelError(ValueError):
    """The file is not a valid DS4-layout GGUF; the message lists every problem found."""


@dataclass(frozen=True)
class Tensor:
    name: str
    type: GGMLType
    dims: tuple[int, ...]  # GGUF order (dims[0] contiguous)
    raw: np.ndarray  # uint8 view of the tensor's bytes in the mapped file, shape [..., row_bytes]

    @property
    def n_bytes(self) -> int:
        return self.raw.size

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.type, self.dims[0])

    def rows(self) -> np.ndarray:
        """[n_rows, row_bytes] uint8 view: one row per output of a linear layer (all experts)."""
        return self.raw.reshape(-1, self.row_bytes)

    def expert(self, e: int) -> np.ndarray:
        """[out, row_bytes] uint8 view of one expert's contiguous slab of a 3-D expert tensor."""
        return self.raw.reshape(self.dims[2], self.dims[1], self.row_bytes)[e]

    def values(self) -> np.ndarray:
        """Typed view (no copy) of a plain tensor (F32/F16/I32), reversed-dims shape."""
        dtype = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.I32: np.int32}
        if self.type not in dtype:
            raise TypeError(f"{self.name}: values() needs F32/F16/I32, tensor is {self.type.name}")
        return self.raw.view(dtype[self.type]).reshape(tuple(reversed(self.dims)))


class GGUFModel:
    """A mapped DS4 GGUF: config, tensors (views), fingerprint, tokenizer vocabulary."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"model file not found: {self.path}")
        try:
            self._reader = _Reader(self.path, "r")
        except Exception as e:  # gguf-py raises bare ValueError/struct.error on a broken header
            raise ModelError(f"{self.path}: not a readable GGUF file ({e})") from e
        version = int(self._reader.fields["GGUF.version"].contents())
        if version != 3:
            raise ModelError(f"GGUF.version: expected 3, got {version}")
        self.file_size = self.path.stat().st_size
        fields = {k: (list(f.types), _contents(f)) for k, f in self._reader.fields.items()
                  if not k.startswith("tokenizer.ggml.")}
        try:
            self.config = ModelConfig.from_metadata(fields)
        except ConfigError as e:
            raise ModelError(str(e)) from e
        self.metadata = {k: v for k, (_, v) in fields.items()}
        self.tensors = self._validated_tensors()
        self.fingerprint = self._fingerprint()

    # ---- validation -----------------------------------------------------------------------------

    def _validated_tensors(self) -> dict[str, Tensor]:
        expected = expected_tensors(self.config)
        problems: list[str] = []
        tensors: dict[str, Tensor] = {}
        for rt in self._reader.tensors:
            name = rt.name
            try:
                ttype = GGMLType(int(rt.tensor_type))
            except ValueError:
                problems.append(f"{name}: unsupported block type id {int(rt.tensor_type)}")
                continue
            dims = tuple(int(d) for d in rt.shape)
            spec = expected.get(name)
            if spec is None:
                problems.append(f"{name}: unexpected tensor (not part of the DS4 layout)")
                continue
            if ttype not in spec.types:
                allowed = ", ".join(sorted(t.name for t in spec.types))
                problems.append(f"{name}: expected type one of {allowed}, got {ttype.name}")
                continue
            if dims != spec.dims:
                problems.append(f"{name}: expected dims {list(spec.dims)}, got {list(dims)}")
                continue
            if dims[0] % block_format(ttype).block_values:
                problems.append(f"{name}: dims[0]={dims[0]} is not a whole number of "
                                f"{ttype.name} blocks of {block_format(ttype).block_values}")
                continue
            raw = np.asarray(rt.data).view(np.uint8)
            want = row_bytes(ttype, dims[0]) * int(np.prod(dims[1:], dtype=np.int64))
            if raw.size != want:
                problems.append(f"{name}: expected {want} bytes of data, got {raw.size}")
                continue
            tensors[name] = Tensor(name, ttype, dims, raw.reshape(-1))
        for name, spec in expected.items():
            if spec.required and name not in tensors and not any(p.startswith(name + ":") for p in problems):
                problems.append(f"{name}: required tensor is missing")
        for il in range(self.config.n_layer):
            g, u = (tensors.get(f"blk.{il}.ffn_{k}_exps.weight") for k in ("gate", "up"))
            if g is not None and u is not None and g.type != u.type:
                problems.append(f"blk.{il}.ffn_up_exps.weight: expected the gate's type "
                                f"{g.type.name}, got {u.type.name}")
        if problems:
            head = f"{self.path}: {len(problems)} layout problem(s):\n  "
            raise ModelError(head + "\n  ".join(problems))
        return tensors

    # ---- identity -------------------------------------------------------------------------------

    def _fingerprint(self) -> bytes:
        """SHA-256 over the metadata section and tensor directory, plus the file size (wire.md)."""
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            h.update(f.read(self._reader.data_offset))
        h.update(struct.pack("<Q", self.file_size))
        return h.digest()

    @property
    def fingerprint64(self) -> int:
        return int.from_bytes(self.fingerprint[:8], "little")

    # ---- accessors ------------------------------------------------------------------------------

    def tensor(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"model has no tensor {name!r}") from None

    def get(self, name: str) -> Tensor | None:
        return self.tensors.get(name)

    def census(self) -> dict[str, tuple[int, int]]:
        """{type name: (tensor count, bytes)}"""
        count, size = Counter(), Counter()
        for t in self.tensors.values():
            count[t.type.name] += 1
            size[t.type.name] += t.n_bytes
        return {k: (count[k], size[k]) for k in sorted(count)}

    @cached_property
    def vocabulary(self) -> tuple[list[str], list[str]]:
        """(tokens, merges) as stored in tokenizer.ggml.tokens / tokenizer.ggml.merges."""
        fields = self._reader.fields
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key not in fields:
                raise ModelError(f"{key}: required metadata key is missing")
            if list(fields[key].types) != [GGUFValueType.ARRAY, GGUFValueType.STRING]:
                raise ModelError(f"{key}: expected ARRAY of STRING")
        return (_strings(fields["tokenizer.ggml.tokens"]), _strings(fields["tokenizer.ggml.merges"]))


def _contents(field):
    # Big string arrays are skipped by the caller; everything else is small.
    return field.contents()


class _Reader(GGUFReader):
    """gguf-py's reader, except that a string array is kept as one byte span.

    gguf-py builds numpy views per string, which for the 129k-token vocabulary and its merges
    takes seconds; opening a model must not. The span is decoded only when the tokenizer asks.
    """

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type == GGUFValueType.ARRAY:
            itype = self._get(orig_offs, np.uint32)
            if itype[0] == GGUFValueType.STRING:
                alen = self._get(orig_offs + 4, np.uint64)
                start = orig_offs + 12
                end = _skip_strings(self.data, start, int(alen[0]))
                span = self.data[start:end]
                return end - orig_offs, [itype, alen, span], [2], [GGUFValueType.ARRAY, GGUFValueType.STRING]
        return super()._get_field_parts(orig_offs, raw_type)


def _skip_strings(data: np.ndarray, offs: int, count: int) -> int:
    buf = memoryview(data)
    size = len(buf)
    for _ in range(count):
        if offs + 8 > size:
            raise ModelError(f"string array runs past the end of the file at byte {offs}")
        (n,) = struct.unpack_from("<Q", buf, offs)
        offs += 8 + n
    if offs > size:
        raise ModelError(f"string array runs past the end of the file ({offs} > {size})")
    return offs


def _strings(field) -> list[str]:
    span = memoryview(field.parts[-1])  # parts: key…, item type, count, span
    count = int(field.parts[-2][0])
    out, offs = [], 0
    for _ in range(count):
        (n,) = struct.unpack_from("<Q", span, offs)
        out.append(bytes(span[offs + 8: offs + 8 + n]).decode("utf-8"))
        offs += 8 + n
    return out
