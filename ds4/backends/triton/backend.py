"""The Triton backend: every op of ds4/backends/base.py as Triton kernels (kernels/); torch
only allocates, holds CUDA graphs and does the little glue of the prefill MoE grouping.

Weights stay quantized on the device: GGUF blocks, with Q8_0 rows rearranged into 256-value chunks
(layout.py); the kernels decode them in registers. Activations and the session state are float32
torch tensors laid out as ds4/core/state.py says (under numerics "ds4" the indexer's rows in
bfloat16 and the attention cache rows in float16, which hold their values exactly), so
state_to_numpy / state_from_numpy are exact copies and a session moves between backends.

Four things are backend-internal and invisible to the graph:

* Lazy ops. `rms_norm`, `head_norm`, `add`, `hc_post`, a decode `attention` and the RoPE of a
  normed row return small records instead of launching a kernel; the consumer fuses them (a
  matrix-vector product normalises its input itself, RoPE normalises the rows it rotates,
  mHC-expand adds the two FFN outputs, the next mHC collapse of a decode step computes the expand
  in its mixing kernel, the inverse RoPE merges the attention splits, the KV store rotates the
  row it stores). Anything else materialises them once.
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

TritonBackend is assembled from one mixin per op family: linear.py (decode and prefill products),
steps.py (decode steps, CUDA graphs, device-chained sampling), ops_hc.py (embedding, mHC, norms,
logits), ops_attention.py (RoPE, KV store, compressor, indexer, attention) and ops_moe.py (router,
experts, shared expert); plumbing.py holds the device weights, lazy values and helpers they share,
tuning.py every launch configuration, formats.py the type and decoder names.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch

from ...core.config import ModelConfig
from ...core.gguf_model import ModelError, Tensor
from ...core.quants import GGMLType, dequantize
from ...core.rope import layer_inv_freq
from ..base import Backend
from . import kernels as K
from .formats import Decoder, FLOAT_DECODER, KernelType
from .lanes import Lanes
from .linear import _LinearOps
from .ops_attention import TOPK_MAX_CHUNKS, _AttentionOps
from .ops_hc import _HcOps
from .ops_moe import _MoeOps
from .plumbing import (
    GRID_NIBBLES, MM_MIN, QWeight, ROW_UNIT, Selection, _AttnOut, _AttnParts, _Combined, _Expanded, _GraphEntry,
    _HeadNormed, _IQ2_GROUPS, _Lazy, _Normed, _Roped, _Step, _Sum, _UNNORMED, _UNROLLED_VB, _VALUE_ROLES, _X16_ONLY,
    _cdiv,
    _grid_table, _ksign_table, _largest_pow2_divisor, _max_shared, _pow2, check_config,
)
from .steps import _DecodeSteps
from .tuning import INTEGER_PRECISIONS, ONE_TERM, load_tuning
from .tuning import load_mv_shapes, parse_mv_shapes  # noqa: F401  (re-exported)


class TritonBackend(_LinearOps, _DecodeSteps, _HcOps, _AttentionOps, _MoeOps, Backend):
    name = "triton"
    # the specialised matrix-vector decoders of each layout (mv_types picks one)
    # (the *_XQ decoders read x in XQ form, so only the routed experts take them: _mv_cfg's xq)
    MV_PATHS = {KernelType.Q8C: (Decoder.Q8C_FLOAT, Decoder.Q8C_XQ8),
                KernelType.IQ2_XXS: (Decoder.IQ2_UNROLLED, Decoder.IQ2_GROUPS, Decoder.IQ2_GROUPS_SMEM,
                                     Decoder.IQ2_GROUPS_XQ),
                KernelType.Q2_K: (Decoder.Q2_K_UNROLLED, Decoder.Q2_K_XQ, Decoder.Q2S_HALVES_XQ)}
    XQ_PATHS = FLOAT_DECODER  # integer decoder -> the float one where x is not in XQ form
    # a chunk of fewer tokens takes the matrix-vector kernels, so it is not grouped with others
    prefill_ffn_min_rows = MM_MIN

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
        if self.prec == ONE_TERM and not self.ds4_numerics:
            raise ValueError(f"DS4_TRITON_DOT / dot_precision {ONE_TERM!r} rounds the prefill products' "
                             f"activations to fp16 (ds4's own numerics): it needs numerics 'ds4', got {numerics!r}")
        self.prec_f = ("ieee" if self.interpret else "tf32x3") if self.prec in INTEGER_PRECISIONS else self.prec
        d = self.dev
        self._gridp = torch.tensor(_grid_table(), dtype=torch.int32, device=d)
        self._grid_nibbles = self._gridp[GRID_NIBBLES:]  # the entries' level codes as nibbles
        self._ksigns = torch.tensor(_ksign_table(), dtype=torch.int32, device=d)
        self._freq = torch.tensor(np.stack([layer_inv_freq(cfg, il) for il in range(cfg.n_layer)]),
                                  dtype=torch.float32, device=d)
        self._pos = torch.zeros(1, dtype=torch.int32, device=d)
        self._pos_host = 0
        self._chunk = None  # (states, p0, logits) of the chunk forward_chunk is running
        # while a prefill group's chunks run one layer's attention sublayers (rows ..
        # concat_rows) with hl_keep: the Q8C weights' fp16 planes, {id(w): (w, hi, lo)}
        self._hl_kept: dict | None = None
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
        self._dummy_h = torch.zeros(16, dtype=torch.float16, device=d)
        # one query's indexer key counts, the top-k programs' tickets and chunk counts (the
        # layout: kernels.indexer.TOPK_CHUNKS): the scores kernel and top-k leave them at zero
        # for the next step, as topk_one_kernel says; the buckets (allocated on first use) need
        # no clearing
        self._topk_counts = torch.zeros(K.TOPK_CHUNKS.value + TOPK_MAX_CHUNKS, dtype=torch.int32, device=d)
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
        self.flop_ledger: list | None = None  # (kernel name, floating-point operations) per product launch

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
            from .synthetic import synthetic_bytes, tensor_generator

            # a tensor-parallel rank makes the whole tensor and cuts its part, so both ranks
            # hold the parts of one model (each tensor's bytes depend on its name alone)
            src = tensor.whole if tensor.whole is not None else tensor
            u8 = synthetic_bytes(src.name, src.type, src.dims, self.cfg, self.dev,
                                 tensor_generator(src.name, self.seed, self.dev))
            if tensor.cut is not None:
                u8 = tensor.cut(u8)
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
        return {k: torch.full(s, float(fill[k]), dtype=self._state_dtype(k), device=self.dev)
                for k, s in shapes.items()}

    def _state_dtype(self, name: str) -> torch.dtype:
        """float32, but under numerics "ds4" the rows whose values a narrower type holds exactly:
        the indexer's in bfloat16 (index_bf16), the raw and compressed attention rows in float16
        (cache_f16)."""
        if self.ds4_numerics:
            if name == "index" and self.index_bf16:
                return torch.bfloat16
            if name in ("raw", "comp") and self.cache_f16:
                return torch.float16
        return torch.float32

    def state_to_numpy(self, st, name):
        return st[name].detach().float().cpu().numpy().copy()

    def state_from_numpy(self, st, name, value):
        value = np.asarray(value)
        if tuple(value.shape) != tuple(st[name].shape):
            raise ValueError(f"state {name}: expected shape {tuple(st[name].shape)}, got {value.shape}")
        t = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))
        if st[name].dtype != torch.float32:  # rows this session keeps narrower: only values they hold
            narrow = t.to(st[name].dtype)
            bad = (narrow.float() != t) & ~(torch.isnan(t))
            if bool(bad.any()):
                i = int(bad.reshape(-1).nonzero()[0])
                raise ValueError(f"state {name}: expected values exact in {str(st[name].dtype)[6:]} "
                                 f"(numerics 'ds4' rows), got {float(t.reshape(-1)[i])!r} at flat index {i}")
            t = narrow
        st[name].copy_(t)

    def from_numpy(self, x):
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(self.dev)

    def torch_value(self, x):
        """An op's result as a plain float32 torch tensor on the device (a tensor-parallel
        gate through torch.distributed keeps it there)."""
        return self._val(x).float().contiguous()

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

    def _launch(self, kern, grid, *args, nbytes: int = 0, flops: int = 0, **kw):
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
        if self.flop_ledger is not None and flops:
            self.flop_ledger.append((kern.fn.__name__ if hasattr(kern, "fn") else str(kern), int(flops)))

    @property
    def _x_lo(self) -> bool:
        """Whether the integer prefill products carry x's low-order term(s) (float32 accuracy) or
        take x rounded once to fp16 (prec "f16")."""
        return self.prec != ONE_TERM

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
        elif isinstance(x, _Roped):
            self._set_pos(x.p0)
            out = self._rope(x.x, x.il, inverse=False)
        elif isinstance(x, _AttnOut):
            out = x.take(False)
        elif isinstance(x, _Expanded):
            out = self._expand_into(x, self._new(x.shape))
        else:
            raise TypeError(type(x))
        x.val = out
        return out

    def _expand_into(self, x: _Expanded, out: torch.Tensor) -> torch.Tensor:
        """hc_post's new mHC state written into `out` (rows of a larger tensor: concat_rows)."""
        X = x.X
        n, HC, E = X.shape
        BE = min(1024, _pow2(E))
        y2 = x.y2 if x.y2 is not None else x.y
        self._launch(K.hc_post_kernel, (n, _cdiv(E, BE)), x.y, y2, X, x.post, x.comb,
                     out, E, HC=HC, BE=BE, HAS_Y2=x.y2 is not None, num_warps=4,
                     nbytes=4 * (2 * X.numel() + 2 * n * E))
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
        if self.prec in INTEGER_PRECISIONS and ttype in (KernelType.Q8_0, KernelType.Q8C):
            NB = _largest_pow2_divisor(K_ // 32, self.units_per_step)
            return dict(NB=NB, VB=32, U=32, PREC=self.prec_f, TERMS=3 if self._x_lo else 1)
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
            # (the interpreter's cost grows with programs, hardly with their size; unrolled slots
            # cost per program)
            BN = min(256 if t == Decoder.Q2S_HALVES_XQ or t in _IQ2_GROUPS else 64, _pow2(N))
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
