"""Plumbing of the Triton backend: device weights (QWeight), the lazy values ops return,
the decode-step records, the op decorator and small helpers."""

from __future__ import annotations

import numpy as np
import torch

from ...core.config import ARCH, ConfigError, ModelConfig
from ...core.quants import GGMLType, IQ2XXS_GRID, IQ2XXS_KSIGNS, row_bytes
from .formats import Decoder
from .layout import device_layout, iq2_views, q2_views


MM_MIN = 16  # tokens from which linear layers use the matrix-matrix kernels (tl.dot needs 16)


# Small dense tensors the kernels index as float32 values (the compressor's position bias is
# added per (window slot, lane), not multiplied as a matrix): stored as F16, BF16 or Q8_0 they are
# turned into float32 at upload, exactly as the reference decodes them.
_VALUE_ROLES = ("compressor_ape.weight",)


# Rows of every matrix are decoded in units of this many values (a Q8_0 block; the K-quants'
# sub-blocks divide it), so a row length must be a multiple of it.
ROW_UNIT = 32


def check_config(cfg: ModelConfig) -> None:
    """Refuse, naming the dimension, what the kernels cannot run: they rotate and store the
    head's values in (even, odd) pairs, so head dims must be even."""
    for key, v in (("attention.key_length", cfg.head_dim),
                   ("attention.indexer.key_length", cfg.indexer_head_dim)):
        if v % 2:
            raise ConfigError(f"{ARCH}.{key}: the triton backend needs an even head dimension, got {v}")


# tl.dot's smallest inner dimension
DOT_MIN = 16


def _pad_dim(d: int) -> int:
    """A dot's padded inner size for a dimension that tl.arange or tl.dot cannot span: 0 when d
    is a power of two of at least DOT_MIN (no pad: the kernel's masks fold away), else the next
    power of two, at least DOT_MIN."""
    return 0 if d & (d - 1) == 0 and d >= DOT_MIN else max(DOT_MIN, _pow2(d))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _x16(x: torch.Tensor, *strides: int) -> bool:
    """Whether every row of float32 x a decode kernel reads starts on 16 bytes (kernels._ld4)."""
    return x.data_ptr() % 16 == 0 and all(int(s) % 4 == 0 for s in strides)


