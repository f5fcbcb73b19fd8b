"""The Triton backend: every op of ds4/backends/base.py as Triton kernels (kernels/); torch
only allocates, holds CUDA graphs and does the little glue of the prefill MoE grouping.

Weights stay quantized on the device: GGUF blocks, with Q8_0 rows rearranged into 256-value chunks
(layout.py); the kernels decode them in registers. Activations and
the session state are float32 torch tensors laid out as ds4/core/state.py says, so
state_to_numpy / state_from_numpy are exact copies and a session moves between backends.

Four things are backend-internal and invisible to the graph:

* Lazy ops. `rms_norm`, `head_norm`, `add`, `hc_post` and a decode `attention` return small
  records instead of launching a kernel; the consumer fuses them (a matrix-vector product
  normalises its input itself, RoPE normalises the rows it rotates, mHC-expand adds the two FFN
  outputs, the next mHC collapse of a decode step computes the expand in its mixing kernel, the
  inverse RoPE merges the attention splits). Anything else materialises them once.
* Positions live on the device. Kernels read the chunk's first position from a device scalar and
  decide windows, visibility and ring rows themselves; no op returns data to the host.
* CUDA graphs. A one-token chunk that `forward_chunk` runs with logits is a decode step: the first
  one of a session runs eagerly (and sizes a private buffer arena), the second is captured into a
  CUDA graph, later ones only replay it; the graph's ops then return the captured outputs without
  launching anything. The session is recognised by its state dict, which `begin_chunk` names.
  A step ends with its next token chosen on the device (the argmax, or a draw on ds4's default
  sampling path) and fed to its next replay, so that `Session.sample` queues replays back to
  back (chain_launch / chain_token).
* Side streams. Inside a decode step the work graph.py marks with `branch()` runs on side
  streams, each launch waiting only for the launches whose buffers it touches (lanes.py); the
  captured graph keeps them concurrent.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch

from ...core.config import ARCH, ConfigError, ModelConfig  # noqa: E402
from ...core.gguf_model import ModelError, Tensor  # noqa: E402
from ...core.quants import IQ2XXS_GRID, IQ2XXS_KSIGNS, GGMLType, dequantize, row_bytes  # noqa: E402
from ...core.rope import layer_inv_freq  # noqa: E402
from ...core.sampling import unsorted_path  # noqa: E402
from ..base import Backend  # noqa: E402
from . import kernels as K  # noqa: E402
from . import kernels_mm16 as K16  # noqa: E402
from .lanes import Lanes  # noqa: E402
from .formats import FLOAT_DECODER, Decoder, KernelType  # noqa: E402
from .layout import device_layout, iq2_views, q2_views  # noqa: E402
from .tuning import load_mv_shapes, load_tuning, parse_mv_shapes  # noqa: E402,F401

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
    __slots__ = ("x", "w", "xq", "xq8")

    def __init__(self, x, w):
        self.x, self.w, self.val, self.xq, self.xq8 = x, w, None, None, None

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

class TritonBackend(Backend):
    name = "triton"
    # the specialised matrix-vector decoders of each layout (mv_types picks one)
    # (the *_XQ decoders read x in XQ form, so only the routed experts take them: _mv_cfg's xq)
    MV_PATHS = {KernelType.Q8C: (Decoder.Q8C_FLOAT, Decoder.Q8C_XQ8),
                KernelType.IQ2_XXS: (Decoder.IQ2_UNROLLED, Decoder.IQ2_GROUPS, Decoder.IQ2_GROUPS_SMEM,
                                     Decoder.IQ2_GROUPS_XQ),
                KernelType.Q2_K: (Decoder.Q2_K_UNROLLED, Decoder.Q2_K_XQ, Decoder.Q2S_HALVES_XQ)}
    XQ_PATHS = FLOAT_DECODER  # integer decoder -> the float one where x is not in XQ form

    @staticmethod
    def runs_here() -> bool:
        return torch.cuda.is_available()

    def __init__(self, cfg: ModelConfig, numerics: str = "ds4", device: str | None = None,
                 cuda_graphs: bool | None = None, synthetic: bool = False, seed: int = 0,
                 dot_precision: str | None = None, max_graphs: int = 4):
        super().__init__(cfg, numerics)
        check_config(cfg)
        if device is None:  # the CPU interpreter is for tests, and only when asked for by name
            if not self.runs_here() or K.INTERPRET:
                raise RuntimeError("the triton backend needs an NVIDIA GPU (CUDA); its kernels also "
                                   "run on the CPU under TRITON_INTERPRET=1 with device='cpu', for tests")
            device = "cuda"
        self.dev = torch.device(device)
        self.interpret = K.INTERPRET
        if self.dev.type == "cuda" and self.interpret:
            raise RuntimeError("TRITON_INTERPRET=1 runs kernels on CPU tensors; use device='cpu'")
        if self.dev.type == "cpu" and not self.interpret:
            raise RuntimeError("device='cpu' needs TRITON_INTERPRET=1 set before Triton is imported")
        self.cuda_graphs = (self.dev.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
        self.synthetic = synthetic
        self.seed = seed
        self.tuning = load_tuning(self.interpret, _max_shared(self.dev) if self.dev.type == "cuda" else None,
                                  dot_precision)
        for f in dataclasses.fields(self.tuning):  # per-instance copies that tests and benchmarks set
            v = getattr(self.tuning, f.name)
            setattr(self, f.name, dict(v) if isinstance(v, Mapping) else v)
        self.prec_f = ("ieee" if self.interpret else "tf32x3") if self.prec == "bf16x3" else self.prec
        d = self.dev
        self._gridp = torch.tensor(_grid_table(), dtype=torch.int32, device=d)
        self._ksigns = torch.tensor(_ksign_table(), dtype=torch.int32, device=d)
        self._freq = torch.tensor(np.stack([layer_inv_freq(cfg, il) for il in range(cfg.n_layer)]),
                                  dtype=torch.float32, device=d)
        self._pos = torch.zeros(1, dtype=torch.int32, device=d)
        self._pos_host = 0
        self._chunk = None  # (states, p0, logits) of the chunk forward_chunk is running
        self._tok1 = torch.zeros(1, dtype=torch.int32, device=d)
        # a decode step's token for the host, written by the GPU into pinned host memory at slot
        # p0 % 4 and read once the event recorded after the step's replay has passed; and the
        # draw (T, min_p, U) the host copies to the device's slot before it queues a step (the
        # step sets T back to 0; read straight from host memory, an idle sampler was slower)
        n = self._CHAIN_SLOTS
        pin = d.type == "cuda"
        self._chain_tokens = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        self._chain_draws = torch.zeros(3 * n, dtype=torch.float64, device=d)
        self._chain_draws_host = torch.zeros(3 * n, dtype=torch.float64, pin_memory=pin)
        self._chain_draws_np = self._chain_draws_host.numpy().reshape(n, 3)
        self._chain_done = [torch.cuda.Event() for _ in range(n)] if pin else []
        self._chain_best = None  # (and _at, _mass, _cnt, _top) the step's last kernels' scratch
        self._tok_np = None
        self._tok_t = None
        self._dummy_f = torch.zeros(16, dtype=torch.float32, device=d)
        self._dummy_i = torch.zeros(16, dtype=torch.int32, device=d)
        # one query's indexer key counts (by top 8 bits, by top 14 bits, then the top-k programs'
        # ticket): the scores kernel adds, top-k reads and clears them, so they are zero between;
        # the buckets (allocated on first use) need no clearing
        self._topk_counts = torch.zeros(256 + 16384 + 16, dtype=torch.int32, device=d)
        self._topk_buckets = None
        # split-K tickets of the matrix-vector kernels, one per output tile (_split_store); each
        # launch leaves them at zero
        self._split_cnt = torch.zeros(1 << 16, dtype=torch.int32, device=d)
        self._lanes: Lanes | None = None
        self._step: _Step | None = None
        self._graphs: OrderedDict[int, _GraphEntry] = OrderedDict()
        self.max_graphs = max_graphs
        self._cap_ctx = None
        self._cap_stream = None
        self.ledger: list | None = None  # (kernel name, bytes) per launch when profiling
        self._synth = None

    @property
    def device(self) -> str:
        if self.dev.type == "cuda":  # name the GPU: benchmark rows say where they were measured
            return f"cuda: {torch.cuda.get_device_name(self.dev)}"
        return str(self.dev)

    # ---- memory ---------------------------------------------------------------------------------

    def upload(self, tensor: Tensor) -> QWeight:
        if (len(tensor.dims) > 1 and tensor.type != GGMLType.I32 and not tensor.name.endswith(_VALUE_ROLES)
                and tensor.dims[0] % ROW_UNIT):
            raise ModelError(f"{tensor.name}: the triton backend decodes rows in {ROW_UNIT}-value units; "
                             f"expected a row length (dims[0]) that is a multiple of {ROW_UNIT}, got "
                             f"{tensor.dims[0]} ({tensor.type.name})")
        if self.synthetic:
            from .synthetic import synthetic_bytes

            if self._synth is None:
                self._synth = torch.Generator(device=self.dev).manual_seed(self.seed)
            u8 = synthetic_bytes(tensor.name, tensor.type, tensor.dims, self.cfg, self.dev, self._synth)
        else:
            host = torch.from_numpy(np.array(tensor.raw, dtype=np.uint8, copy=True).reshape(-1))
            u8 = host.to(self.dev) if self.dev.type != "cpu" else host
        if tensor.name.endswith(_VALUE_ROLES) and tensor.type != GGMLType.F32:
            # the kernels read these as plain float32 values, whatever type the file stores
            values = dequantize(u8.cpu().numpy(), tensor.type).astype(np.float32)
            u8 = torch.from_numpy(values.view(np.uint8)).to(self.dev)
            return QWeight.place(tensor.name, GGMLType.F32, tensor.dims, u8)
        return QWeight.place(tensor.name, tensor.type, tensor.dims, u8)

    def alloc_state(self, shapes, fill):
        return {k: torch.full(s, float(fill[k]), dtype=torch.float32, device=self.dev)
                for k, s in shapes.items()}

    def state_to_numpy(self, st, name):
        return st[name].detach().cpu().numpy().copy()

    def state_from_numpy(self, st, name, value):
        value = np.asarray(value)
        if tuple(value.shape) != tuple(st[name].shape):
            raise ValueError(f"state {name}: expected shape {tuple(st[name].shape)}, got {value.shape}")
        st[name].copy_(torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)))

    def from_numpy(self, x):
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(self.dev)

    def to_numpy(self, x):
        if isinstance(x, Selection):
            return x.mask(int(x.idx.max().item()) + 1 if x.idx.numel() else 0)
        if isinstance(x, (tuple, list)):
            return type(x)(self.to_numpy(v) for v in x)
        return self._val(x).detach().cpu().numpy()

    # ---- plumbing -------------------------------------------------------------------------------

    def _new(self, shape, dtype=torch.float32) -> torch.Tensor:
        shape = tuple(int(s) for s in shape)
        st = self._step
        if st is None:
            return torch.empty(shape, dtype=dtype, device=self.dev)
        e = st.entry
        if st.phase == "warm":
            t = torch.empty(shape, dtype=dtype, device=self.dev)
            e.arena.append(t)
        else:
            t = e.arena[st.i]
            st.i += 1
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise RuntimeError(f"decode step: buffer {st.i - 1} is {tuple(t.shape)}, expected {shape}")
        if self._lanes is not None and self._lanes.active:
            self._lanes.arena(t)
        return t

    def _launch(self, kern, grid, *args, nbytes: int = 0, **kw):
        if self.interpret:
            kw.pop("num_warps", None)
            kw.pop("num_stages", None)
        ln = self._lanes
        if ln is not None and ln.active:
            with torch.cuda.stream(ln.before(args)):
                kern[grid](*args, **kw)
            ln.after()
        else:
            kern[grid](*args, **kw)
        if self.ledger is not None:
            self.ledger.append((kern.fn.__name__ if hasattr(kern, "fn") else str(kern), int(nbytes)))

    def _pdl(self, dep: str | None = None) -> bool:
        """Whether a decode step's products on XQ8 x launch early (pdl_xq); dep: whether the
        kernel or product of that name takes part (pdl_dep)."""
        return (self.pdl_xq and self._step is not None and not self.interpret
                and (dep is None or dep in self.pdl_dep))

    def _set_pos(self, p0: int) -> torch.Tensor:
        p0 = int(p0)
        if p0 != self._pos_host:
            if self._step is not None and self._step.phase == "capture":
                raise RuntimeError("decode step: position changed inside a captured step")
            self._pos.fill_(p0)
            self._pos_host = p0
        return self._pos

    def _tokens_dev(self, tokens) -> torch.Tensor:
        if self._step is not None:
            return self._tok1
        if tokens is self._tok_np and self._tok_t is not None:
            return self._tok_t
        t = torch.from_numpy(np.ascontiguousarray(np.asarray(tokens, dtype=np.int32)))
        self._tok_t = t.to(self.dev) if self.dev.type != "cpu" else t
        self._tok_np = tokens
        return self._tok_t

    def _val(self, x):
        """Materialise a lazy result (once)."""
        if not isinstance(x, _Lazy):
            return x
        if x.val is not None:
            return x.val
        if isinstance(x, _Normed):
            out = self._rms(x)
        elif isinstance(x, _HeadNormed):
            src = self._val(x.x)
            n = src.shape[0]
            out = self._new((n, x.H, x.D))
            self._launch(K.rms_kernel, (n * x.H,), src, self._dummy_f, out, x.D, self.cfg.rms_eps,
                         self._dummy_i, self._dummy_f, self._dummy_f,
                         BD=_pow2(x.D), WEIGHTED=False, num_warps=4, nbytes=8 * src.numel())
        elif isinstance(x, _Sum):
            a, b = self._val(x.a), self._val(x.b)
            out = self._new(a.shape)
            N = a.numel()
            self._launch(K.add_kernel, (_cdiv(N, 1024),), a, b, out, N, BLOCK=1024, nbytes=12 * N)
        elif isinstance(x, _AttnParts):
            out = self._combine(x, rope_inverse=False)
        elif isinstance(x, _Combined):
            out = self._combine(x.parts, rope_inverse=True)
        elif isinstance(x, _Expanded):
            X = x.X
            n, HC, E = X.shape
            out = self._new((n, HC, E))
            BE = min(1024, _pow2(E))
            y2 = x.y2 if x.y2 is not None else x.y
            self._launch(K.hc_post_kernel, (n, _cdiv(E, BE)), x.y, y2, X, x.post, x.comb,
                         out, E, HC=HC, BE=BE, HAS_Y2=x.y2 is not None, num_warps=4,
                         nbytes=4 * (2 * X.numel() + 2 * n * E))
        else:
            raise TypeError(type(x))
        x.val = out
        return out

    def _blocks(self, ttype: int, K_: int, cap: int) -> tuple[int, int]:
        """(NB, VB): units per K-step and values per unit, NB·VB dividing K."""
        VB = K.UNIT[int(ttype)]
        if ttype in (KernelType.F32, KernelType.F16, KernelType.BF16):
            VB = _largest_pow2_divisor(K_, VB)
        if K_ % VB:
            raise ValueError(f"K={K_} is not a multiple of the {VB}-value unit of type {ttype}")
        NB = _largest_pow2_divisor(K_ // VB, max(1, cap // VB))
        return NB, VB

    def _mm_cfg(self, kt: int, K_: int) -> dict:
        """K-step of a matrix-matrix kernel: integer units (U values, NB per step) or float tiles."""
        ttype = int(kt)
        if self.prec == "bf16x3" and ttype in (KernelType.Q8_0, KernelType.Q8C):
            NB = _largest_pow2_divisor(K_ // 32, self.units_per_step)
            return dict(NB=NB, VB=32, U=32, PREC=self.prec_f)
        NB, VB = self._blocks(ttype, K_, 64 if not self.interpret else 128)
        return dict(NB=NB, VB=VB, U=0, PREC=self.prec_f)

    def _mv_path(self, kind: str, kt: int, N: int, K_: int) -> tuple[int, tuple]:
        """(decoder, its tuning) of a decode product of `kind` (linear, gateup, down) with N rows of
        K_ values in layout kt (QWeight.kt): the per-shape table (mv_shapes), else the per-layout
        defaults."""
        e = self.mv_shapes.get((kind, int(kt), int(N), int(K_)))
        if e is not None:
            return int(e[0]), tuple(e[1:])
        t = self.mv_types.get(int(kt), int(kt))
        return t, self.mv_tune.get(t, self.mv_tune["default"])

    def _mv_cfg(self, kt: int, N: int, K_: int, slots: int = 1, norm: int = 0, kind: str = "linear",
                x16: bool = True, xq: bool = False) -> dict:
        """Launch parameters of a matrix-vector kernel: decoder (308 = Q8C chunks, 216 / 416 =
        IQ2_XXS groups (one / four rows per thread; 417: 416 with its level lookups from shared
        memory; 418: 417 on x in XQ form, integer products), 110 = Q2_K runs (111: on x in XQ
        form; 113: 128-value halves on x in XQ form, the routed down only), else the generic
        decoder of layout kt), rows per program, units per K-step, values per unit, accumulator
        width (308, 309, 113: rows per thread), warps, K parts (113 also IS, the K-steps of a
        part). xq: whether the caller can give x in XQ form (the routed experts); else 418 / 111 /
        113 become 417 / 110 / 110."""
        ttype = int(kt)
        t, tune = self._mv_path(kind, ttype, N, K_)
        if t != ttype and t not in self.MV_PATHS.get(ttype, ()):
            raise ValueError(f"decoder {t} for {kind} {N}x{K_}: expected one of layout {ttype}'s "
                             f"{self.MV_PATHS.get(ttype, ())} or the generic {ttype}")
        if t in self.XQ_PATHS and not xq:
            t = self.XQ_PATHS[t]
            tune = self.mv_tune.get(t, self.mv_tune["default"])
        # the generic decoder where a specialised one has no fused RMSNorm, or loads x 16 bytes at
        # a time (kernels._ld4) and x rows do not start on 16 bytes
        if (norm and t in _UNNORMED) or (not x16 and t in _X16_ONLY):
            t, tune = ttype, self.mv_tune.get(ttype, self.mv_tune["default"])
        t = int(t)  # (the kernels' TYPE: a plain int, as the per-shape table gives it)
        cap, BN, warps = tune[:3]
        S = tune[3] if len(tune) > 3 else 1  # K split in S parts (_split_store)
        # rows per thread (Q8C_FLOAT / Q8C_XQ8 / Q2S_HALVES_XQ: a fifth tuning value)
        R = {Decoder.Q8C_FLOAT: 4, Decoder.Q8C_XQ8: 4, Decoder.Q2S_HALVES_XQ: 2}.get(t, 1)
        if t in (Decoder.Q8C_FLOAT, Decoder.Q8C_XQ8, Decoder.Q2S_HALVES_XQ) and len(tune) > 4:
            R = tune[4]
        if self.interpret:  # few, large programs (a per-shape entry keeps its K-step: tests split K)
            cap = cap if (kind, ttype, int(N), int(K_)) in self.mv_shapes else 1024
            BN = min(256 if t == Decoder.Q2S_HALVES_XQ else 64, _pow2(N))  # (unrolled slots cost per program)
        elif t != Decoder.Q2S_HALVES_XQ:  # (its programs are [BN / R, halves] threads: the tuning sets BN)
            while BN > (4 if t in _IQ2_GROUPS else R) and _cdiv(N, BN) * slots * S < 264:  # two programs per SM
                BN //= 2
        pf = dict(PF=True) if t == Decoder.IQ2_GROUPS_XQ and self.mv_prefetch else {}
        if t in _IQ2_GROUPS:  # four row sets of BN/4 rows × NB groups; no more threads than set elements
            NB = _largest_pow2_divisor(K_ // 32, max(1, cap // 32))
            BN = max(BN, 4)
            warps = max(1, min(warps, (BN // 4) * NB // 32))
            return dict(TYPE=t, BN=BN, NB=NB, VB=32, VA=1, S=self._split(S, K_, NB * 32), num_warps=warps, **pf)
        if t in (Decoder.Q8C_FLOAT, Decoder.Q8C_XQ8):  # NB 256-value chunks per K-step, R rows per thread
            NB = _largest_pow2_divisor(K_ // 256, max(1, cap // 256))
            BN = max(BN, R)
            return dict(TYPE=t, BN=BN, NB=NB, VB=256, VA=R, S=self._split(S, K_, NB * 256), num_warps=warps)
        if t == Decoder.Q2S_HALVES_XQ:  # NB 128-value halves of Q2_K blocks per K-step, R rows per thread
            NB = _largest_pow2_divisor(K_ // 128, max(1, cap // 128))
            BN = max(BN, R)
            warps = max(1, min(warps, (BN // R) * NB // 32))
            S = self._split(S, K_, NB * 128)
            return dict(TYPE=t, BN=BN, NB=NB, VB=128, VA=R, S=S, IS=K_ // (NB * 128) // S, num_warps=warps)
        if t in _UNROLLED_VB:  # unrolled units: 32 (IQ2_XXS) or 64 (Q2_K) values per tile element
            VB = _UNROLLED_VB[t]
            NB = _largest_pow2_divisor(K_ // VB, max(1, cap // VB))
            return dict(TYPE=t, BN=BN, NB=NB, VB=VB, VA=1, S=self._split(S, K_, NB * VB), num_warps=warps)
        NB, VB = self._blocks(ttype, K_, cap)
        return dict(TYPE=t, BN=BN, NB=NB, VB=VB, VA=VB, S=self._split(S, K_, NB * VB), num_warps=warps)

    def _tiles_ok(self, tiles: int, S: int) -> None:
        if S > 1 and tiles > self._split_cnt.numel():  # one split-K ticket per output tile
            raise ValueError(f"split-K tickets: {tiles} output tiles, {self._split_cnt.numel()} tickets")

    @staticmethod
    def _split(S: int, K_: int, step: int) -> int:
        """The largest power of two <= S that splits K_ into whole K-steps."""
        return _largest_pow2_divisor(max(1, K_ // step), max(1, S))

    # ---- linear layers --------------------------------------------------------------------------

    def _takes_xq8(self, w: QWeight, n: int) -> bool:
        """Whether a decode product of n tokens on w reads x in XQ8 form (decoder 309)."""
        return n < MM_MIN and w.kt == KernelType.Q8C and self._mv_cfg(w.kt, w.N, w.K, n, xq=True)["TYPE"] == Decoder.Q8C_XQ8

    def _linear(self, x, w: QWeight, group_rows: int = 0, group_stride: int = 0, xq_out: bool = False):
        """x [n, K(·groups)] -> [n, N]. Rows of group g read x columns [g·stride, +K). xq_out: the
        result also in XQ8 form where the product can store it (309; then a _Quantized)."""
        N, Kd = w.N, w.K
        gr = group_rows or (1 << 30)
        if x.shape[0] < MM_MIN and w.kt == KernelType.Q8C and group_stride % 32 == 0:
            c = self._mv_cfg(w.kt, N, Kd, x.shape[0], xq=True)  # (the test of _takes_xq8, its config kept)
            if c["TYPE"] == Decoder.Q8C_XQ8:
                return self._linear_xq(x, w, c, gr, group_stride, xq_out)
        norm = 0
        nw = self._dummy_f
        if isinstance(x, _Normed) and x.val is None and x.shape[0] < MM_MIN and not group_rows:
            src = self._val(x.x)
            norm = 2 if x.w is None else 1
            nw = self._dummy_f if x.w is None else x.w.vec
            c = self._mv_cfg(w.kt, N, Kd, src.shape[0], norm, x16=_x16(src, src.stride(0)))
            if _cdiv(N, c["BN"]) * Kd >= self.norm_fuse_max:  # normalise x once instead (rms_kernel)
                src, norm, nw = self._val(x), 0, self._dummy_f
        else:
            src = self._val(x)
        n = src.shape[0]
        sx_t = src.stride(0)
        out = self._new((n, N))
        if n < MM_MIN:
            c = self._mv_cfg(w.kt, N, Kd, n, norm, x16=_x16(src, sx_t, group_stride))
            if group_rows:
                c["BN"] = min(c["BN"], _largest_pow2_divisor(group_rows, c["BN"]))
            S = c["S"]
            tiles = _cdiv(N, c["BN"])
            self._tiles_ok(tiles * n, S)
            ws = self._new((n, S, N)) if S > 1 else self._dummy_f
            self._launch(K.matvec_kernel, (tiles, n, S), src, sx_t, group_stride, nw,
                         w.b8, w.i16, w.f32, self._gridp, self._ksigns, out, N, ws, self._tickets(),
                         N, Kd, w.RB, gr, self.cfg.rms_eps, NORM=norm, **c,
                         nbytes=w.RB * N + 4 * n * (Kd + N))
        elif self._q8_16(w, src, group_stride):
            xh, xl, xi, _, _ = self._split16(src, sums=False)
            BM, BN, warps, stages = self.q8_16_tile["linear"]
            if group_rows:
                BN = min(BN, _largest_pow2_divisor(group_rows, BN))
            self._launch(K16.matmul_q8_16_kernel, (_cdiv(n, BM), _cdiv(N, BN)), xh, xl, xi, src.shape[1],
                         w.i16, out, N, n, N, Kd, w.RB, gr, group_stride, BM=BM, BN=BN,
                         num_warps=warps, num_stages=stages, nbytes=w.RB * N + 4 * n * (Kd + N))
        else:
            mc = self._mm_cfg(w.kt, Kd)
            BM, BN, warps = self.mm_tile_q8 if mc["U"] and not self.interpret else self.mm_tile
            if group_rows:
                BN = min(BN, _largest_pow2_divisor(group_rows, BN))
            self._launch(K.matmul_kernel, (_cdiv(n, BM), _cdiv(N, BN)), src, sx_t, group_stride,
                         w.b8, w.i16, w.f32, self._gridp, self._ksigns, out, N,
                         n, N, Kd, w.RB, gr, TYPE=w.kt, BM=BM, BN=BN, **mc,
                         num_warps=warps, num_stages=2, nbytes=w.RB * N + 4 * n * (Kd + N))
        return out

    def _linear_xq(self, x, w: QWeight, c: dict, gr: int, group_stride: int, xq_out: bool):
        """A decode product on Q8C rows through decoder 309 (c: its _mv_cfg), x in XQ8 form; with
        xq_out and one K part, the result in XQ8 form too (-> _Quantized)."""
        xw, xs, _ = self._xq(x, perm=True)
        n, N = x.shape[0], w.N
        width = 2 * xw.shape[1]
        BN = _largest_pow2_divisor(gr, c["BN"])  # a program's rows within one group (gr: 2^30 without groups)
        S = c["S"]
        tiles = _cdiv(N, BN)
        self._tiles_ok(tiles * n, S)
        xq_out = xq_out and S == 1 and N % 32 == 0
        if xq_out:
            self._tiles_ok(n * N // 32, 2)  # a ticket per 32-row block
        q = self._xq_new(n, N) if xq_out else (self._dummy_i, self._dummy_f, self._dummy_f)
        out = self._new((n, N))
        ws = self._new((n, S, N)) if S > 1 else self._dummy_f
        pdl = dict(PDL=True, DEP=self._pdl("xq"), launch_pdl=True) if self._pdl() else {}
        self._launch(K.matvec_xq_kernel, (tiles, n, S), xw, xs, width, group_stride, w.i16, w.f32, out, N,
                     ws, self._tickets(), N, w.K, w.RB, gr, *q, BN=BN, NB=c["NB"], R=c["VA"], S=S, XQOUT=xq_out,
                     num_warps=c["num_warps"], nbytes=w.RB * N + 2 * n * width + (7 if xq_out else 4) * n * N, **pdl)
        return _Quantized(out, q) if xq_out else out

    # ---- decode-step machinery ------------------------------------------------------------------

    def _tickets(self) -> torch.Tensor:
        """The split-K tickets of the stream the next launch goes to."""
        ln = self._lanes
        return ln.tickets() if ln is not None and ln.active else self._split_cnt

    @contextlib.contextmanager
    def branch(self):
        ln = self._lanes
        if ln is None or not ln.active:
            yield
            return
        prev = ln.lane
        ln.lane = ln.take()
        try:
            yield
        finally:
            ln.lane = prev

    def _begin_lanes(self, states) -> None:
        """Side streams for the step about to run eagerly or be captured (lanes.py)."""
        if self.lanes <= 0:
            return
        if self._lanes is None or self._lanes.n_side != self.lanes:
            self._lanes = Lanes(self.lanes, self.dev, self._split_cnt.numel())
        ln = self._lanes
        ln.begin(torch.cuda.current_stream(self.dev), self._split_cnt)
        for st in states.values():
            for t in st.values():
                if isinstance(t, torch.Tensor):
                    ln.state(t)

    def _hold_main(self) -> None:
        """In a decode step with side streams: the main stream's next launches (the query's
        32768-row product) wait for this branch's last launch (Lanes.hold_main)."""
        if self._lanes is not None and self._lanes.active:
            self._lanes.hold_main()

    def _end_lanes(self) -> None:
        if self._lanes is not None:
            self._lanes.end()

    def begin_chunk(self, states, tokens, p0, logits) -> None:
        self._chunk = (states, int(p0), bool(logits))

    def _maybe_begin_step(self, tokens) -> None:
        if self._step is not None:
            self._abort_step()
        chunk = self._chunk
        if not self.cuda_graphs or len(tokens) != 1 or chunk is None:
            return
        states, p0, logits = chunk
        if not logits:
            return
        key = id(states)
        e = self._graphs.get(key)
        if e is not None and e.states is not states:
            e = None
        if e is not None and e.failed:
            return
        self._tok1.fill_(int(np.asarray(tokens).reshape(-1)[0]))
        self._set_pos(p0)
        if e is None:
            e = _GraphEntry(states)
            self._graphs[key] = e
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
            self._step = _Step(e, "warm")
            self._begin_lanes(states)
            return
        self._graphs.move_to_end(key)
        if e.graph is None:
            self._step = _Step(e, "capture")
            e.outputs, e.names = [], []
            torch.cuda.synchronize(self.dev)
            e.graph = torch.cuda.CUDAGraph()
            self._cap_stream = torch.cuda.Stream(self.dev)
            self._cap_stream.wait_stream(torch.cuda.current_stream(self.dev))
            self._cap_ctx = torch.cuda.stream(self._cap_stream)
            self._cap_ctx.__enter__()
            e.graph.capture_begin()
            self._begin_lanes(states)
            return
        self._step = _Step(e, "replay")
        e.graph.replay()
        self._pos_host = p0 + 1  # (the step's last kernels, _next_token, advanced it)

    def _end_step(self) -> None:
        st = self._step
        self._step = None
        self._end_lanes()
        if st.phase == "capture":
            st.entry.graph.capture_end()
            self._cap_ctx.__exit__(None, None, None)
            torch.cuda.current_stream(self.dev).wait_stream(self._cap_stream)
            self._cap_ctx = None
            st.entry.graph.replay()
        self._pos_host += 1  # (the step's last kernels, _next_token, advanced it)

    def _abort_step(self) -> None:
        st = self._step
        self._step = None
        if st is None:
            return
        self._pos_host = None  # whether the step's last kernel ran is unknown: set it again
        try:
            self._end_lanes()
        except Exception:
            pass
        if st.phase == "capture" and self._cap_ctx is not None:
            try:
                st.entry.graph.capture_end()
            except Exception:
                pass
            self._cap_ctx.__exit__(None, None, None)
            self._cap_ctx = None
            st.entry.graph = None
            st.entry.failed = True
        elif st.phase == "warm":
            self._graphs.pop(id(st.entry.states), None)

    # ---- decode steps chained on the device ----------------------------------------------------

    _CHAIN_SLOTS = 4  # the host's rings of tokens and draws; Session.sample has two steps in flight

    def _next_token(self, logits) -> None:
        """The last kernels of a decode step: the argmax (greedy_next_kernel), then a draw on ds4's
        default sampling path where the host asked for one (sample_next_kernel). They write the
        token where the step's next replay reads it and into the host's ring, and advance the
        device's position. Replays then chain on the device (Session.sample) and the host's work
        between steps (the launch, Python) overlaps the GPU's instead of adding to it."""
        # after every launch of the step: kernels still running on side streams (the last layer's
        # compressors) read the position this kernel advances
        self._end_lanes()
        V = logits.numel()
        G = _pow2(_cdiv(V, self.chain_block))  # 64 programs for DS4's 129280 logits
        if self._chain_best is None or self._chain_best.numel() < G:
            self._chain_best = torch.zeros(G, dtype=torch.float32, device=self.dev)
            self._chain_at = torch.zeros(G, dtype=torch.int32, device=self.dev)
            self._chain_mass = torch.zeros(G, dtype=torch.float64, device=self.dev)
            self._chain_cnt = torch.zeros(1, dtype=torch.int32, device=self.dev)
            self._chain_top = torch.zeros(1, dtype=torch.float32, device=self.dev)
        R = self._CHAIN_SLOTS
        self._launch(K.greedy_next_kernel, (G,), logits, V, self._chain_best, self._chain_at,
                     self._chain_cnt, self._chain_top, self._tok1, self._pos, self._chain_tokens,
                     R=R, BLOCK=self.chain_block, G=G, num_warps=4, nbytes=4 * V)
        self._launch(K.sample_next_kernel, (G,), logits, V, self._chain_mass, self._chain_cnt,
                     self._chain_top, self._tok1, self._pos, self._chain_tokens, self._chain_draws,
                     R=R, BLOCK=self.chain_block, G=G, num_warps=4)

    def chains(self, states, params) -> bool:
        e = self._graphs.get(id(states))
        if e is None or e.states is not states or e.graph is None or e.failed or self._step is not None:
            return False
        return unsorted_path(params) is not None  # (the two paths _next_token's kernels take)

    def chain_launch(self, states, p0, token=None, draw=None):
        p0 = int(p0)
        key = id(states)
        e = self._graphs[key]
        self._graphs.move_to_end(key)
        if token is not None:
            self._tok1.fill_(int(token))
            self._set_pos(p0)
        elif p0 != self._pos_host:
            raise RuntimeError(f"chain_launch: the device's position is {self._pos_host}, expected {p0}")
        slot = p0 % self._CHAIN_SLOTS
        if draw is not None:  # (the host's slot is free again: its step, 4 back, has run)
            self._chain_draws_np[slot] = draw
            self._chain_draws[3 * slot:3 * slot + 3].copy_(self._chain_draws_host[3 * slot:3 * slot + 3],
                                                            non_blocking=True)
        e.graph.replay()
        self._pos_host = p0 + 1  # (the step's last kernels advanced it)
        self._chain_done[slot].record()
        return p0

    def chain_token(self, ticket) -> int:
        slot = ticket % self._CHAIN_SLOTS
        self._chain_done[slot].synchronize()
        t = int(self._chain_tokens[slot])
        if t < 0:
            raise ValueError(f"cannot choose a token: none of the {self.cfg.n_vocab} logits is "
                             "finite (all -inf or NaN)")
        return t

    def chain_logits(self, states) -> np.ndarray:
        return self.to_numpy(self._graphs[id(states)].outputs[-1])

    # ---- ops ------------------------------------------------------------------------------------

    @_op
    def embed(self, token_embd: QWeight, tokens):
        cfg = self.cfg
        n, E, HC = len(tokens), cfg.n_embd, cfg.n_hc
        tok = self._tokens_dev(tokens)
        X = self._new((n, HC, E))
        NB, VB = self._blocks(token_embd.kt, E, 1024)
        self._launch(K.embed_kernel, (n, E // (NB * VB)), tok, token_embd.b8, token_embd.i16, token_embd.f32,
                     self._gridp, self._ksigns, X, E, token_embd.RB, HC=HC, TYPE=token_embd.kt,
                     NB=NB, VB=VB, nbytes=n * (token_embd.RB + 4 * HC * E))
        return X

    def _hc_collapse(self, X, hc, head: bool):
        cfg = self.cfg
        n, HC, E = X.shape
        Kd = HC * E
        fn = hc.fn
        NR = fn.N
        NM = _pow2(NR)
        # BT tokens per program share each weight tile on the tensor cores (hc_mix_kernel)
        BT = 1 if n < self.hc_mix_bt[0] else min(self.hc_mix_bt[1], _pow2(n))
        # one token per program: the mixing kernel also computes a pending mHC expand
        ex = X if isinstance(X, _Expanded) and X.val is None and BT == 1 and self.fuse_expand else None
        if ex is None:
            X = self._val(X)
            d = self._dummy_f
            expand = (d, d, d, d, d)
        else:
            X = ex.val = self._new((n, HC, E))
            expand = (ex.y, ex.y2 if ex.y2 is not None else ex.y, ex.X, ex.post, ex.comb)
        # (32-value K-steps for BT > 1: larger ones spill registers, sm_90 SASS; one token: up to
        # 128, one K-step per program where hc_mix_split parts make them shorter)
        cap = 32 if BT > 1 else max(32, min(128, Kd // self.hc_mix_split))
        NB, VB = self._blocks(fn.kt, Kd, 1024 if self.interpret else cap)
        BK = NB * VB
        split = 1 if self.interpret else max(1, min(self.hc_mix_split, max(128, self.hc_mix_split) // _cdiv(n, BT)))
        split = min(split, Kd // BK)
        split = _largest_pow2_divisor(Kd // BK, split)
        part = self._new((n, split, NM))
        ss = self._new((n, split))
        self._launch(K.hc_mix_kernel, (_cdiv(n, BT), split), X, fn.b8, fn.i16, fn.f32, self._gridp, self._ksigns,
                     part, ss, n, NR, Kd, fn.RB, Kd // split, *expand, E, NM=NM, TYPE=fn.kt, NB=NB, VB=VB,
                     BT=BT, EXPAND=ex is not None, HAS_Y2=ex is not None and ex.y2 is not None, HC=HC,
                     num_warps=4, nbytes=fn.RB * NR * _cdiv(n, BT) + 4 * X.numel() * (3 if ex is not None else 1))
        x_in = self._new((n, E))
        post = self._dummy_f if head else self._new((n, HC))
        comb = self._dummy_f if head else self._new((n, HC, HC))
        BT = min(_pow2(n), 32) if self.interpret else 1
        BE = min(1024 // BT if self.interpret else self.hc_fin_be, _pow2(E))
        consts = (n, E, cfg.rms_eps, cfg.hc_eps, cfg.hc_sinkhorn_iter)
        kw = dict(SPLIT=split, HC=HC, NM=NM, BE=BE, BT=BT, HEAD=head, num_warps=4)
        d = self._dummy_f
        if not head and self.hc_comb_beside and n == 1:
            # x_in first, post and comb (the Sinkhorn) beside the sublayer, which needs only x_in
            # (on a side stream in a decode step; in order elsewhere, so that every one-token
            # collapse runs the same two kernels: one launch doing both parts gave other bits, as
            # the compiler laid out its reductions differently). Each launch takes only the
            # buffers it writes: the side streams order readers after the launch that took a
            # buffer first (lanes.py)
            self._launch(K.hc_finalize_kernel, (_cdiv(n, BT), _cdiv(E, BE)), X, part, ss, hc.scale.vec,
                         hc.base.vec, x_in, d, d, *consts, PART=1, **kw, nbytes=4 * (X.numel() + n * E))
            with self.branch():
                self._launch(K.hc_finalize_kernel, (_cdiv(n, BT), 1), d, part, ss, hc.scale.vec, hc.base.vec,
                             d, post, comb, *consts, PART=2, **kw, nbytes=4 * n * split * NM)
        else:
            self._launch(K.hc_finalize_kernel, (_cdiv(n, BT), _cdiv(E, BE)), X, part, ss, hc.scale.vec,
                         hc.base.vec, x_in, post, comb, *consts, **kw, nbytes=4 * (X.numel() + n * E))
        return x_in, post, comb

    @_op
    def hc_pre(self, X, hc):
        return self._hc_collapse(X, hc, head=False)

    @_op
    def hc_post(self, y, X, post, comb):
        y2 = None
        if isinstance(y, _Sum) and y.val is None:
            y, y2 = self._val(y.a), self._val(y.b)
        else:
            y = self._val(y)
        return _Expanded(y, y2, self._val(X), post, comb)

    @_op
    def rms_norm(self, x, weight=None):
        return _Normed(x, weight)

    @_op
    def linear(self, x, w):
        return self._linear(x, w)

    @_op
    def head_norm(self, q):
        return _HeadNormed(q, self.cfg.n_head, self.cfg.head_dim)

    def _rope(self, x, il: int, inverse: bool, qat: bool = False, rows_dim: tuple | None = None):
        norm, nw = 0, self._dummy_f
        if isinstance(x, _HeadNormed) and x.val is None:
            src = self._val(x.x)
            n, ROWS, D = src.shape[0], x.H, x.D
            norm = 2
            shape = (n, ROWS, D)
        elif isinstance(x, _Normed) and x.val is None:
            src = self._val(x.x)
            n, D = src.shape
            ROWS = 1
            norm = 2 if x.w is None else 1
            nw = self._dummy_f if x.w is None else x.w.vec
            shape = (n, D)
        else:
            src = self._val(x)
            shape = tuple(src.shape)
            n = shape[0]
            if rows_dim is not None:
                ROWS, D = rows_dim
                shape = (n, ROWS, D)
            else:
                D = shape[-1]
                ROWS = int(np.prod(shape[1:-1], dtype=np.int64)) if len(shape) > 2 else 1
        out = self._new(shape)
        BR = min(_pow2(ROWS), 16 if n >= MM_MIN else self.rope_rows_decode)
        self._launch(K.rope_kernel, (n, _cdiv(ROWS, BR)), src, out, nw, self._freq[il], self._pos, ROWS,
                     self.cfg.rms_eps, D=D, NROT=self.cfg.n_rot, BR=BR, NORM=norm, INVERSE=inverse,
                     QAT=qat, QS=float(np.float32(1.0 / np.sqrt(D))), LOGD=max(0, D.bit_length() - 1),
                     HDP=_pow2(D // 2), num_warps=max(1, min(4, BR * D // 256)), nbytes=8 * n * ROWS * D)
        return out

    @_op
    def rope(self, x, p0, il, inverse=False):
        self._set_pos(p0)
        if inverse and isinstance(x, _AttnParts) and x.val is None:
            return _Combined(x)
        return self._rope(x, il, inverse)

    @_op
    def kv_store(self, st, kv, p0):
        self._set_pos(p0)
        kv = self._val(kv)
        n, D = kv.shape
        raw = st["raw"]
        self._launch(K.kv_store_kernel, (n,), kv, raw, self._pos, raw.shape[0], D=D, NN=self.cfg.n_nope,
                     DS4=self.ds4_numerics, DP=_pow2(D), num_warps=4, nbytes=8 * n * D)

    @_op
    def compressor(self, st, a, w, p0, il, indexer):
        cfg = self.cfg
        self._set_pos(p0)
        m = cfg.ratio(il)
        d = cfg.indexer_head_dim if indexer else cfg.head_dim
        csa = m == 4
        C = (2 if csa else 1) * d
        prefix = "index" if indexer else "comp"
        skv, ssc, rows = st[prefix + "_kv"], st[prefix + "_score"], st[prefix]
        with self.branch():  # (in a decode step: the two products on two streams)
            sc_all = self._linear(a, w.gate)
        kv_all = self._linear(a, w.kv)
        n = kv_all.shape[0]
        nwin = 1 if self._step is not None else (p0 + n) // m - p0 // m
        mode = (2 if indexer else 1) if self.ds4_numerics else 0
        ncand = 8 if csa else m
        if nwin > 0:
            self._launch(K.comp_pool_kernel, (nwin,), kv_all, sc_all, w.ape.f32, skv, ssc, w.norm.vec,
                         self._freq[il], self._pos, rows, n, cfg.rms_eps,
                         M=m, D=d, C=C, NROT=cfg.n_rot, CSA=csa, NCAND=ncand, RB=min(_pow2(ncand), 8),
                         MODE=mode, QS=float(np.float32(1.0 / np.sqrt(d))), LOGD=max(0, d.bit_length() - 1),
                         HDP=_pow2(d // 2), num_warps=4,
                         nbytes=4 * nwin * 2 * ncand * d * 2)
        BC = min(_pow2(C), (64 if ncand <= 8 else 16) if not self.interpret else 1024)
        self._launch(K.comp_update_kernel, (_cdiv(C, BC),), kv_all, sc_all, w.ape.f32, skv, ssc, self._pos, n,
                     M=m, C=C, CSA=csa, NR=ncand, BC=BC, NRP=_pow2(ncand), num_warps=4, nbytes=4 * 4 * ncand * C)

    @_op
    def indexer_select(self, st, qr, a, w, p0, il):
        cfg = self.cfg
        self._set_pos(p0)
        m = cfg.ratio(il)
        n = qr.shape[0]
        top_k = cfg.indexer_top_k
        if self._step is None:
            cs = (p0 + n) // m
            if cs <= top_k:
                return None
        else:
            cs = st["index"].shape[0]
        IH, ID = cfg.indexer_heads, cfg.indexer_head_dim
        with self.branch():  # (decode step: the head weights beside the queries' product and RoPE)
            hw = self._linear(a, w.proj)
        iq = self._rope(self._linear(qr, w.q_b), il, inverse=False, qat=self.ds4_numerics, rows_dim=(IH, ID))
        scores = self._new((n, cs))
        BC = 64 if not self.interpret else 128
        hist = self.topk_hist and n == 1
        capb = self.topk_bucket
        if hist and (self._topk_buckets is None or self._topk_buckets.numel() != 2 * 16384 * capb):
            self._topk_buckets = torch.zeros(2 * 16384 * capb, dtype=torch.int32, device=self.dev)
        bkt = self._topk_buckets if hist else self._dummy_i
        if self.query_waits_index == "rope":
            self._hold_main()
        try:
            self._launch(K.idx_score_kernel, (n, _cdiv(cs, BC)), iq, hw, st["index"], scores, self._pos,
                         self._topk_counts, bkt, m, IH, cs, top_k, float(np.float32(np.sqrt(ID * IH))),
                         IHP=max(16, _pow2(IH)), ID=ID, BC=BC, EXACT=self.ds4_numerics, HIST=hist, CAPB=capb, IDP=_pad_dim(ID),
                         num_warps=4, nbytes=4 * n * (cs * ID + IH * ID + cs))
            if self.query_waits_index == "score":
                self._hold_main()
            idx = self._new((n, top_k), torch.int32)
            cnt = self._new((n,), torch.int32)
            if hist:
                ch = self.topk_rows
                lb = max(ch, _pow2(cs) // 16)  # (at most 16 blocks of rows before a program's)
                self._launch(K.topk_one_kernel, (_cdiv(cs, ch),), scores, idx, cnt, self._pos, self._topk_counts,
                             bkt, m, top_k, _cdiv(cs, ch), CH=ch, CAPB=capb, LB=lb, NLB=_cdiv(cs, lb),
                             num_warps=self.topk_warps, nbytes=4 * cs)
            else:
                cmax = _pow2(cs) if cs <= self.topk_reg_max else 0
                self._launch(K.topk_kernel, (n,), scores, idx, cnt, self._pos, m, cs, top_k,
                             BC=256 if not self.interpret else 1024, CMAX=cmax,
                             num_warps=8 if cmax > 4096 else 4, nbytes=4 * n * cs)
        except BaseException:
            # the scores kernel may have counted without a top-k to clear the counts: the next
            # selection would start from them
            if hist:
                self._topk_counts.zero_()
            raise
        return Selection(idx, cnt, top_k)

    @_op
    def attention(self, q, st, sinks, p0, il, selected):
        cfg = self.cfg
        self._set_pos(p0)
        q = self._val(q)
        n, H, D = q.shape
        raw = st["raw"]
        W = min(cfg.sliding_window, raw.shape[0])
        m = cfg.ratio(il)
        comp = m != 0
        sel = selected is not None
        HB = 16
        common = (q, raw, st["comp"] if comp else raw,
                  selected.idx if sel else self._dummy_i, selected.count if sel else self._dummy_i,
                  self._pos, sinks.vec)
        qscale = float(np.float32(np.sqrt(D)))
        f16 = bool(self.attn_f16 and self.ds4_numerics)
        if n > 1:
            out = self._new((n, H, D))
            HBp, BR, warps, stages = ((16, 16, 8, 1) if self.interpret else
                                      self.attn_tile if f16 else self.attn_tile_tf32)
            self._launch(K.attn_kernel, (n, _cdiv(H, HBp), 1), *common, self._dummy_f, self._dummy_f, out,
                         H, W, raw.shape[0], max(m, 1), cfg.indexer_top_k, 1 << 30, qscale,
                         D=D, HB=HBp, BR=BR, COMP=comp, SEL=sel, SINGLE=True, KEXACT=self.ds4_numerics,
                         F16=f16, DP=_pad_dim(D), num_warps=warps, num_stages=stages, nbytes=4 * n * (2 * H * D + (W + cfg.indexer_top_k) * D))
            return out
        if self._step is not None:
            ncomp = (cfg.indexer_top_k if sel else st["comp"].shape[0]) if comp else 0
        else:
            vis = (p0 + n) // m if comp else 0
            ncomp = min(vis, cfg.indexer_top_k) if sel else vis
        RS = self.attn_split_rows
        S = max(1, _cdiv(W + ncomp, RS))
        mo = self._new((n, S, H))
        lo = self._new((n, S, H))
        ao = self._new((n, S, H, D))
        self._launch(K.attn_kernel, (n, _cdiv(H, HB), S), *common, mo, lo, ao,
                     H, W, raw.shape[0], max(m, 1), cfg.indexer_top_k, RS, qscale,
                     D=D, HB=HB, BR=16, COMP=comp, SEL=sel, SINGLE=False, KEXACT=self.ds4_numerics,
                     F16=f16, DP=_pad_dim(D), num_warps=8, nbytes=4 * ((W + ncomp) * D * _cdiv(H, HB) + 2 * S * H * D))
        return _AttnParts(mo, lo, ao, S, sinks, il, n, H, D)

    def _combine_pairs(self, D: int) -> int:
        """Pairs of a head per attn_combine_kernel program."""
        return min(_pow2(D // 2), self.combine_pairs)

    def _combine_xq8(self, D: int) -> bool:
        """Whether the merge can store its result in XQ8 form: every program's pairs are whole
        32-value blocks of the head."""
        BI = self._combine_pairs(D)
        return (D // 2) % BI == 0 and (2 * BI) % 32 == 0

    def _combine(self, x: _AttnParts, rope_inverse: bool, xq=None):
        """The merged splits; with xq (buffers from _xq_new; 32-value blocks within a program's
        pairs) also in XQ8 form."""
        out = self._new((x.n, x.H, x.D))
        BI = self._combine_pairs(x.D)
        if xq is not None and not self._combine_xq8(x.D):
            raise ValueError(f"attention merge in XQ8 form: expected {BI}-pair programs of 32-value "
                             f"blocks to tile the head's {x.D // 2} pairs")
        q = xq if xq is not None else (self._dummy_i, self._dummy_f, self._dummy_f)
        self._launch(K.attn_combine_kernel, (x.n, x.H, _cdiv(x.D // 2, BI)), x.mo, x.lo, x.ao, x.sink.vec,
                     self._freq[x.il], self._pos, out, x.H, *q, S=x.S, SP=_pow2(x.S), D=x.D, NROT=self.cfg.n_rot,
                     ROPE_INV=rope_inverse, BI=BI, XQ8=xq is not None, DEP=xq is not None and self._pdl("combine"),
                     num_warps=4, nbytes=4 * x.ao.numel() + 4 * out.numel() + (3 * out.numel() if xq else 0))
        return out

    @_op
    def grouped_output(self, o, w_a, w_b):
        cfg = self.cfg
        n = o.shape[0]
        width = int(np.prod(o.shape[1:]))
        # o stays lazy (the merge then stores its XQ8 form too) where w_a's decoder reads that form
        x = o if isinstance(o, _Combined) and self._takes_xq8(w_a, n) else self._val(o).reshape(n, width)
        low = self._linear(x, w_a, group_rows=cfg.o_lora_rank, group_stride=width // cfg.o_groups,
                           xq_out=self.xq_out and self._takes_xq8(w_b, n))
        return self._linear(low, w_b)

    @_op
    def router(self, f, gate_inp, bias, tid2eid, tokens, il):
        cfg = self.cfg
        logits = self._linear(f, gate_inp)
        n, NE = logits.shape
        k = cfg.n_expert_used
        ids = self._new((n, k), torch.int32)
        wts = self._new((n, k))
        tok = self._tokens_dev(tokens)
        self._launch(K.router_kernel, (n,), logits, NE, bias.vec if bias is not None else self._dummy_f,
                     tid2eid.i32 if tid2eid is not None else self._dummy_i, tok, ids, wts,
                     float(cfg.expert_weights_scale), KSEL=k, KP=_pow2(k), BE=_pow2(NE),
                     HAS_BIAS=bias is not None, HASH=tid2eid is not None,
                     num_warps=1, nbytes=8 * n * NE)  # one warp: its 20 reductions need no barrier
        return ids, wts

    def _gateup_mv(self, x, gate: QWeight, up: QWeight, ids, wts, slots: int, kslots: int, clamp: float,
                   c: dict | None = None, xq=None, hq=None):
        """Decode gate/up products -> h [slots, F]. c: the launch parameters (_mv_cfg), xq: x in
        XQ form where c's decoder reads it (418), hq: buffers (_xq_new) that also get h in XQ form."""
        E, F = gate.K, gate.N
        h = self._new((slots, F))
        routed = ids is not None
        if c is None:
            c = self._mv_cfg(gate.kt, F, E, slots, kind="gateup", x16=_x16(x, x.stride(0)))
        qout = hq is not None
        if qout:  # a tile stores whole 32-value XQ blocks of h
            c = dict(c, BN=max(c["BN"], 32))
        S = c["S"]
        self._tiles_ok(_cdiv(F, c["BN"]) * slots, S)
        hq = hq if qout else (self._dummy_i, self._dummy_f, self._dummy_f)
        xw, xs = (xq[0], xq[1]) if c["TYPE"] in (Decoder.IQ2_GROUPS_XQ, Decoder.Q8C_XQ8) else (self._dummy_i, self._dummy_f)
        self._launch(K.moe_gateup_mv_kernel, (_cdiv(F, c["BN"]), slots, S), x, x.stride(0),
                     ids if routed else self._dummy_i, wts if routed else self._dummy_f,
                     gate.b8, gate.i16, gate.f32, up.b8, up.i16, up.f32, self._gridp, self._ksigns, h,
                     self._new((slots, S, 2, F)) if S > 1 else self._dummy_f, self._tickets(),
                     xw, xs, *hq, F, E, gate.RB, F * gate.RB, kslots, float(clamp), ROUTED=routed, QOUT=qout, **c,
                     nbytes=slots * (2 * F * gate.RB + 4 * (E + F)))
        return h

    def _down_mv(self, h, ids, down: QWeight, n: int, k: int, c: dict | None = None, hq=None):
        """Decode down products: out[t] = Σ_j down_{ids[t, j]} · h[t·k + j], in slot order (h in
        XQ form, hq, where c's decoder reads it: 111, 113)."""
        F, E = down.K, down.N
        out = self._new((n, E))
        if c is None:
            c = self._mv_cfg(down.kt, E, F, n, kind="down", x16=_x16(h, F))
        S = c["S"]
        self._tiles_ok(_cdiv(E, c["BN"]) * n, S)
        hq = hq if c["TYPE"] in (Decoder.Q2_K_XQ, Decoder.Q2S_HALVES_XQ) else (self._dummy_i, self._dummy_f, self._dummy_f)
        self._launch(K.moe_down_mv_kernel, (_cdiv(E, c["BN"]), n, S), h, ids, down.b8, down.i16, down.f32,
                     self._gridp, self._ksigns, out, self._new((n, S, E)) if S > 1 else self._dummy_f,
                     self._tickets(), *hq, E, F, down.RB, E * down.RB, KSLOTS=k, **c,
                     nbytes=n * k * (E * down.RB + 4 * F) + 4 * n * E)
        return out

    def _routed_mv(self, f, gate: QWeight, up: QWeight, down: QWeight, ids, wts, n: int, k: int, clamp: float):
        """The routed experts of a decode step. With the integer decoders (418 for the gate/up,
        113 or 111 for the down) x and h go to them in XQ form: x from the norm's kernel
        (_xq), h from the gate/up's own tiles."""
        E, F = gate.K, gate.N
        cg = self._mv_cfg(gate.kt, F, E, n * k, kind="gateup", xq=E % 32 == 0 and up.kt == gate.kt)
        xq = self._xq(f) if cg["TYPE"] == Decoder.IQ2_GROUPS_XQ else None  # (before _val: the norm's kernel writes both)
        x = self._val(f)
        if xq is None:  # a float decoder of x: its own alignment check
            cg = self._mv_cfg(gate.kt, F, E, n * k, kind="gateup", x16=_x16(x, x.stride(0)))
        # the down's decoder: 111 and 113 read h in XQ form, which the gate/up then also stores
        cd = self._mv_cfg(down.kt, E, F, n, kind="down", xq=F % 32 == 0)
        hq = self._xq_new(n * k, F) if cd["TYPE"] in (Decoder.Q2_K_XQ, Decoder.Q2S_HALVES_XQ) else None
        h = self._gateup_mv(x, gate, up, ids, wts, n * k, k, clamp, c=cg, xq=xq, hq=hq)
        if hq is None:  # a float decoder of h: its own alignment check
            cd = self._mv_cfg(down.kt, E, F, n, kind="down", x16=_x16(h, F))
        return self._down_mv(h, ids, down, n, k, c=cd, hq=hq)

    def _rms(self, x: _Normed, xq=None, perm: bool = False) -> torch.Tensor:
        """x's RMSNorm (rms_kernel), and with xq (buffers from _xq_new; x's width a power of two)
        the result in XQ form too (XQ8 with perm)."""
        src = self._val(x.x)
        n, D = src.shape
        out = self._new((n, D))
        w = self._dummy_f if x.w is None else x.w.vec
        q = xq if xq is not None else (self._dummy_i, self._dummy_f, self._dummy_f)
        self._launch(K.rms_kernel, (n,), src, w, out, D, self.cfg.rms_eps, *q, BD=_pow2(D),
                     WEIGHTED=x.w is not None, XQ=xq is not None, PERM=perm, DEP=perm and self._pdl("rms"), num_warps=4,
                     nbytes=8 * src.numel() + (3 * n * D if xq is not None else 0))
        return out

    def _xq_new(self, n: int, Kd: int):
        """Buffers of n rows of Kd values in XQ form (kernels._xq_store): words, block scales,
        16-value sums."""
        return self._new((n, Kd // 2), torch.int32), self._new((n, Kd // 32)), self._new((n, Kd // 16))

    def _xq(self, x, perm: bool = False):
        """x [n, K] (K a multiple of 32) in XQ form, or XQ8 with perm (the Q8C decoder 309). A
        normed x not yet materialised gets it from its rms_kernel, the attention's merge (XQ8) from
        attn_combine_kernel, with no launch of their own, and keeps it for its next reader."""
        slot = "xq8" if perm else "xq"
        if getattr(x, slot, None) is not None:
            return getattr(x, slot)
        n, Kd = x.shape[0], int(np.prod(x.shape[1:]))
        xq = self._xq_new(n, Kd)
        if isinstance(x, _Normed) and x.val is None and _pow2(Kd) == Kd:
            x.val = self._rms(x, xq, perm)
        elif isinstance(x, _Combined) and x.val is None and perm and self._combine_xq8(x.parts.D):
            x.val = self._combine(x.parts, rope_inverse=True, xq=xq)
        else:
            src = self._val(x)
            NBLK = 8
            self._launch(K.xq_kernel, (n, _cdiv(Kd // 32, NBLK)), src, src.stride(0), *xq, Kd, NBLK=NBLK,
                         PERM=perm, num_warps=4, nbytes=7 * n * Kd)
        if isinstance(x, (_Normed, _Combined)):
            setattr(x, slot, xq)
        return xq

    def _tiles(self, n_assign: int, counts: torch.Tensor, BM: int):
        """Tile schedule of the expert-sorted assignments: expert, first row, segment end."""
        NE = counts.shape[0]
        T = _cdiv(n_assign, BM) + NE
        tiles = (counts + BM - 1) // BM
        tend = torch.cumsum(tiles, 0)
        tstart = tend - tiles
        send = torch.cumsum(counts, 0)
        sstart = send - counts
        t = torch.arange(T, device=self.dev)
        e = torch.searchsorted(tend, t, right=True)
        ec = e.clamp(max=NE - 1)
        tile_e = torch.where(e < NE, ec, -1).to(torch.int32)
        tile_r0 = (sstart[ec] + (t - tstart[ec]) * BM).to(torch.int32)
        tile_end = send[ec].to(torch.int32)
        return T, tile_e, tile_r0, tile_end

    @_op
    def moe(self, f, ids, weights, gate, up, down, il):
        cfg = self.cfg
        x = self._val(f)
        n, E = x.shape
        k = ids.shape[1]
        F = gate.N
        clamp = cfg.swiglu_clamp[il]
        if n < MM_MIN:
            return self._routed_mv(f, gate, up, down, ids, weights, n, k, clamp)
        # prefill: group the (token, slot) assignments by expert
        NE = gate.n_exp
        flat = ids.reshape(-1).to(torch.int64)
        order = torch.sort(flat, stable=True).indices
        # assignments per expert without torch.bincount, which reads the largest id back to the
        # host: a stream synchronisation per layer, and the GPU then idles while the host queues
        # the next kernels (the 8192-token prefill's GPU was idle 6 % of the time with it)
        counts = torch.zeros(NE, dtype=torch.int64, device=self.dev).index_add_(0, flat, torch.ones_like(flat))
        gu16 = self._moe16(gate, KernelType.IQ2_XXS) and up.type == gate.type
        dn16 = self._moe16(down, KernelType.Q2_K)
        BM = self.moe16_bm if gu16 or dn16 else 64
        T, tile_e, tile_r0, tile_end = self._tiles(n * k, counts, BM)
        tok_sorted = (order // k).to(torch.int32)
        w_sorted = weights.reshape(-1)[order].contiguous()
        inv = torch.empty_like(order)
        inv[order] = torch.arange(n * k, device=self.dev)
        inv = inv.to(torch.int32)
        h = torch.empty((n * k, F), dtype=torch.float32, device=self.dev)
        if gu16:
            xh, xl, xi, _, _ = self._split16(x, sums=False)
            BN, KS, warps, stages = self.moe16_tile["gateup"]
            lv8, sg8 = self._gridp[256:768].view(torch.int64), self._ksigns[128:384].view(torch.int64)
            self._launch(K16.moe_gateup_mm16_kernel, (T, _cdiv(F, BN)), xh, xl, xi, tok_sorted, w_sorted,
                         tile_e, tile_r0, tile_end, gate.i16, up.i16, gate.f32, up.f32, lv8, sg8, h, F, E,
                         gate.RB, F * gate.RB, float(clamp), BM=BM, BN=BN, KS=KS, ROUTED=True, num_warps=warps,
                         num_stages=stages,
                         nbytes=2 * gate.nbytes + 4 * n * k * (E + F))
        else:
            BN, warps = self.moe_tile["gateup"]
            self._launch(K.moe_gateup_mm_kernel, (T, _cdiv(F, BN)), x, x.stride(0), tok_sorted, w_sorted,
                         tile_e, tile_r0, tile_end, gate.b8, gate.i16, gate.f32, up.b8, up.i16, up.f32,
                         self._gridp, self._ksigns, h, F, E, gate.RB, F * gate.RB, float(clamp),
                         TYPE=gate.kt, BM=BM, BN=BN, ROUTED=True, **self._mm_cfg(gate.kt, E),
                         num_warps=warps, num_stages=2, nbytes=2 * gate.nbytes + 4 * n * k * (E + F))
        osort = torch.empty((n * k, E), dtype=torch.float32, device=self.dev)
        if dn16:
            hh, hl, hi, gh, gl = self._split16(h, sums=True)
            BN, KS, warps, stages = self.moe16_tile["down"]
            self._launch(K16.moe_down_mm16_kernel, (T, _cdiv(E, BN)), hh, hl, hi, gh, gl, tile_e, tile_r0,
                         tile_end, down.f32, down.b8.view(torch.int32), down.i16, osort, E, F, down.RB,
                         E * down.RB, BM=BM, BN=BN, KS=KS,
                         num_warps=warps, num_stages=stages, nbytes=down.nbytes + 4 * n * k * (E + F))
        else:
            BN, warps = self.moe_tile["down"]
            self._launch(K.moe_down_mm_kernel, (T, _cdiv(E, BN)), h, tile_e, tile_r0, tile_end,
                         down.b8, down.i16, down.f32, self._gridp, self._ksigns, osort, E, F, down.RB,
                         E * down.RB, TYPE=down.kt, BM=BM, BN=BN, **self._mm_cfg(down.kt, F),
                         num_warps=warps, num_stages=2, nbytes=down.nbytes + 4 * n * k * (E + F))
        out = self._new((n, E))
        BE = min(1024, _pow2(E))
        self._launch(K.moe_reduce_kernel, (n, _cdiv(E, BE)), osort, inv, out, E, KSLOTS=k, BE=BE,
                     num_warps=4, nbytes=4 * n * E * (k + 1))
        return out

    def _moe16(self, w: QWeight, ttype: int) -> bool:
        """Whether expert weight w takes the exact-integer fp16 path (kernels_mm16.py)."""
        return self.moe_int16 and self.prec == "bf16x3" and int(w.type) == int(ttype) and w.K % 256 == 0

    def _q8_16(self, w: QWeight, x: torch.Tensor, group_stride: int = 0) -> bool:
        """Whether a Q8_0 product with x [n, columns] takes the fp16 integer path: whole 256-value
        chunks of x (split16_kernel) and groups starting on chunk boundaries."""
        return (self.q8_int16 and self.prec == "bf16x3" and w.kt == KernelType.Q8C
                and x.shape[1] % 256 == 0 and group_stride % 256 == 0 and x.stride(1) == 1)

    def _split16(self, x: torch.Tensor, sums: bool):
        """x [R, K] float32 -> (hi, lo [R, K] fp16, 1/s [R, K/256], and with sums the 16-value
        sums / 16 as hi, lo [R, K/16] fp16): x·s = hi + lo per 256-value chunk (split16_kernel)."""
        R, Kd = x.shape
        f16 = dict(dtype=torch.float16, device=self.dev)
        xh, xl = torch.empty((R, Kd), **f16), torch.empty((R, Kd), **f16)
        xi = torch.empty((R, Kd // 256), dtype=torch.float32, device=self.dev)
        gh, gl = (torch.empty((R, Kd // 16), **f16), torch.empty((R, Kd // 16), **f16)) if sums else (xh, xl)
        BR = 64 if self.interpret else 8
        self._launch(K16.split16_kernel, (_cdiv(R, BR), Kd // 256), x, x.stride(0), xh, xl, xi, gh, gl, R, Kd,
                     BR=BR, SUMS=sums, num_warps=4, nbytes=8 * R * Kd)
        return xh, xl, xi, gh, gl

    @_op
    def shared_expert(self, f, gate, up, down, il):
        cfg = self.cfg
        if gate.kt != up.kt or gate.RB != up.RB:
            # The layout lets the shared gate and up differ in type; the fused gate/up kernels
            # decode both with one decoder, so such a pair takes two products and the SwiGLU.
            g, u = self._val(self._linear(f, gate)), self._val(self._linear(f, up))
            h = torch.empty_like(g)
            N = g.numel()
            self._launch(K.swiglu_kernel, (_cdiv(N, 1024),), g, u, h, N, float(cfg.swiglu_clamp[il]),
                         BLOCK=1024, nbytes=12 * N)
            return self._linear(h, down)
        if (isinstance(f, _Normed) and f.shape[0] < MM_MIN and f.shape[1] % 32 == 0
                and self.mv_types.get(KernelType.IQ2_XXS) == Decoder.IQ2_GROUPS_XQ):
            # the routed experts' gate/up (418) reads f in XQ form: the norm's kernel here, beside
            # the router, writes it with the float f this reads (else it would be a launch of its
            # own between the router and the routed experts)
            self._xq(f)
        x = self._val(f)
        n, E = x.shape
        F = gate.N
        clamp = cfg.swiglu_clamp[il]
        if n < MM_MIN:
            c = self._mv_cfg(gate.kt, F, E, n, kind="gateup", x16=_x16(x, x.stride(0)),
                             xq=gate.kt == KernelType.Q8C and up.kt == gate.kt)
            xq = self._xq(f, perm=True) if c["TYPE"] == Decoder.Q8C_XQ8 else None  # (f's norm wrote XQ: a launch)
            h = self._gateup_mv(x, gate, up, None, None, n, 1, clamp, c=c, xq=xq)
        elif self._q8_16(gate, x) and up.type == gate.type:
            BM, BN, warps, stages = self.q8_16_tile["gateup"]
            T = _cdiv(n, BM)
            tile_e = torch.zeros(T, dtype=torch.int32, device=self.dev)
            tile_r0 = torch.arange(0, n, BM, dtype=torch.int32, device=self.dev)
            tile_end = torch.full((T,), n, dtype=torch.int32, device=self.dev)
            h = torch.empty((n, F), dtype=torch.float32, device=self.dev)
            xh, xl, xi, _, _ = self._split16(x, sums=False)
            self._launch(K16.moe_gateup_q8_mm16_kernel, (T, _cdiv(F, BN)), xh, xl, xi, self._dummy_i,
                         self._dummy_f, tile_e, tile_r0, tile_end, gate.i16, up.i16, h, F, E, gate.RB, 0,
                         float(clamp), BM=BM, BN=BN, ROUTED=False, num_warps=warps, num_stages=stages,
                         nbytes=2 * gate.nbytes + 4 * n * (E + F))
        else:
            BM = 64
            mc = self._mm_cfg(gate.kt, E)
            BN, warps = self.moe_tile["shared" if mc["U"] else "gateup"]
            T = _cdiv(n, BM)
            tile_e = torch.zeros(T, dtype=torch.int32, device=self.dev)
            tile_r0 = torch.arange(0, n, BM, dtype=torch.int32, device=self.dev)
            tile_end = torch.full((T,), n, dtype=torch.int32, device=self.dev)
            h = torch.empty((n, F), dtype=torch.float32, device=self.dev)
            self._launch(K.moe_gateup_mm_kernel, (T, _cdiv(F, BN)), x, x.stride(0), self._dummy_i, self._dummy_f,
                         tile_e, tile_r0, tile_end, gate.b8, gate.i16, gate.f32, up.b8, up.i16, up.f32,
                         self._gridp, self._ksigns, h, F, E, gate.RB, 0, float(clamp),
                         TYPE=gate.kt, BM=BM, BN=BN, ROUTED=False, **mc,
                         num_warps=warps, num_stages=2, nbytes=2 * gate.nbytes + 4 * n * (E + F))
        return self._linear(h, down)

    @_op
    def add(self, a, b):
        return _Sum(a, b)

    @_op
    def output_logits(self, X, hc, norm, out):
        X = self._val(X)
        x_in, _, _ = self._hc_collapse(X[-1:], hc, head=True)
        logits = self._linear(_Normed(x_in, norm), out)
        if self._step is not None:
            self._next_token(logits[0])
        return logits[0]


def _max_shared(dev: torch.device) -> int:
    """Shared memory a program may use on dev, in bytes, as Triton checks it at launch."""
    from triton.compiler.compiler import max_shared_mem

    return int(max_shared_mem(dev.index if dev.index is not None else torch.cuda.current_device()))


def _grid_table() -> np.ndarray:
    """The IQ2_XXS grid for the kernels: [0, 256) the entries as two-bit level codes (the block
    decoder), then [256, 768) each entry's 8 levels as int8 bytes in two little-endian words,
    then [768, 1024) its 8 codes as nibbles, value j's in bits 4j..4j+1 (the 416 decoder)."""
    levels = IQ2XXS_GRID.astype(np.uint8).reshape(256, 2, 4)  # levels 8, 25, 43 fit a byte
    words = (levels.astype(np.int64) << (8 * np.arange(4))).sum(axis=2).astype(np.uint32)
    codes = (_grid_codes().astype(np.int64)[:, None] >> (2 * np.arange(8))) & 3
    nibbles = (codes << (4 * np.arange(8))).sum(axis=1).astype(np.uint32)
    return np.concatenate([_grid_codes(), words.reshape(-1).view(np.int32), nibbles.view(np.int32)])


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
