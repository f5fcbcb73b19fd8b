"""Open a DS4 GGUF: memory-map it, read the config, validate every tensor, fingerprint it.

Every count and length in the header (metadata arrays and strings, the key and tensor counts,
tensor dims, each tensor's data range) is checked against the bytes left in the file before
anything is read or allocated, so a hostile or truncated file is an error naming the key or
tensor, never an endless loop or a numpy internal. The hash layers' expert table is checked
against the expert count. Apart from that table, opening reads the metadata and the tensor
directory only. Tensor data stays in the page cache
behind numpy memmap views until a backend touches it, so a 153 GB file opens as fast as a tiny one.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from collections import Counter
from dataclasses import dataclass, field as dataclass_field
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

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
    # A tensor-parallel rank's part (core/tp_split.py): the tensor it was cut from, and the cut
    # as a function of that tensor's flat bytes (numpy or torch), so a backend that makes its
    # own bytes (Triton's synthetic weights) can cut them the same way.
    whole: "Tensor | None" = dataclass_field(default=None, compare=False, repr=False)
    cut: Callable | None = dataclass_field(default=None, compare=False, repr=False)

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
        except ModelError as e:
            raise ModelError(f"{self.path}: {e}") from None
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
        problems += _expert_table_problems(self.config, tensors)
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
        return (_strings(fields["tokenizer.ggml.tokens"], "tokenizer.ggml.tokens"),
                _strings(fields["tokenizer.ggml.merges"], "tokenizer.ggml.merges"))


def _contents(field):
    # Big string arrays are skipped by the caller; everything else is small.
    return field.contents()


def _expert_table_problems(cfg, tensors: dict[str, "Tensor"]) -> list[str]:
    """A hash layer routes token t to the experts in row t of ffn_gate_tid2eid: every id must
    name an expert (a negative one would index another expert from the end)."""
    problems = []
    for il in range(cfg.n_layer):
        t = tensors.get(f"blk.{il}.ffn_gate_tid2eid.weight")
        if t is None or t.type != GGMLType.I32:
            continue
        table = t.values()  # [vocab, n_expert_used]
        bad = np.argwhere((table < 0) | (table >= cfg.n_expert))
        if bad.size:
            tok, k = (int(x) for x in bad[0])
            problems.append(f"{t.name}: expert ids must be in [0, {cfg.n_expert}), token {tok} "
                            f"slot {k} has {int(table[tok, k])} ({len(bad)} bad entries)")
    return problems


# The fewest bytes one item of each kind can take in the file, to bound a count by the bytes left.
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims, type, offset
_MIN_ARRAY_BYTES = 4 + 8  # item type, count
_STRING_LEN_BYTES = 8
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Reader(GGUFReader):
    """gguf-py's reader, bounded, and with a string array kept as one byte span.

    Bounded: every read is checked against the end of the file, and every count against the
    bytes left (a count of 2^63 would otherwise loop and grow without end); errors are
    ModelErrors naming the metadata key or tensor being read.

    gguf-py builds numpy views per string, which for the 129k-token vocabulary and its merges
    takes seconds; opening a model must not. The span is decoded only when the tokenizer asks.
    An array of numbers is likewise one view (its `contents()` is the whole list).
    """

    _where = "the GGUF header"

    def _get(self, offset, dtype, count=1, override_order=None):
        count = int(count)
        need = count * np.dtype(dtype).itemsize
        left = len(self.data) - int(offset)
        if count < 0 or need > left:
            raise ModelError(f"{self._where}: needs {need} bytes at byte {offset}, "
                             f"the file has {max(left, 0)} left")
        return super()._get(offset, dtype, count, override_order)

    def _check_count(self, count: int, min_bytes: int, offs: int, what: str) -> None:
        left = len(self.data) - offs
        if int(count) > left // min_bytes:
            raise ModelError(f"{what}: {int(count)} does not fit in the {left} bytes left in the "
                             f"file (each takes at least {min_bytes})")

    def _build_fields(self, offs: int, count: int) -> int:
        self._check_count(count, _MIN_KV_BYTES, offs, "GGUF.kv_count")
        for i in range(int(count)):
            self._where = f"metadata entry {i}"
            orig_offs = offs
            klen, kdata = self._get_str(offs)
            offs += int(klen.nbytes + kdata.nbytes)
            try:
                key = bytes(kdata).decode("utf-8")
            except UnicodeDecodeError:
                raise ModelError(f"{self._where}: the key is not UTF-8") from None
            self._where = f"metadata key {key!r}"
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            size, parts, idxs, types = self._get_field_parts(offs, int(raw_type[0]))
            self._push_field(ReaderField(orig_offs, key, [klen, kdata, raw_type, *parts],
                                         [k + 3 for k in idxs], types), skip_sum=True)
            offs += size
        self._where = "the GGUF header"
        return offs

    def _build_tensor_info(self, offs: int, count: int):
        self._check_count(count, _MIN_TENSOR_INFO_BYTES, offs, "GGUF.tensor_count")
        fields = []
        for i in range(int(count)):
            self._where = f"tensor info {i}"
            (n_dims,) = self._get(offs + _STRING_LEN_BYTES + int(self._get(offs, np.uint64)[0]),
                                  np.uint32)
            if n_dims > _MAX_DIMS:
                raise ModelError(f"{self._where}: n_dims: expected at most {_MAX_DIMS}, got {n_dims}")
            try:
                field = self._get_tensor_info_field(offs)
            except UnicodeDecodeError:  # (gguf-py decodes the name)
                raise ModelError(f"{self._where}: its name is not UTF-8") from None
            offs += sum(int(part.nbytes) for part in field.parts)
            fields.append(field)
        self._where = "the GGUF header"
        return offs, fields

    def _build_tensors(self, start_offs: int, fields) -> None:
        """Check that each tensor's data lies inside the file (naming the tensor) first."""
        size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8")  # (_build_tensor_info checked it)
            if 0 in dims.tolist():
                raise ModelError(f"{name}: dims {dims.tolist()}: expected no zero dimension")
            try:
                block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            except (ValueError, KeyError):
                raise ModelError(f"{name}: unsupported block type id {int(raw_type[0])}") from None
            n_values = 1
            for d in dims.tolist():
                n_values *= int(d)
            if int(offset[0]) % int(self.alignment):  # (GGUF places every tensor on the alignment)
                raise ModelError(f"{name}: its data offset {int(offset[0])} is not a multiple of the "
                                 f"file's alignment {int(self.alignment)}")
            start = int(start_offs) + int(offset[0])
            end = start + n_values * type_bytes // block
            if end > size:
                raise ModelError(f"{name}: its data (bytes {start}..{end}) runs past the end of "
                                 f"the file ({size} bytes): the file is truncated")
        self._where = "the tensor data"
        super()._build_tensors(start_offs, fields)

    def _get_field_parts(self, orig_offs, raw_type):
        try:
            gtype = GGUFValueType(raw_type)
        except ValueError:
            raise ModelError(f"{self._where}: unknown value type id {raw_type}") from None
        if gtype != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        start, count = orig_offs + _MIN_ARRAY_BYTES, int(alen[0])
        try:
            item = GGUFValueType(int(itype[0]))
        except ValueError:
            raise ModelError(f"{self._where}: unknown array item type id {int(itype[0])}") from None
        nptype = self.gguf_scalar_to_np.get(item)
        if nptype is not None:  # numbers: one bounded view
            self._check_count(count, np.dtype(nptype).itemsize, start,
                              f"{self._where}: array count (of {item.name})")
            values = self._get(start, nptype, count)
            return _MIN_ARRAY_BYTES + int(values.nbytes), [itype, alen, values], [2], [gtype, item]
        min_bytes = _STRING_LEN_BYTES if item == GGUFValueType.STRING else _MIN_ARRAY_BYTES
        self._check_count(count, min_bytes, start, f"{self._where}: array count")
        if item == GGUFValueType.STRING:
            end = _skip_strings(self.data, start, count, self._where)
            span = self.data[start:end]
            return end - orig_offs, [itype, alen, span], [2], [gtype, item]
        return super()._get_field_parts(orig_offs, raw_type)  # arrays of arrays, each bounded


def _skip_strings(data: np.ndarray, offs: int, count: int, where: str) -> int:
    buf = memoryview(data)
    size = len(buf)
    for i in range(count):
        if offs + 8 > size:
            raise ModelError(f"{where}: string {i} of {count} runs past the end of the file at byte "
                             f"{offs} (the file has {size}): the file is truncated")
        (n,) = struct.unpack_from("<Q", buf, offs)
        offs += 8 + n
    if offs > size:
        raise ModelError(f"{where}: its strings run past the end of the file ({offs} > {size} bytes): "
                         "the file is truncated")
    return offs


def _strings(field, key: str) -> list[str]:
    span = memoryview(field.parts[-1])  # parts: key…, item type, count, span
    count = int(field.parts[-2][0])
    out, offs = [], 0
    for i in range(count):
        (n,) = struct.unpack_from("<Q", span, offs)
        raw = bytes(span[offs + 8: offs + 8 + n])
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ModelError(f"{key}[{i}]: expected UTF-8 text, got {raw[:32]!r} (byte {e.start} "
                             f"is not UTF-8)") from None
        offs += 8 + n
    return out