def _largest_pow2_divisor(k: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and k % (b * 2) == 0:
        b *= 2
    return b


class QWeight:
    """A tensor as it lives on the device: its bytes in the kernels' layout (layout.py: GGUF's,
    Q8C chunks for Q8_0 (kt says which, as the kernels' type id), IQ2S for IQ2_XXS, Q2S for
    Q2_K), plus the typed views the kernels take as wb, wh and wf: b8, i16, f32 (for IQ2_XXS,
    f32 is its quant words and i16 its scales; for Q2_K, f32 its quant words, b8 its scale bytes
    and i16 its (d, dmin) pairs). QWeight.place builds one from GGUF bytes."""

    def __init__(self, name: str, ttype: GGMLType, dims: tuple[int, ...], u8: torch.Tensor, kt: int | None = None):
        self.name, self.type, self.dims = name, GGMLType(int(ttype)), tuple(dims)
        self.kt = int(self.type) if kt is None else int(kt)
        self.K = dims[0]
        self.N = dims[1] if len(dims) > 1 else 1
        self.n_exp = dims[2] if len(dims) > 2 else 1
        self.RB = row_bytes(self.type, dims[0])
        self.u8 = u8
        self.b8 = u8
        self.i16 = u8.view(torch.int16) if u8.numel() % 2 == 0 else u8
        # the 32-bit view: float32 for F32, int32 words otherwise (Q2_K's quants are word-aligned)
        self.f32 = (u8.view(torch.float32) if self.type == GGMLType.F32 else
                    u8.view(torch.int32) if u8.numel() % 4 == 0 else self.i16)
        if self.kt == int(GGMLType.IQ2_XXS):  # IQ2S (layout.py): the quant words and the scales apart
            self.f32, self.i16 = iq2_views(u8)
        elif self.kt == int(GGMLType.Q2_K):  # Q2S: quant words, scale bytes and (d, dmin) apart
            self.f32, self.b8, self.i16 = q2_views(u8)
        self.i32 = u8.view(torch.int32) if self.type == GGMLType.I32 else None
        self.f16_row_scale = None  # (Q8C: the per-row powers of two of the "f16" prefill path, on first use)

    @classmethod
    def place(cls, name: str, ttype: GGMLType, dims: tuple[int, ...], u8: torch.Tensor) -> "QWeight":
        """From a tensor's GGUF bytes (on the device), rearranged where layout.py says so."""
        u8, kt = device_layout(ttype, dims[0], u8)
        return cls(name, ttype, dims, u8, kt)

    @property
    def vec(self) -> torch.Tensor:
        if self.type != GGMLType.F32:
            raise TypeError(f"{self.name}: expected an F32 vector, got {self.type.name}")
        return self.f32

    @property
    def nbytes(self) -> int:
        return self.u8.numel()

    def __repr__(self):
        return f"QWeight({self.name}, {self.type.name}, {list(self.dims)})"


# ---- lazy results -------------------------------------------------------------------------------

class _Lazy:
    __slots__ = ("val",)


class _Normed(_Lazy):
    __slots__ = ("x", "w", "xq", "xq8", "x16")

    def __init__(self, x, w):
        self.x, self.w, self.val, self.xq, self.xq8 = x, w, None, None, None
        self.x16 = {}  # its prefill fp16 splits (Linear._split_of), by (Q8C byte order, low term)

    @property
    def shape(self):
        return tuple(self.x.shape)


class _HeadNormed(_Lazy):
    __slots__ = ("x", "H", "D")

    def __init__(self, x, H, D):
        self.x, self.H, self.D, self.val = x, H, D, None

    @property
    def shape(self):
        return (self.x.shape[0], self.H, self.D)


class _Sum(_Lazy):
    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b, self.val = a, b, None

    @property
    def shape(self):
        return tuple(self.a.shape)


class _AttnParts(_Lazy):
    __slots__ = ("mo", "lo", "ao", "S", "sink", "il", "n", "H", "D")

    def __init__(self, mo, lo, ao, S, sink, il, n, H, D):
        self.mo, self.lo, self.ao, self.S, self.sink, self.il = mo, lo, ao, S, sink, il
        self.n, self.H, self.D, self.val = n, H, D, None

    @property
    def shape(self):
        return (self.n, self.H, self.D)


class _Combined(_Lazy):
    """The attention's merged splits with the inverse tail RoPE (attn_combine_kernel), launched
    when read: the output projection may ask for them in XQ8 form beside the float result."""
    __slots__ = ("parts", "xq8")

    def __init__(self, parts):
        self.parts, self.val, self.xq8 = parts, None, None

    @property
    def shape(self):
        return self.parts.shape


class _AttnOut(_Lazy):
    """A prefill chunk's attention output, launched by the op that reads it (the next one, in the
    graph): the inverse tail RoPE (rope(inverse=True)) has attn_kernel rotate it as it stores it;
    any other reader gets it as it is. launch(rope_inverse) runs the kernel and returns its output;
    `take` launches it once: a second read would run it on state (positions, caches) that later
    ops may have moved on, so it is refused."""
    __slots__ = ("launch", "shape")

    def __init__(self, launch, shape):
        self.launch, self.shape, self.val = launch, shape, None

    def take(self, rope_inverse: bool):
        if self.launch is None:
            raise RuntimeError("attention output: already read with its inverse RoPE; read it once")
        launch, self.launch = self.launch, None
        return launch(rope_inverse)


class _Roped(_Lazy):
    """A normed row's tail RoPE (rope_kernel), launched when read, or by kv_store, which rotates
    and stores the KV row into the raw window in one launch."""
    __slots__ = ("x", "il", "p0")

    def __init__(self, x, il, p0):
        self.x, self.il, self.p0, self.val = x, il, p0, None

    @property
    def shape(self):
        return self.x.shape


class _Quantized(_Lazy):
    """A result with its XQ8 form beside it (a product that stored both: matvec_xq_kernel's XQOUT)."""
    __slots__ = ("xq8",)

    def __init__(self, val, xq8):
        self.val, self.xq8 = val, xq8

    @property
    def shape(self):
        return tuple(self.val.shape)


class _Expanded(_Lazy):
    """hc_post's new mHC state: the next collapse's mixing kernel computes it on the way in
    (decode), anything else materialises it with hc_post_kernel."""
    __slots__ = ("y", "y2", "X", "post", "comb")

    def __init__(self, y, y2, X, post, comb):
        self.y, self.y2, self.X, self.post, self.comb, self.val = y, y2, X, post, comb, None

    @property
    def shape(self):
        return tuple(self.X.shape)


class _Rows(_Lazy):
    """A prefill group's mHC state (concat_rows), made already, with its chunks' row counts, so
    that the FFN's collapse can take it one chunk at a time (_hc_pre_by_chunk)."""
    __slots__ = ("parts",)

    def __init__(self, val, parts):
        self.val, self.parts = val, parts

    @property
    def shape(self):
        return tuple(self.val.shape)


class Selection:
    """Indexer top-k of each query: the kept compressed rows in increasing order, and how many."""

    def __init__(self, idx: torch.Tensor, count: torch.Tensor, top_k: int):
        self.idx, self.count, self.top_k = idx, count, top_k

    def mask(self, rows: int) -> np.ndarray:
        idx, cnt = self.idx.cpu().numpy(), self.count.cpu().numpy()
        out = np.zeros((idx.shape[0], rows), dtype=bool)
        for i in range(idx.shape[0]):
            out[i, idx[i, : cnt[i]]] = True
        return out


# ---- decode-step capture ------------------------------------------------------------------------

class _GraphEntry:
    def __init__(self, states):
        self.states = states
        self.arena: list[torch.Tensor] = []
        self.graph = None
        self.outputs: list = []
        self.names: list[str] = []
        self.failed = False


class _Step:
    def __init__(self, entry: _GraphEntry, phase: str):
        self.entry, self.phase = entry, phase  # phase: warm | capture | replay
        self.i = 0  # op index (replay) / arena index (capture)


def _op(fn):
    """Route an op through the decode-step machinery (record, capture or replay)."""
    name = fn.__name__

    def wrapper(self, *args, **kw):
        if name == "embed":
            self._maybe_begin_step(args[1])
            self._chunk = None
        st = self._step
        if st is None:
            return fn(self, *args, **kw)
        if st.phase == "replay":
            e = st.entry
            if st.i >= len(e.names) or e.names[st.i] is not name:
                self._step = None
                raise RuntimeError(f"decode step: op {name} does not match the captured graph")
            out = e.outputs[st.i]
            st.i += 1
            if name == "output_logits":
                self._step = None
            return out
        try:
            out = fn(self, *args, **kw)
        except BaseException:
            self._abort_step()
            raise
        if st.phase == "capture":
            st.entry.outputs.append(out)
            st.entry.names.append(name)
        if name == "output_logits":
            self._end_step()
        return out

    wrapper.__name__ = name
    wrapper.__doc__ = fn.__doc__
    return wrapper


# decoder groups of _mv_cfg: the decoders without a fused RMSNorm; those that load x 16 bytes at a
# time (kernels._ld4); the IQ2_XXS group decoders (four row sets); the unrolled ones (values per unit)
_UNNORMED = (Decoder.Q2_K_UNROLLED, Decoder.Q2_K_XQ, Decoder.Q2S_HALVES_XQ, Decoder.IQ2_UNROLLED,
             Decoder.IQ2_GROUPS, Decoder.IQ2_GROUPS_SMEM, Decoder.IQ2_GROUPS_XQ)
_X16_ONLY = (Decoder.Q2_K_UNROLLED, Decoder.IQ2_GROUPS, Decoder.IQ2_GROUPS_SMEM)
_IQ2_GROUPS = (Decoder.IQ2_GROUPS, Decoder.IQ2_GROUPS_SMEM, Decoder.IQ2_GROUPS_XQ)
_UNROLLED_VB = {Decoder.IQ2_UNROLLED: 32, Decoder.Q2_K_UNROLLED: 64, Decoder.Q2_K_XQ: 64}


def _max_shared(dev: torch.device) -> int:
    """Shared memory a program may use on dev, in bytes, as Triton checks it at launch."""
    from triton.compiler.compiler import max_shared_mem

    return int(max_shared_mem(dev.index if dev.index is not None else torch.cuda.current_device()))


GRID_NIBBLES = 768  # where _grid_table's nibble codes start


def _grid_table() -> np.ndarray:
    """The IQ2_XXS grid for the kernels: [0, 256) the entries as two-bit level codes (the block
    decoder), then [256, 768) each entry's 8 levels as int8 bytes in two little-endian words,
    then [768, 1024) its 8 codes as nibbles, value j's in bits 4j..4j+1 (the 416 decoder)."""
    levels = IQ2XXS_GRID.astype(np.uint8).reshape(256, 2, 4)  # levels 8, 25, 43 fit a byte
    words = (levels.astype(np.int64) << (8 * np.arange(4))).sum(axis=2).astype(np.uint32)
    codes = (_grid_codes().astype(np.int64)[:, None] >> (2 * np.arange(8))) & 3
    nibbles = (codes << (4 * np.arange(8))).sum(axis=1).astype(np.uint32)
    head = np.concatenate([_grid_codes(), words.reshape(-1).view(np.int32)])
    assert head.size == GRID_NIBBLES
    return np.concatenate([head, nibbles.view(np.int32)])


def _ksign_table() -> np.ndarray:
    """IQ2_XXS signs: [0, 128) the 8-bit sign masks, then [128, 384) each mask as 8 bytes that
    are 0xFF where the value is negative, in two little-endian words."""
    bits = (IQ2XXS_KSIGNS.astype(np.int64)[:, None] >> np.arange(8)) & 1  # [128, 8]
    words = ((bits * 0xFF).reshape(128, 2, 4) << (8 * np.arange(4))).sum(axis=2).astype(np.uint32)
    return np.concatenate([IQ2XXS_KSIGNS.astype(np.int32), words.reshape(-1).view(np.int32)])


def _grid_codes() -> np.ndarray:
    """IQ2_XXS grid entries as 8 two-bit level codes (levels 8, 25, 43 -> 0, 1, 2), low bits first."""
    levels = np.array([8.0, 25.0, 43.0], dtype=np.float32)
    codes = np.argmin(np.abs(IQ2XXS_GRID[..., None] - levels), axis=-1).astype(np.int64)  # [256, 8]
    assert np.array_equal(levels[codes], IQ2XXS_GRID)
    return (codes << (2 * np.arange(8))).sum(axis=1).astype(np.int32)
