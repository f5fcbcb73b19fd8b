"""The Triton kernels of the DS4 forward pass.

Every kernel reads quantized weight blocks (no dequantized copy of any weight), as GGUF stores
them or rearranged (Q8C chunks for Q8_0, IQ2S for IQ2_XXS, Q2S for Q2_K, below): `_wtile` decodes a
[rows, units, values-per-unit] tile of F32/F16/BF16/Q8_0/Q8C/Q2_K/Q4_K/IQ2_XXS rows in registers,
where a "unit" is the group of values that shares one scale (a Q8_0 block, a Q2_K sub-block, one
IQ2_XXS grid entry). Matrix-vector kernels (decode) multiply that tile by the activation with FMAs;
matrix-matrix kernels (prefill) reshape it to [rows, K-block] for `tl.dot`.
Specialised decoders (`_mv_step`, `_q8c_rows`, `_iq2_group_rows`) serve the decode shapes of the
shipped formats, and Q8_0 prefill products run as exact integers on bf16 tensor cores
(`_dot_units`).

Positions never come from the host: kernels read the chunk's first position p0 from a device
scalar, so a decode step can be captured once in a CUDA graph and replayed. Kernels that depend
on the position (which compressor window closes, how many compressed rows a query sees) decide
it themselves, and programs with nothing to do exit.

A weight is passed as three views of its byte buffer: `wb` (uint8), `wh` (int16: f16 scales and
16-bit words, which sit at even offsets in every DS4 block format) and `wf` (float32 for F32, else
int32 words); for the split layouts below, views of their separate arrays (QWeight).

Three formats are rearranged at upload, not decoded (`ds4.backends.triton.layout`). IQ2_XXS blocks
are split into their quant words and their scales (layout IQ2S: a group is one aligned 8-byte
load; `_iq2_blk`); Q2_K blocks into their quant words, scale bytes and (d, dmin) pairs (layout
Q2S: half a block's quants are two aligned 16-byte loads; `_q2_blk`). Q8_0 rows whose length is a multiple of 256 are stored as 256-value chunks
(layout Q8C): the chunk's 8 f16 scales (16 bytes), then its 256 quants as bytes q + 128, the 32 of
each block ordered so that byte j of the block's word w holds value 8j + w. The bytes of a row and
their count are the same (34 per 32 values); every quant word is 4-byte aligned and each chunk
16-byte aligned, where GGUF's 34-byte blocks only align to 2 bytes.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .layout import Q8C

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERP = tl.constexpr(INTERPRET)

if not INTERPRET:
    from triton.language.extra import libdevice
else:  # the interpreter gives scalars shape (1,), which numpy >= 2 refuses to int(); loop bounds
    import numpy as _np  # loaded from memory need that, so teach the interpreter's tensors
    import triton.runtime.interpreter as _ti

    if not getattr(_ti, "_ds4_index_patch", False):
        _orig_patch = _ti._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__",
                           lambda self: int(_np.asarray(self.handle.data).reshape(-1)[0]))

        _ti._patch_lang_tensor = _patch_lang_tensor
        _ti._ds4_index_patch = True
        # Two speed-ups that keep the semantics of the compiled kernels: no int32 overflow
        # checks (the GPU has none outside debug mode), and float32 dots through einsum
        # (np.matmul with an explicit dtype takes numpy's slow generic loop, and BLAS threads
        # thrash on a busy 2-core CI machine: 15 ms for a 64×128×64 product instead of 0.3).
        import dataclasses as _dc

        _ti.interpreter_builder.options = _dc.replace(_ti.interpreter_builder.options,
                                                      sanitize_overflow=False)
        _orig_dot = _ti.InterpreterBuilder.create_dot

        def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            if a.data.dtype == b.data.dtype == d.data.dtype == _np.float32:
                return _ti.TensorHandle(_np.einsum("...ij,...jk->...ik", a.data, b.data) + d.data, d.dtype.scalar)
            return _orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

        _ti.InterpreterBuilder.create_dot = _create_dot

# GGML type ids (ds4.core.quants.GGMLType), and Q8C: Q8_0 rows in 256-value chunks (above)
F32, F16, Q8_0, Q2_K, Q4_K, IQ2_XXS, BF16 = 0, 1, 8, 10, 12, 16, 30
# values per unit (values sharing one scale) in the decoded tiles
UNIT = {F32: 32, F16: 32, BF16: 32, Q8_0: 32, Q2_K: 16, Q4_K: 32, IQ2_XXS: 8, Q8C: 32}

_NEG = tl.constexpr(-1.0e30)  # "minus infinity" for running maxima (exp(_NEG - m) == 0, never NaN)


# ------------------------------------------------------------------------------------------------
# small helpers


@triton.jit
def _cos(x):
    if _INTERP:
        return tl.cos(x)
    else:  # accurate range reduction: θ = pos·freq reaches 10⁶ rad
        return libdevice.cos(x)


@triton.jit
def _sin(x):
    if _INTERP:
        return tl.sin(x)
    else:
        return libdevice.sin(x)


@triton.jit
def _ld_f16(wh, byte_off, mask):
    return tl.load(wh + byte_off // 2, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _ld4(p, INT: tl.constexpr = False, NC: tl.constexpr = True):
    """The 4 floats at p (16-byte aligned) as 4 tensors shaped like p: one 16-byte load per
    element instead of four 4-byte ones. In the routed decoders a warp's lanes walk different
    groups of x, so every load of x touches a sector per lane; this issues a quarter of those
    requests for the same sectors (Q2_K down 1232 → 1020 µs a decode step, IQ2_XXS gate/up
    2306 → 2228: bench/triton/README.md). INT: 4 int32
    words (x in XQ form). NC: through the non-coherent (read-only) path, which assumes the words
    do not change while the kernel runs. Not so in a kernel launched before the one that writes
    them ends (programmatic dependent launch): ptxas moved such a load above the kernel's wait
    (_pdl_wait; sm_90 SASS of wq_b's tiling), and the logits changed from run to run."""
    if _INTERP:
        return tl.load(p), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3)
    elif INT and not NC:
        return tl.inline_asm_elementwise("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [p],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                         is_pure=True, pack=1)
    elif INT:
        return tl.inline_asm_elementwise("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [p],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("ld.global.nc.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l", [p],
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                         is_pure=True, pack=1)


@triton.jit
def _ld2(p):
    """The 2 int32 words at p (8-byte aligned) as 2 tensors shaped like p: one 8-byte load."""
    if _INTERP:
        return tl.load(p), tl.load(p + 1)
    else:
        return tl.inline_asm_elementwise("ld.global.nc.v2.b32 {$0, $1}, [$2];", "=r,=r,l", [p],
                                         dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _opaque(v):
    """v (int64), with its pattern hidden from Triton's axis analysis. A load whose offsets it sees
    as contiguous along a tile's last axis gets a layout of its own from the coalescing pass (lanes
    along that axis), and the step's other tensors are then converted to or from it through shared
    memory: in 418 four conversions a K-step for the IQ2S group loads (sm_90 SASS: ten barriers in
    the K loop where there had been two). Behind this the load keeps the tile's layout, which
    coalesces as well (a warp's lanes read 4 consecutive groups of each of 8 rows: whole 32-byte
    sectors)."""
    if _INTERP:
        return v
    else:
        return tl.inline_asm_elementwise("mov.b64 $0, $1;", "=l,l", [v], dtype=tl.int64, is_pure=True, pack=1)


@triton.jit
def _q2_blk(row_off):
    """The index in the tensor of the first Q2_K block of the rows at GGUF byte offsets row_off:
    in Q2S (layout.py) block B's quant words start at word 16·B, its scales at byte 16·B of the
    scale plane, its (d, dmin) at halfword 2·B."""
    return row_off // 84


@triton.jit
def _iq2_blk(row_off):
    """The index in the tensor of the first IQ2_XXS block of the rows at GGUF byte offsets row_off:
    in IQ2S (layout.py) the quant words of block B start at word 16·B, its scale at halfword B."""
    return row_off // 66


@triton.jit
def _u8f(b):
    """Integer 0..255 in the low byte of b (higher bits ignored) -> float32, without an I2F:
    OR-ing it into the mantissa of 2^23 makes 2^23 + b exactly; I2F runs at a quarter of the
    FMA rate on Hopper and would bound the block decoders."""
    return ((b & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _s8f(b):
    """Signed int8 in the low byte of b -> float32 (_u8f of the byte offset by 128)."""
    return ((b & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _q8c_block(row_off, u):
    """Byte offsets of Q8C block u of the rows at row_off: (its f16 scale, its first quant)."""
    c = row_off + (u // 8) * 272
    return c + (u % 8) * 2, c + 16 + (u % 8) * 32


@triton.jit
def _q8c_value(p):
    """The value (0..31 in its block) of Q8C quant byte p: byte j of word w holds value 8j + w."""
    return (p % 4) * 8 + p // 4


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _rne(x):
    """Round to nearest integer, ties to even, for |x| < 2^22 (the 1.5·2^23 trick)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _pow2_ceil(v):
    """2^ceil(log2 v) for normal v > 0, exactly, from the float's bits."""
    b = v.to(tl.int32, bitcast=True)
    e = (b >> 23) & 255
    e = tl.where((b & 0x7FFFFF) == 0, e, e + 1)
    e = tl.maximum(e, 1)  # subnormal inputs: 2^-126 (they only occur for all-zero blocks)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(y):
    """Round to the nearest E4M3FN value, ties to even; |y| <= 448."""
    e = (tl.abs(y).to(tl.int32, bitcast=True) >> 23) & 255
    step = (tl.maximum(e - 3, 118) << 23).to(tl.float32, bitcast=True)  # 2^max(e-130, -9)
    return _rne(y / step) * step


@triton.jit
def _e2m1(y):
    ay = tl.abs(y)
    step = tl.where(ay < 2.0, 0.5, tl.where(ay < 4.0, 1.0, 2.0))
    return _rne(y / step) * step


@triton.jit
def _fp8_rows(x, NN: tl.constexpr):
    """FP8-E4M3 round trip of dims [0, NN) of rows x [R, D], in blocks of 64 (spec §3.4 step 5)."""
    R: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    xb = tl.reshape(x, [R, D // 64, 64])
    amax = tl.maximum(tl.max(tl.abs(xb), axis=2), 1.0e-4)
    s = _pow2_ceil(amax / 448.0)[:, :, None]
    q = _e4m3(tl.minimum(tl.maximum(xb / s, -448.0), 448.0)) * s
    blk = tl.arange(0, D // 64)[None, :, None]
    return tl.reshape(tl.where(blk < NN // 64, q, xb), [R, D])


@triton.jit
def _qat_rows(x, QS: tl.constexpr, LOGD: tl.constexpr):
    """Walsh–Hadamard (butterflies, then ×1/sqrt(d)) + FP4-E2M1 round trip per 32 (spec §3.6)."""
    R: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    i = tl.arange(0, D)[None, :]
    for s in tl.static_range(LOGD):
        partner = tl.gather(x, (i ^ (1 << s)) + tl.zeros([R, D], tl.int32), 1)
        x = tl.where((i & (1 << s)) == 0, x + partner, partner - x)
    x = x * QS  # float32(1/sqrt(D)), as the reference rounds it
    xb = tl.reshape(x, [R, D // 32, 32])
    amax = tl.maximum(tl.max(tl.abs(xb), axis=2), 7.05e-38)
    s = _pow2_ceil(amax / 6.0)[:, :, None]
    q = _e2m1(tl.minimum(tl.maximum(xb / s, -6.0), 6.0)) * s
    return tl.reshape(q, [R, D])


@triton.jit
def _tf32_split(x):
    """x = hi + lo with hi exact in tf32 (low 13 mantissa bits cleared) and lo exact in float32:
    two tf32 tensor-core products give a float32-accurate product with a tf32-exact operand."""
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _dot_f32(a, b, acc, B_EXACT: tl.constexpr):
    """acc + a·b to about float32 accuracy on tf32 tensor cores: 2 products when b is exact in
    tf32 (f16-rounded cache rows), 3 otherwise."""
    a_hi, a_lo = _tf32_split(a)
    if B_EXACT:
        acc = tl.dot(a_hi, b, acc, input_precision="tf32")
        acc = tl.dot(a_lo, b, acc, input_precision="tf32")
    else:
        b_hi, b_lo = _tf32_split(b)
        acc = tl.dot(a_hi, b_hi, acc, input_precision="tf32")
        acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32")
        acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
    return acc


@triton.jit
def _pow2_scale(mx):
    """(s, 1/s), powers of two with mx·s in [2^14, 2^15) for a normal mx >= 0, from the exponent
    bits (no rounding anywhere). s is capped at 2^126 so that 1/s stays normal: tiny or all-zero
    chunks then scale to less than 2^14, which only costs precision below float32's reach."""
    e = (mx.to(tl.int32, bitcast=True) >> 23) & 255
    S = tl.minimum(141 - e, 126)
    s = ((S + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - S) << 23).to(tl.float32, bitcast=True)
    return s, inv


@triton.jit
def _hi_lo(v):
    """v ≈ hi + lo in fp16 for |v| < 2^15: hi is v rounded to fp16, v − hi is exact in float32
    and is rounded once more, so the error is at most 2^-12·ulp(hi), 2^-22·|v| (or 2^-25 where
    v − hi falls below fp16's normal range)."""
    hi = v.to(tl.float16)
    return hi, (v - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _dot16(xh, xl, w, acc):
    """acc + (xh + xl)·wᵀ with float32 accumulation, the smaller term first. The fp16 products
    are exact (11 × 11 significant bits), so only the accumulation rounds."""
    if _INTERP:  # the interpreter's fp16 products are not trustworthy: the same terms in float32
        wt = tl.trans(w.to(tl.float32))
        acc = tl.dot(xl.to(tl.float32), wt, acc, input_precision="ieee")
        acc = tl.dot(xh.to(tl.float32), wt, acc, input_precision="ieee")
    else:
        wt = tl.trans(w)
        acc = tl.dot(xl, wt, acc)
        acc = tl.dot(xh, wt, acc)
    return acc


@triton.jit
def _f16_round(x):
    return x.to(tl.float16).to(tl.float32)


@triton.jit
def _swiglu(g, u, clamp):
    g = tl.minimum(g, clamp)
    u = tl.minimum(tl.maximum(u, -clamp), clamp)
    return g * _sigmoid(g) * u


# ------------------------------------------------------------------------------------------------
# the block decoder


@triton.jit
def _wtile(wb, wh, wf, gridp, ksigns, row_off, rmask, u0,
           TYPE: tl.constexpr, NB: tl.constexpr, VB: tl.constexpr):
    """Decode units [u0, u0+NB) of the rows at byte offsets row_off [BN] -> float32 [BN, NB, VB].
    The arithmetic follows ggml's order (see ds4.core.quants)."""
    ro = row_off[:, None, None]
    m = rmask[:, None, None]
    u = u0 + tl.arange(0, NB)[None, :, None]
    iv = tl.arange(0, VB)[None, None, :]
    if TYPE == 0:  # F32
        w = tl.load(wf + ro // 4 + u * VB + iv, mask=m, other=0.0)
    elif TYPE == 1:  # F16
        w = tl.load(wh + ro // 2 + u * VB + iv, mask=m, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    elif TYPE == 30:  # BF16: the top half of a float32
        b = tl.load(wh + ro // 2 + u * VB + iv, mask=m, other=0).to(tl.int32) & 0xFFFF
        w = (b << 16).to(tl.float32, bitcast=True)
    elif TYPE == 8:  # Q8_0: f16 d | int8 q[32]
        base = ro + u * 34
        d = _ld_f16(wh, base, m)
        q = tl.load(wb + base + 2 + iv, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = q * d
    elif TYPE == 80:  # Q8C: the values of block u in K order, gathered from their bytes
        so, qo = _q8c_block(ro, u)
        d = _ld_f16(wh, so, m)
        q = tl.load(wb + qo + (iv % 8) * 4 + iv // 8, mask=m, other=128).to(tl.int32)
        w = (q - 128).to(tl.float32) * d
    elif TYPE == 10:  # Q2_K in Q2S (layout.py): qs[64] | scales[16] | f16 d, dmin; unit = 16-value sub-block
        B = _q2_blk(ro) + u // 16
        s = u % 16
        sc = tl.load(wb + B * 16 + s, mask=m, other=0).to(tl.int32)
        d = _ld_f16(wh, B * 4, m)
        dmin = _ld_f16(wh, B * 4 + 2, m)
        # value v = 128h + 32·shift + l sits in quant byte 32h + l at bit 2·shift
        h = s // 8
        sh = (s % 8) // 2
        qo = B * 64 + h * 32 + (s % 2) * 16 + iv  # quant byte offset in the quant plane
        qb = tl.load(wf + qo // 4, mask=m, other=0) >> ((qo % 4) * 8)
        q = ((qb >> (sh * 2)) & 3).to(tl.float32)
        dl = d * (sc & 15).to(tl.float32)
        ml = dmin * (sc >> 4).to(tl.float32)
        w = dl * q - ml
    elif TYPE == 12:  # Q4_K: f16 d | f16 dmin | scales[12] | qs[128]; unit = 32-value sub-block
        blk = u // 8
        s = u % 8
        base = ro + blk * 144
        d = _ld_f16(wh, base, m)
        dmin = _ld_f16(wh, base + 2, m)
        s4 = s % 4
        b_sc = tl.load(wb + base + 4 + s4, mask=m, other=0).to(tl.int32)
        b_m = tl.load(wb + base + 8 + s4, mask=m, other=0).to(tl.int32)
        b_n = tl.load(wb + base + 12 + s4, mask=m, other=0).to(tl.int32)
        sc = tl.where(s < 4, b_sc & 63, (b_n & 15) | ((b_sc >> 6) << 4))
        mn = tl.where(s < 4, b_m & 63, (b_n >> 4) | ((b_m >> 6) << 4))
        qb = tl.load(wb + base + 16 + (s // 2) * 32 + iv, mask=m, other=0).to(tl.int32)
        q = ((qb >> ((s % 2) * 4)) & 15).to(tl.float32)
        w = (d * sc.to(tl.float32)) * q - dmin * mn.to(tl.float32)
    else:  # IQ2_XXS in IQ2S: 8 groups × (4 grid bytes, u32 signs+scale) a block; unit = one grid entry
        blk = _iq2_blk(ro) + u // 32
        gw = blk * 16 + ((u % 32) // 4) * 2
        sub = u % 4
        d = _ld_f16(wh, 2 * blk, m)
        aux = tl.load(wf + gw + 1, mask=m, other=0)
        db = d * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.25
        gi = (tl.load(wf + gw, mask=m, other=0) >> (8 * sub)) & 255
        gp = tl.load(gridp + gi)  # 8 two-bit level codes of grid entry gi
        ks = tl.load(ksigns + ((aux >> (7 * sub)) & 127))
        code = (gp >> (2 * iv)) & 3
        lvl = (8 + 17 * code + (code >> 1)).to(tl.float32)  # codes 0,1,2 -> 8, 25, 43
        mag = db * lvl
        w = tl.where(((ks >> iv) & 1) == 1, -mag, mag)
    return w


@triton.jit
def _wint(wb, wh, row_off, rmask, u, TYPE: tl.constexpr):
    """Q8_0 (TYPE 8) or Q8C (80) block u of the rows at byte offsets row_off [BN]: its quants as
    exact float32 integers [BN, 32] in K order and its scale [BN] (W = scale · q). Q8C's 32
    bytes load contiguously and are put in K order in registers ([word, byte] -> [byte, word]);
    gathered in K order from memory instead, they made a 2048-token prefill 1.5× slower
    (bench/triton/README.md)."""
    p = tl.arange(0, 32)[None, :]
    if TYPE == 80:
        so, qo = _q8c_block(row_off, u)
        qb = tl.load(wb + qo[:, None] + p, mask=rmask[:, None], other=128)
        BN: tl.constexpr = qb.shape[0]
        q = tl.reshape(tl.permute(tl.reshape(qb, [BN, 8, 4]), (0, 2, 1)), [BN, 32]).to(tl.int32)
        return _u8f(q) - 128.0, _ld_f16(wh, so, rmask)
    base = row_off + u * 34
    q = _s8f(tl.load(wb + base[:, None] + 2 + p, mask=rmask[:, None], other=0).to(tl.int32))
    return q, _ld_f16(wh, base, rmask)


@triton.jit
def _dot_units(x_ptr, sx_t, tm, mm, k0, wb, wh, row_off, rmask, acc, NU: tl.constexpr, TYPE: tl.constexpr):
    """acc[BM, BN] += x[tm, k0 : k0 + 32·NU] · Wᵀ over NU Q8_0 / Q8C blocks on bf16 tensor cores:
    the quants are exact in bf16 and x is split exactly into three bf16 terms (8 + 8 + 8
    significant bits), so each block's product has float32 accuracy before its scale is applied."""
    U: tl.constexpr = 32
    ku = tl.arange(0, U)
    for i in tl.static_range(NU):
        kb = k0 + i * U
        xt = tl.load(x_ptr + tm[:, None].to(tl.int64) * sx_t + kb + ku[None, :], mask=mm[:, None], other=0.0)
        q, sc = _wint(wb, wh, row_off, rmask, kb // U, TYPE)
        x1 = xt.to(tl.bfloat16)
        r1 = xt - x1.to(tl.float32)
        x2 = r1.to(tl.bfloat16)
        x3 = (r1 - x2.to(tl.float32)).to(tl.bfloat16)
        if _INTERP:  # the interpreter's bf16 products are wrong: the same terms in float32
            qt = tl.trans(q)
            p = tl.dot(x1.to(tl.float32), qt, input_precision="ieee")
            p = tl.dot(x2.to(tl.float32), qt, p, input_precision="ieee")
            p = tl.dot(x3.to(tl.float32), qt, p, input_precision="ieee")
        else:
            qt = tl.trans(q.to(tl.bfloat16))
            p = tl.dot(x3, qt)  # smallest first
            p = tl.dot(x2, qt, p)
            p = tl.dot(x1, qt, p)
        acc += p * sc[None, :]
    return acc


# ------------------------------------------------------------------------------------------------
# linear layers


@triton.jit
def _mv_step(xb, k0, wb, wh, wf, gridp, ksigns, row_off, rmask, rs, nw_ptr,
             TYPE: tl.constexpr, NB: tl.constexpr, VB: tl.constexpr, NORM: tl.constexpr):
    """One K-step of a matrix-vector product: W[rows, k0 : k0 + NB·VB] ⊙ x̂, as a tile whose sum
    is the step's contribution. 216 (IQ2_XXS) and 110 (Q2_K) unroll the values of a unit and
    return [BN, NB, 1]; the generic decoder (_wtile) returns [BN, NB, VB]."""
    if TYPE == 216:  # IQ2_XXS, one 32-value group per tile element, levels and signs as bytes
        u = k0 // 32 + tl.arange(0, NB)[None, :]  # group index in the row
        m = rmask[:, None]
        blk = _iq2_blk(row_off)[:, None] + u // 8  # IQ2S (layout.py)
        gw = blk * 16 + (u % 8) * 2
        d = _ld_f16(wh, 2 * blk, m)
        gq = tl.load(wf + gw, mask=m, other=0)
        aux = tl.load(wf + gw + 1, mask=m, other=0)
        db = d * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.25
        xu = xb + k0 + tl.arange(0, NB) * 32
        part = tl.zeros(d.shape, tl.float32)
        for sub in tl.static_range(4):
            gi = _iq2_grid_index(gq, sub)
            si = (aux >> (7 * sub)) & 127
            for h in tl.static_range(2):
                # 4 levels as int8 bytes, negated bytewise where the sign mask byte is 0xFF
                # (levels are >= 8, so ~v + 1 never carries into the next byte)
                lv = tl.load(gridp + 256 + 2 * gi + h)
                mk = tl.load(ksigns + 128 + 2 * si + h)
                sv = (lv ^ mk) + (mk & 0x01010101)
                for j in tl.static_range(4):
                    q = _s8f(sv >> (8 * j))
                    part += q * tl.load(xu + 8 * sub + 4 * h + j)[None, :]
        return (db * part)[:, :, None]
    elif TYPE == 110:  # Q2_K: 16 bytes (4 words) × 4 shifts = 64 values per tile element
        u = k0 // 64 + tl.arange(0, NB)[None, :]
        m = rmask[:, None]
        base, h, half, d, dmin, w0, w1, w2, w3 = _q2k_unit(wh, wf, row_off, m, u)
        u1 = k0 // 64 + tl.arange(0, NB)
        xk = xb + (u1 // 4) * 256 + ((u1 % 4) // 2) * 128 + (u1 % 2) * 16
        part = tl.zeros(d.shape, tl.float32)
        for sh in tl.static_range(4):
            sc = tl.load(wb + base + 8 * h + 2 * sh + half, mask=m, other=0).to(tl.int32)
            dl = d * (sc & 15).to(tl.float32)
            ml = dmin * (sc >> 4).to(tl.float32)
            acc_q = tl.zeros(d.shape, tl.float32)
            xs = tl.zeros([1, NB], tl.float32)
            for i4 in tl.static_range(4):
                if i4 == 0:
                    wd = w0
                elif i4 == 1:
                    wd = w1
                elif i4 == 2:
                    wd = w2
                else:
                    wd = w3
                xq = _ld4(xk + 32 * sh + 4 * i4)
                for i in tl.static_range(4):
                    q = _u8f((wd >> (8 * i + 2 * sh)) & 3)
                    xv = xq[i][None, :]
                    acc_q += q * xv
                    xs += xv
            part += dl * acc_q - ml * xs
        return part[:, :, None]
    else:
        kv = tl.arange(0, NB)[None, :, None] * VB + tl.arange(0, VB)[None, None, :]
        xv = tl.load(xb + k0 + kv)
        if NORM != 0:
            xv = xv / rs
            if NORM == 1:
                xv = xv * tl.load(nw_ptr + k0 + kv)
        return _wtile(wb, wh, wf, gridp, ksigns, row_off, rmask, k0 // VB, TYPE, NB, VB) * xv


@triton.jit
def _q2k_unit(wh, wf, row_off, m, u):
    """Q2_K 64-value units u [1, NB] of the rows at row_off (110, 111; Q2S): 16 quant bytes of one
    half (h) of a 128-value run, bytes [16·half, +16) of it, as 4 words, each shifted by 2·j
    holding 16 values of one 16-value run j. Returns (the block's first scale byte, h, half, d,
    dmin, the words)."""
    B = _q2_blk(row_off)[:, None] + u // 4
    h = (u % 4) // 2
    half = u % 2
    d = _ld_f16(wh, B * 4, m)
    dmin = _ld_f16(wh, B * 4 + 2, m)
    qw = B * 16 + h * 8 + half * 4
    w0 = tl.load(wf + qw, mask=m, other=0)
    w1 = tl.load(wf + qw + 1, mask=m, other=0)
    w2 = tl.load(wf + qw + 2, mask=m, other=0)
    w3 = tl.load(wf + qw + 3, mask=m, other=0)
    return B * 16, h, half, d, dmin, w0, w1, w2, w3


@triton.jit
def _b2f(qx, j: tl.constexpr):
    """Byte j of qx, a biased quant (value + 128), -> the value as float32 without an I2F: one
    byte permute builds 0x4B0000bb = 2^23 + byte, one subtraction removes 2^23 + 128."""
    if _INTERP:
        b = ((qx >> (8 * j)) & 0xFF) | 0x4B000000
    else:
        b = tl.inline_asm_elementwise(f"prmt.b32 $0, $1, 0x4B000000, {0x7440 + j};", "=r,r", [qx],
                                      dtype=tl.int32, is_pure=True, pack=1)
    return b.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _split4(v, BN: tl.constexpr):
    """[BN] -> four [BN/4] row sets (rows 4i, 4i+2, 4i+1, 4i+3): a thread holds one element of
    each, so values it loads once (x) serve four rows. _join4 is the inverse."""
    a, b = tl.split(tl.reshape(v, [BN // 4, 2, 2]))
    v0, v1 = tl.split(a)
    v2, v3 = tl.split(b)
    return v0, v1, v2, v3


@triton.jit
def _join4(y0, y1, y2, y3, BN: tl.constexpr):
    return tl.reshape(tl.join(tl.join(y0, y1), tl.join(y2, y3)), [BN])


@triton.jit
def _popc(v):
    """Set bits of each int32 (the interpreter: of its low 8 bits, all that the callers pass)."""
    if _INTERP:
        p = v & 255
        p = (p & 0x55) + ((p >> 1) & 0x55)
        p = (p & 0x33) + ((p >> 2) & 0x33)
        return (p & 0x0F) + (p >> 4)
    else:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)


_LVL_POS = tl.constexpr(0x00AB9988)  # bytes 128 + 8, 128 + 25, 128 + 43: the biased IQ2_XXS levels
_LVL_NEG = tl.constexpr(0x00556778)  # bytes 128 - 8, 128 - 25, 128 - 43 (codes 0, 1, 2)
_LVL_PRMT = tl.constexpr(f"{{ .reg .b32 a; mov.b32 a, {_LVL_POS.value:#010x}; "
                         f"prmt.b32 $0, a, {_LVL_NEG.value:#010x}, $1; }}")
_LVS_POS = tl.constexpr(0x002B1908)  # the levels 8, 25, 43 as signed bytes (decoder 418: dp4a operands)
_LVS_NEG = tl.constexpr(0x00D5E7F8)  # -8, -25, -43
_LVS_PRMT = tl.constexpr(f"{{ .reg .b32 a; mov.b32 a, {_LVS_POS.value:#010x}; "
                         f"prmt.b32 $0, a, {_LVS_NEG.value:#010x}, $1; }}")


@triton.jit
def _iq2_lut(sel, SIGNED: tl.constexpr = False):
    """Nibble i of sel (code | sign << 2) -> byte i = 128 + level, or 128 - level where signed:
    one byte permute over the 8 bytes of _LVL_POS (selectors 0-2) and _LVL_NEG (4-6). SIGNED:
    the level itself as a two's-complement byte (+level / -level), for _dp4a."""
    if _INTERP:
        out = sel & 0
        for i in tl.static_range(4):
            n = (sel >> (4 * i)) & 7
            if SIGNED:
                src = tl.where(n < 4, _LVS_POS, _LVS_NEG)
            else:
                src = tl.where(n < 4, _LVL_POS, _LVL_NEG)
            out = out | (((src >> (8 * (n & 3))) & 255) << (8 * i))
        return out
    elif SIGNED:
        return tl.inline_asm_elementwise(_LVS_PRMT, "=r,r", [sel], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_LVL_PRMT, "=r,r", [sel], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _dp4a(a, b, c):
    """c + Σ_j a_j·b_j over the four signed bytes of the int32 words a and b: one instruction
    for four products, exact in int32 (the routed decoders 418 / 111 with x in XQ form)."""
    if _INTERP:
        for j in tl.static_range(4):
            c += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
        return c
    else:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


# XQ: a vector in 32-value blocks of 16-bit fixed point for the integer decoders (418, 111). Block b
# has scale s_b = amax_b / 32639 and integers q = floor(x·(32639 / amax_b) + 0.5), split as
# q = 256·hi + lo with hi, lo signed bytes; its 16 words are, for each 8 values j = 0..3, the hi
# bytes of values 8j..8j+3 and 8j+4..8j+7, then their lo bytes (one 16-byte load per 8 values).
# Beside them: s_b, and s_b·Σq over each 16 values (the Q2_K minimum term). x is then exact to
# s_b / 2 = amax_b / 65278, where an f16 copy would be to 2^-11 of each value. XQ8 is the same
# with the 32 values of a block in the byte order of a Q8C block (word w: values w, w+8, w+16,
# w+24, its hi word at 4·(w // 2) + w % 2, its lo word 2 after it), so that one 16-byte load
# gives the x words of two Q8C quant words (decoder 309).
XQ_MAX = tl.constexpr(32639.0)  # 127·257: the largest q whose hi byte (q + 128) >> 8 is 127


@triton.jit
def _xq_words(v, PERM: tl.constexpr):
    """[NBLK, 32] signed bytes -> [NBLK, 8] words of 4: word w holds values 4w..4w+3, or with PERM
    values w, w+8, w+16, w+24 (the byte order of a Q8C block's word w)."""
    NBLK: tl.constexpr = v.shape[0]
    sh = tl.arange(0, 4)[None, None, :] * 8
    if PERM:
        g = tl.permute(tl.reshape(v, [NBLK, 4, 8]), (0, 2, 1))
    else:
        g = tl.reshape(v, [NBLK, 8, 4])
    return tl.sum((g & 255) << sh, axis=2)  # disjoint bytes: the sum of the shifted bytes is their OR


@triton.jit
def _xq_store(v, w_ptr, s_ptr, sum_ptr, blk0, bmask, PERM: tl.constexpr = False):
    """Blocks blk0 + [0, NBLK) of a vector, v [NBLK, 32] float, stored in XQ form (bmask [NBLK]:
    which blocks exist); PERM: in the Q8C byte order (XQ8, for decoder 309)."""
    NBLK: tl.constexpr = v.shape[0]
    amax = tl.max(tl.abs(v), axis=1)
    inv = tl.where(amax > 0, XQ_MAX / tl.where(amax > 0, amax, 1.0), 0.0)
    q = tl.floor(v * inv[:, None] + 0.5).to(tl.int32)
    hi = (q + 128) >> 8
    lo = q - hi * 256
    hw = _xq_words(hi, PERM)  # [NBLK, 8]
    lw = _xq_words(lo, PERM)
    b = blk0 + tl.arange(0, NBLK)
    w = tl.arange(0, 8)[None, :]
    off = b[:, None] * 16 + (w // 2) * 4 + (w % 2)
    tl.store(w_ptr + off, hw, mask=bmask[:, None])
    tl.store(w_ptr + off + 2, lw, mask=bmask[:, None])
    s = amax / XQ_MAX
    tl.store(s_ptr + b, s, mask=bmask)
    qs = tl.sum(tl.reshape(q, [NBLK, 2, 16]), axis=2).to(tl.float32) * s[:, None]
    tl.store(sum_ptr + b[:, None] * 2 + tl.arange(0, 2)[None, :], qs, mask=bmask[:, None])


@triton.jit
def xq_kernel(x_ptr, sx_t, w_ptr, s_ptr, sum_ptr, K, NBLK: tl.constexpr, PERM: tl.constexpr = False):
    """x [n, K] -> XQ, or XQ8 with PERM (K a multiple of 32): NBLK blocks of one token per program."""
    t = tl.program_id(0)
    b = tl.program_id(1) * NBLK + tl.arange(0, NBLK)
    bm = b < K // 32
    v = tl.load(x_ptr + t.to(tl.int64) * sx_t + b[:, None] * 32 + tl.arange(0, 32)[None, :], mask=bm[:, None],
                other=0.0)
    _xq_store(v, w_ptr + t * (K // 2), s_ptr + t * (K // 32), sum_ptr + t * (K // 16), tl.program_id(1) * NBLK, bm,
              PERM)


@triton.jit
def _iq2_sign_nibbles(s7):
    """The 8 signs of sign index s7 (the 8th is the parity of the 7) at bit 2 of 8 nibbles."""
    s8 = s7 | ((_popc(s7) & 1) << 7)
    p = (s8 | (s8 << 12)) & 0x000F000F
    q = (p | (p << 6)) & 0x03030303
    r = (q | (q << 3)) & 0x11111111
    return r << 2


@triton.jit
def _iq2_group_words(wh, wf, rb, m, u, ok=True):
    """For each of the four row sets (rb, m: tuples of [BN/4, 1] first-block indices / masks) the
    words of IQ2_XXS groups u [1, NB] in IQ2S (wf: quant words, wh: scales; layout.py): (grid
    indices 0-3, signs + scale, d·(0.5 + scale)/4, a zero partial sum). A group's two words come
    in one 8-byte load (where GGUF's 66-byte blocks took four 2-byte ones); nothing is read where
    ok is false."""
    gs = ()
    for r in tl.static_range(4):
        blk = rb[r] + u // 8
        mk = m[r] & ok
        d = _ld_f16(wh, 2 * blk, mk)
        g2 = tl.load(wf.to(tl.pointer_type(tl.int64)) + _opaque(blk * 8 + u % 8), mask=mk, other=0)
        gq = g2.to(tl.int32)
        aux = (g2 >> 32).to(tl.int32)
        db = d * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.25
        gs = gs + ((gq, aux, db, tl.zeros(d.shape, tl.float32)),)
    return gs


@triton.jit
def _lut16(tab, gis, NE: tl.constexpr):
    """tab[gi] for each of the 16 index tensors of the tuple gis (one shape, NE elements in all):
    one tl.gather, which goes through shared memory (the table stored once, two barriers), where
    16 calls would store it and wait 16 times. tl.join / tl.split stack and unstack them in
    registers, so the reshapes move no data."""
    a = ()
    for k in tl.static_range(8):
        a = a + (tl.join(gis[2 * k], gis[2 * k + 1]),)
    b = ()
    for k in tl.static_range(4):
        b = b + (tl.join(a[2 * k], a[2 * k + 1]),)
    d = tl.join(tl.join(b[0], b[1]), tl.join(b[2], b[3]))
    g = tl.reshape(tl.gather(tab, tl.reshape(d, [NE]), 0), d.shape)
    c0, c1 = tl.split(g)
    b = tl.split(c0) + tl.split(c1)
    a = ()
    for k in tl.static_range(4):
        a = a + tl.split(b[k])
    out = ()
    for k in tl.static_range(8):
        out = out + tl.split(a[k])
    return out


@triton.jit
def _iq2_grid_index(gq, sub: tl.constexpr):
    """Grid index of entry sub (0-3) of a group, from its grid-index word gq."""
    return (gq >> (8 * sub)) & 255


@triton.jit
def _iq2_levels_smem(gs, tab):
    """The level nibbles of the 16 grid entries of a K-step (entry sub of row set r at 4·sub + r)
    for the groups' words gs (_iq2_group_words), from the table tab in shared memory (_lut16)."""
    gis = ()
    for sub in tl.static_range(4):
        for r in tl.static_range(4):
            gis = gis + (_iq2_grid_index(gs[r][0], sub),)
    return _lut16(tab, gis, 16 * gs[0][0].shape[0] * gs[0][0].shape[1])


@triton.jit
def _iq2_group_step(xu, wh, wf, gridp, rb, m, u, tab, SMEM: tl.constexpr = False):
    """TYPE 416, one K-step: for each of the four row sets (rb, m: tuples of [BN/4, 1] first-block
    indices / masks) W·x over the 32-value IQ2_XXS groups u [1, NB]. Every x value is loaded
    once for the four rows. A grid entry's 8 level codes come as nibbles from one 4-byte lookup
    (gridp[768:1024]); its signs are computed (parity, then spread to bit 2 of each nibble), not
    looked up; one byte permute per 4 values gives the biased bytes 128 ± level (_iq2_lut) and
    _b2f the floats. (Looking up 8-byte levels and 8-byte sign masks instead, two gathers per entry
    and row, kept the L1 busy: 52.8 against 42.5 µs for the Flash routed gate/up,
    bench/triton/README.md.) SMEM (TYPE 417): the 16 lookups
    of the step come from the table in shared memory (tab, _lut16), not through the L1."""
    gs = _iq2_group_words(wh, wf, rb, m, u)
    if SMEM:
        sels = _iq2_levels_smem(gs, tab)
    for sub in tl.static_range(4):
        xs = _ld4(xu + 8 * sub) + _ld4(xu + 8 * sub + 4)
        nxt = ()
        for r in tl.static_range(4):
            gq, aux, db, part = gs[r]
            if SMEM:
                lv = sels[4 * sub + r]
            else:
                lv = tl.load(gridp + 768 + _iq2_grid_index(gq, sub))
            sel = lv | _iq2_sign_nibbles((aux >> (7 * sub)) & 127)
            for h in tl.static_range(2):
                qx = _iq2_lut(sel >> (16 * h))
                for j in tl.static_range(4):
                    part += _b2f(qx, j) * xs[4 * h + j]
            nxt = nxt + ((gq, aux, db, part),)
        gs = nxt
    return gs[0][2] * gs[0][3], gs[1][2] * gs[1][3], gs[2][2] * gs[2][3], gs[3][2] * gs[3][3]


@triton.jit
def _iq2_group_rows(xb, wh, wf, gridp, row_off, rmask, K, sk, BN: tl.constexpr, NB: tl.constexpr,
                    S: tl.constexpr, SMEM: tl.constexpr = False, xs=0, XQ: tl.constexpr = False,
                    PF: tl.constexpr = False):
    """TYPE 416 / 417 (SMEM) / 418 (XQ): W[rows]·x for IQ2_XXS rows (IQ2S: wf quant words, wh
    scales) over part sk of S of K, NB 32-value groups per K-step, four rows per thread. XQ: x in
    XQ form, xb its words and xs its block scales (an IQ2_XXS group and an XQ block are the same
    32 values). PF (with XQ): each step first issues the next step's group loads, then works on the
    ones the previous step issued (software pipelining by hand: a thread has two steps' weights in
    flight; alone 24.8 against 26.9 µs for the Flash routed gate/up, and 7.46 against 7.80 GPU ms
    a decode step, bench/triton/README.md)."""
    tab = 0
    if SMEM or XQ:  # the level table, loaded once (_lut16 stores it to shared memory per K-step)
        tab = tl.load(gridp + 768 + tl.arange(0, 256))
    o0, o1, o2, o3 = _split4(_iq2_blk(row_off), BN)
    m0, m1, m2, m3 = _split4(rmask, BN)
    ro = (o0[:, None], o1[:, None], o2[:, None], o3[:, None])  # first-block indices
    m = (m0[:, None], m1[:, None], m2[:, None], m3[:, None])
    a0 = tl.zeros([BN // 4, NB], tl.float32)
    a1 = tl.zeros([BN // 4, NB], tl.float32)
    a2 = tl.zeros([BN // 4, NB], tl.float32)
    a3 = tl.zeros([BN // 4, NB], tl.float32)
    IS = K // (NB * 32) // S
    i0 = sk * IS
    if PF:  # (with XQ)
        nxt = _iq2_group_words(wh, wf, ro, m, i0 * NB + tl.arange(0, NB)[None, :])
    for i in range(i0, i0 + IS):
        u = i * NB + tl.arange(0, NB)[None, :]
        if XQ:
            if PF:
                gs = nxt
                nxt = _iq2_group_words(wh, wf, ro, m, u + NB, i + 1 < i0 + IS)
            else:
                gs = _iq2_group_words(wh, wf, ro, m, u)
            p0, p1, p2, p3 = _iq2_int_step(xb + u * 16, gs, tab)
            sx = tl.load(xs + u)
            p0, p1, p2, p3 = p0 * sx, p1 * sx, p2 * sx, p3 * sx
        else:
            p0, p1, p2, p3 = _iq2_group_step(xb + u * 32, wh, wf, gridp, ro, m, u, tab, SMEM)
        a0 += p0
        a1 += p1
        a2 += p2
        a3 += p3
    return _join4(tl.sum(a0, axis=1), tl.sum(a1, axis=1), tl.sum(a2, axis=1), tl.sum(a3, axis=1), BN)


@triton.jit
def _iq2_int_step(xw, gs, tab):
    """TYPE 418, one K-step: for each of the four row sets (as _iq2_group_step) W·x over the
    step's IQ2_XXS groups (gs), x in XQ form (xw: each group's first word). Per group and row the
    levels become signed bytes (one permute per 4 values) and meet x's hi and lo bytes in _dp4a,
    exactly in int32; one float product per group takes the scales (d·(0.5 + scale)/4 here, x's
    by the caller). Where 416 / 417 spend a byte-to-float and an FMA per value, this spends half
    a dp4a. gs: the groups' words (_iq2_group_words)."""
    sels = _iq2_levels_smem(gs, tab)
    ah = ()
    al = ()
    for r in tl.static_range(4):
        ah = ah + (tl.zeros(gs[r][0].shape, tl.int32),)
        al = al + (tl.zeros(gs[r][0].shape, tl.int32),)
    for sub in tl.static_range(4):
        h0, h1, l0, l1 = _ld4(xw + 4 * sub, True)  # hi bytes of values 0-3, 4-7, then their lo bytes
        nh = ()
        nl = ()
        for r in tl.static_range(4):
            sel = sels[4 * sub + r] | _iq2_sign_nibbles((gs[r][1] >> (7 * sub)) & 127)
            q0 = _iq2_lut(sel, True)
            q1 = _iq2_lut(sel >> 16, True)
            nh = nh + (_dp4a(q1, h1, _dp4a(q0, h0, ah[r])),)
            nl = nl + (_dp4a(q1, l1, _dp4a(q0, l0, al[r])),)
        ah = nh
        al = nl
    out = ()
    for r in tl.static_range(4):
        out = out + (gs[r][2] * (ah[r] * 256 + al[r]).to(tl.float32),)
    return out


@triton.jit
def _q2k_int_rows(xw, xs, xsum, wb, wh, wf, row_off, rmask, K, sk, BN: tl.constexpr, NB: tl.constexpr,
                  S: tl.constexpr):
    """TYPE 111: W[rows]·x for Q2_K rows over part sk of S of K, x in XQ form, NB 64-value units
    (16 quant bytes × 4 shifts, as 110) per K-step. A shift of a unit's 4 quant words is 16 values
    of one 16-value run (one scale and minimum): 4 + 4 _dp4a give Σq·hi and Σq·lo exactly, and the
    run adds d·sc·s·(256·Σq·hi + Σq·lo) − dmin·m·Σx (Σx from XQ's 16-value sums)."""
    mk = rmask[:, None]
    acc = tl.zeros([BN, NB], tl.float32)
    IS = K // (NB * 64) // S
    for i in range(sk * IS, sk * IS + IS):
        u = i * NB + tl.arange(0, NB)[None, :]
        base, h, half, d, dmin, w0, w1, w2, w3 = _q2k_unit(wh, wf, row_off, mk, u)
        for sh in tl.static_range(4):
            b32 = (u // 4) * 8 + h * 4 + sh  # x's 32-value block; the run is its half `half`
            xo = xw + b32 * 16 + half * 8
            a0, a1, a2, a3 = _ld4(xo, True)  # hi, hi, lo, lo of values 0-7 of the run
            b0, b1, b2, b3 = _ld4(xo + 4, True)  # of values 8-15
            q0 = (w0 >> (2 * sh)) & 0x03030303
            q1 = (w1 >> (2 * sh)) & 0x03030303
            q2 = (w2 >> (2 * sh)) & 0x03030303
            q3 = (w3 >> (2 * sh)) & 0x03030303
            qh = _dp4a(q3, b1, _dp4a(q2, b0, _dp4a(q1, a1, _dp4a(q0, a0, tl.zeros(q0.shape, tl.int32)))))
            ql = _dp4a(q3, b3, _dp4a(q2, b2, _dp4a(q1, a3, _dp4a(q0, a2, tl.zeros(q0.shape, tl.int32)))))
            sc = tl.load(wb + base + 8 * h + 2 * sh + half, mask=mk, other=0).to(tl.int32)
            sx = tl.load(xs + b32)
            sm = tl.load(xsum + b32 * 2 + half)
            acc += (d * sx) * (sc & 15).to(tl.float32) * (qh * 256 + ql).to(tl.float32) - \
                (dmin * sm) * (sc >> 4).to(tl.float32)
    return tl.sum(acc, axis=1)


@triton.jit
def _q2s_half_words(wb, wh, wf, B, h):
    """The words of half h (values 128h .. 128h + 127) of Q2_K blocks B in Q2S (layout.py), for
    decoder 113: its 8 quant words (two 16-byte loads; word 4·half + i holds, at bits 2·sh of
    byte b, the value 128h + 32·sh + 16·half + 4i + b), its 8 scale bytes (sub-blocks 8h .. 8h + 7
    in one 8-byte load: sub-block 8h + 2·sh + half is byte 2·sh + half), and d, dmin. Loads
    without masks: B must be a block of the tensor."""
    qa0, qa1, qa2, qa3 = _ld4(wf + B * 16 + h * 8, True)
    qb0, qb1, qb2, qb3 = _ld4(wf + B * 16 + h * 8 + 4, True)
    s0, s1 = _ld2(wb.to(tl.pointer_type(tl.int32)) + B * 4 + h * 2)
    dd = tl.load(wh.to(tl.pointer_type(tl.int32)) + B)  # f16 d in the low half, f16 dmin in the high
    d = (dd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = (dd >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return (qa0, qa1, qa2, qa3), (qb0, qb1, qb2, qb3), (s0, s1), d, dmin


@triton.jit
def _q2s_half_x(xw, xs, xsum, b0):
    """x in XQ form for the halves whose first 32-value block is b0 (their four blocks are the
    four shifts): per shift and run, the words of its 16 values (hi, hi, lo, lo of values 0-7, then
    of values 8-15: two 16-byte loads), the 4 block scales (one 16-byte load) and the 8 16-value
    sums (two)."""
    xq = ()
    for sh in tl.static_range(4):
        for half in tl.static_range(2):
            xq = xq + (_ld4(xw + (b0 + sh) * 16 + half * 8, True) + _ld4(xw + (b0 + sh) * 16 + half * 8 + 4, True),)
    sx = _ld4(xs + b0)
    sm = _ld4(xsum + b0 * 2) + _ld4(xsum + b0 * 2 + 4)
    return xq, sx, sm


@triton.jit
def _q2s_half_dot(ws, xh, acc):
    """acc + one half of Q2_K blocks (ws, from _q2s_half_words) · x (xh, from _q2s_half_x). Per
    shift: the 16 values of each of the two runs meet x's hi and lo bytes in 4 + 4 _dp4a
    (Σq·(256·hi + lo) exactly in int32), the two runs' sums take their scales sc in int32, and the
    shift adds d·s·Σ sc·q·(256·hi + lo) − dmin·Σ m·(s·Σq over the run) (one int-to-float per 32
    values; past 2^24 that conversion rounds, to 2^-24 of the shift's sum)."""
    qa, qb, sw, d, dmin = ws
    xq, sx, sm = xh
    for sh in tl.static_range(4):
        scw = sw[sh // 2]
        iq = tl.zeros(d.shape, tl.int32)
        for half in tl.static_range(2):
            if half == 0:
                qw = qa
            else:
                qw = qb
            a0, a1, a2, a3, c0, c1, c2, c3 = xq[2 * sh + half]
            q0 = (qw[0] >> (2 * sh)) & 0x03030303
            q1 = (qw[1] >> (2 * sh)) & 0x03030303
            q2 = (qw[2] >> (2 * sh)) & 0x03030303
            q3 = (qw[3] >> (2 * sh)) & 0x03030303
            qh = _dp4a(q3, c1, _dp4a(q2, c0, _dp4a(q1, a1, _dp4a(q0, a0, tl.zeros(q0.shape, tl.int32)))))
            qhl = _dp4a(q3, c3, _dp4a(q2, c2, _dp4a(q1, a3, _dp4a(q0, a2, qh * 256))))
            sc = (scw >> (8 * (2 * (sh % 2) + half))) & 255
            iq += qhl * (sc & 15)
            acc -= (dmin * sm[2 * sh + half]) * _u8f(sc >> 4)
        acc += (d * sx[sh]) * iq.to(tl.float32)
    return acc


@triton.jit
def _q2s_slots(ids_ptr, t, hw_ptr, hs_ptr, hsum_ptr, wb, wh, wf, rows, rmask, F, RB, EXP_BYTES, sk,
               KSLOTS: tl.constexpr, BN: tl.constexpr, NH: tl.constexpr, R: tl.constexpr, IS: tl.constexpr):
    """TYPE 113: Σ_j down_{ids[t, j]}[rows]·h[t·KSLOTS + j] for Q2_K experts in Q2S (layout.py)
    over part sk of F (IS K-steps a part), h in XQ form. A tile element is one 128-value half of
    a block of R rows (R rows per thread share the loads of h), NH halves per K-step: per row, two
    16-byte loads of quant words, one 8-byte load of the half's 8 scales and one word of (d, dmin),
    where 110 / 111 on GGUF's 84-byte blocks took four word loads, a load per scale byte and two
    for d, dmin. The tile is [BN / R, NH], a warp's lanes along the halves of a row; the slots
    add into it, and it is reduced over the halves once at the end (a reduction per slot, with
    its layout conversions through shared memory: 12.1 against 10.5 µs for the routed down;
    lanes along rows instead, sharing each load of h: 14.9 at best; bench/triton/README.md).
    Each slot's weights are loaded before the slot before it computes, and the code has no loops
    (IS is a constexpr): a loop counted at run time took 17.3 against 14.6 µs. Rows past the
    tensor read the expert's first row."""
    rsel = tl.where(rmask, rows, 0).to(tl.int64) * RB
    es = ()
    for j in tl.static_range(KSLOTS):
        es = es + (tl.load(ids_ptr + t * KSLOTS + j).to(tl.int64),)
    acc = ()
    for r in tl.static_range(R):
        acc = acc + (tl.zeros([BN // R, NH], tl.float32),)
    for i in tl.static_range(IS):
        g = (sk * IS + i) * NH + tl.arange(0, NH)[None, :]  # half index in the row
        bb = g // 2
        h = g % 2
        wn = _q2s_slot_words(wb, wh, wf, es[0] * EXP_BYTES + rsel, bb, h, R)
        for j in tl.static_range(KSLOTS):
            ws = wn
            if j + 1 < KSLOTS:
                wn = _q2s_slot_words(wb, wh, wf, es[j + 1] * EXP_BYTES + rsel, bb, h, R)
            s = t * KSLOTS + j
            xh = _q2s_half_x(hw_ptr + s * (F // 2), hs_ptr + s * (F // 32), hsum_ptr + s * (F // 16), bb * 8 + h * 4)
            out = ()
            for r in tl.static_range(R):
                out = out + (_q2s_half_dot(ws[r], xh, acc[r]),)
            acc = out
    ys = ()
    for r in tl.static_range(R):
        ys = ys + (tl.sum(acc[r], axis=1),)
    return _row_join(ys, R, BN)


@triton.jit
def _q2s_slot_words(wb, wh, wf, row_off, bb, h, R: tl.constexpr):
    """_q2s_half_words of halves (bb, h) [1, NH] for each of the R row sets of the rows at GGUF
    byte offsets row_off [BN]."""
    BN: tl.constexpr = row_off.shape[0]
    rs = _row_sets(_q2_blk(row_off), R)
    ws = ()
    for r in tl.static_range(R):
        ws = ws + (_q2s_half_words(wb, wh, wf, tl.reshape(rs[r], [BN // R, 1]) + bb, h),)
    return ws


@triton.jit
def _row_sets(v, R: tl.constexpr):
    """[BN] -> a tuple of R row sets [BN/R, 1, 1, 1] (R = 1, 2, 4 or 8): a thread holds one row of
    each, so what it loads once (x) serves R rows. _row_join is the inverse."""
    BN: tl.constexpr = v.shape[0]
    if R == 8:
        a, b = tl.split(tl.reshape(v, [BN // 2, 2]))
        a0, a1, a2, a3 = _split4(a, BN // 2)
        b0, b1, b2, b3 = _split4(b, BN // 2)
        return (a0[:, None, None, None], a1[:, None, None, None], a2[:, None, None, None], a3[:, None, None, None],
                b0[:, None, None, None], b1[:, None, None, None], b2[:, None, None, None], b3[:, None, None, None])
    elif R == 4:
        v0, v1, v2, v3 = _split4(v, BN)
        return v0[:, None, None, None], v1[:, None, None, None], v2[:, None, None, None], v3[:, None, None, None]
    elif R == 2:
        v0, v1 = tl.split(tl.reshape(v, [BN // 2, 2]))
        return v0[:, None, None, None], v1[:, None, None, None]
    else:
        return (v[:, None, None, None],)


@triton.jit
def _row_join(ys, R: tl.constexpr, BN: tl.constexpr):
    if R == 8:
        a = _join4(ys[0], ys[1], ys[2], ys[3], BN // 2)
        b = _join4(ys[4], ys[5], ys[6], ys[7], BN // 2)
        return tl.reshape(tl.join(a, b), [BN])
    elif R == 4:
        return _join4(ys[0], ys[1], ys[2], ys[3], BN)
    elif R == 2:
        return tl.reshape(tl.join(ys[0], ys[1]), [BN])
    else:
        return ys[0]


@triton.jit
def _q8c_rows(xb, ww, wh, row_off, rmask, K, sk, rs, nw_ptr, BN: tl.constexpr, NC: tl.constexpr,
              R: tl.constexpr, NORM: tl.constexpr, S: tl.constexpr):
    """TYPE 308: W[rows]·x̂ for Q8C rows over part sk of S of K, NC 256-value chunks per K-step,
    R rows per thread. A step's tile is [rows, chunk, block, word] int32 (a chunk's 64 quant words
    are contiguous: 16-byte loads); byte j of every word meets x at 8j + w, a contiguous slice of
    x loaded once for the R rows; each word's 4 values become floats by _b2f (the bytes are
    already biased by 128) and its sum takes the block scale. Returns (W·x, Σ x² of the x values
    it loaded; with the norm fused and K whole, S = 1, that is all of x, once: _mv_rows)."""
    ro = _row_sets(tl.multiple_of(row_off // 4, 4), R)  # in words (rows start on 16 bytes)
    m = _row_sets(rmask, R)
    c = tl.arange(0, NC)[None, :, None, None]
    b = tl.arange(0, 8)[None, None, :, None]
    w = tl.arange(0, 8)[None, None, None, :]
    xo = c * 256 + b * 32 + w  # x of byte 0 of each word
    acc = ()
    for r in tl.static_range(R):
        acc = acc + (tl.zeros([BN // R, NC, 8, 8], tl.float32),)
    ssv = tl.zeros([1, NC, 8, 8], tl.float32)
    IS = K // (256 * NC) // S
    for i in range(sk * IS, sk * IS + IS):
        c0 = i * NC
        ws = ()
        for r in tl.static_range(R):
            ws = ws + (tl.load(ww + ro[r] + (c0 + c) * 68 + 4 + b * 8 + w, mask=m[r], other=0),)
        ps = ()
        for r in tl.static_range(R):
            ps = ps + (tl.zeros([BN // R, NC, 8, 8], tl.float32),)
        for j in tl.static_range(4):
            xv = tl.load(xb + c0 * 256 + xo + 8 * j)
            if NORM != 0 and S == 1:
                ssv += xv * xv
            elif NORM != 0:
                xv = xv / rs
            if NORM == 1:
                xv = xv * tl.load(nw_ptr + c0 * 256 + xo + 8 * j)
            nps = ()
            for r in tl.static_range(R):
                nps = nps + (ps[r] + _b2f(ws[r], j) * xv,)
            ps = nps
        nacc = ()
        for r in tl.static_range(R):
            d = tl.load(wh + ro[r] * 2 + (c0 + c) * 136 + b, mask=m[r], other=0).to(tl.float16, bitcast=True)
            nacc = nacc + (acc[r] + ps[r] * d.to(tl.float32),)
        acc = nacc
    ys = ()
    for r in tl.static_range(R):
        ys = ys + (tl.sum(tl.sum(tl.sum(acc[r], axis=3), axis=2), axis=1),)
    return _row_join(ys, R, BN), tl.sum(ssv)


@triton.jit
def _pdl_wait():
    """griddepcontrol.wait: the kernel ahead on the stream has finished and its writes are
    visible. Returns 0 for the caller to add to the addresses of what that kernel wrote, so that
    LLVM does not schedule pure inline-assembly loads (_ld4) above the wait; ptxas sees the 0,
    so those loads must also be coherent ones (_ld4 NC=False): it keeps those below the wait
    (tests/test_triton_kernels.py::test_early_launch_loads_x_after_its_wait)."""
    return tl.inline_asm_elementwise("griddepcontrol.wait;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _q8c_xq_q2(w64, ro, m, c0, c, b, p, r: tl.constexpr):
    """TYPE 309, one K-step's quant word pairs of row set r."""
    return tl.load(w64 + ro[r] // 2 + (c0 + c) * 34 + 2 + b * 4 + p, mask=m[r], other=0)


@triton.jit
def _q8c_xq_d(wh, ro, m, c0, c, b, r: tl.constexpr):
    """TYPE 309, one K-step's block scales (f16 bits) of row set r."""
    return tl.load(wh + ro[r] * 2 + (c0 + c) * 136 + b, mask=m[r], other=0)


@triton.jit
def _q8c_xq_step(acc, xw, xs, w64, wh, ro, m, pre, c0, c, b, p, R: tl.constexpr, NC: tl.constexpr,
                 PRE: tl.constexpr):
    """TYPE 309, one K-step: the accumulators plus the blocks' scaled integer dot products with
    x. PRE: the step's weights are `pre` (per row set its quant word pairs and scales, loaded
    before x), else each row set's are loaded after x. NC: x through the non-coherent path (_ld4)."""
    blk = (c0 + c) * 8 + b  # x's 32-value block
    h0, h1, l0, l1 = _ld4(xw + blk * 16 + p * 4, True, NC)
    sx = tl.load(xs + blk)
    nacc = ()
    for r in tl.static_range(R):
        if PRE:
            q2 = pre[r][0]
        else:
            q2 = _q8c_xq_q2(w64, ro, m, c0, c, b, p, r)
        qa = q2.to(tl.int32) ^ -2139062144  # 0x80808080: biased bytes -> signed
        qb = (q2 >> 32).to(tl.int32) ^ -2139062144
        z = tl.zeros(qa.shape, tl.int32)
        hs = _dp4a(qb, h1, _dp4a(qa, h0, z))
        ls = _dp4a(qb, l1, _dp4a(qa, l0, z))
        if PRE:
            d = pre[r][1]
        else:
            d = _q8c_xq_d(wh, ro, m, c0, c, b, r)
        d = d.to(tl.float16, bitcast=True)
        nacc = nacc + (acc[r] + (hs * 256 + ls).to(tl.float32) * (d.to(tl.float32) * sx),)
    return nacc


@triton.jit
def _q8c_xq_rows(xw, xs, wf, wh, row_off, rmask, K, sk, BN: tl.constexpr, NC: tl.constexpr, R: tl.constexpr,
                 S: tl.constexpr, PDL: tl.constexpr = False):
    """TYPE 309: W[rows]·x for Q8C rows on x in XQ8 form (xw: its words, xs: its block scales)
    over part sk of S of K, NC 256-value chunks per K-step, R rows per thread. A tile element is
    a pair of a block's quant words (one 8-byte load per row) and the four x words they meet (one
    16-byte load for the R rows): a quant byte q + 128 becomes q by one XOR per word, and the
    block's partial sum is four integer dot products (hi and lo bytes of x), exact in int32,
    scaled once by d·s. Where 308 loads x as floats (4 bytes a value), this loads 2.
    PDL (a launch that may start before the kernel ahead of it on its stream ends): the first
    K-step's weights are loaded, then the program waits for that kernel (griddepcontrol.wait)
    before it reads x, so the loads overlap that kernel's tail instead of following it."""
    ro = _row_sets(tl.multiple_of(row_off // 4, 4), R)  # in words (rows start on 16 bytes)
    m = _row_sets(rmask, R)
    c = tl.arange(0, NC)[None, :, None, None]
    b = tl.arange(0, 8)[None, None, :, None]
    p = tl.arange(0, 4)[None, None, None, :]  # the quant word pair 2p, 2p + 1 of block b
    w64 = wf.to(tl.pointer_type(tl.int64))
    acc = ()
    for r in tl.static_range(R):
        acc = acc + (tl.zeros([BN // R, NC, 8, 4], tl.float32),)
    IS = K // (256 * NC) // S
    i0 = sk * IS
    i1 = i0
    if PDL:
        pre = ()
        for r in tl.static_range(R):
            pre = pre + ((_q8c_xq_q2(w64, ro, m, i0 * NC, c, b, p, r), _q8c_xq_d(wh, ro, m, i0 * NC, c, b, r)),)
        z0 = _pdl_wait()
        xw += z0
        xs += z0
        acc = _q8c_xq_step(acc, xw, xs, w64, wh, ro, m, pre, i0 * NC, c, b, p, R, False, True)
        i1 = i0 + 1
    for i in range(i1, i0 + IS):
        acc = _q8c_xq_step(acc, xw, xs, w64, wh, ro, m, (), i * NC, c, b, p, R, not PDL, False)
    ys = ()
    for r in tl.static_range(R):
        ys = ys + (tl.sum(tl.sum(tl.sum(acc[r], axis=3), axis=2), axis=1),)
    return _row_join(ys, R, BN)


@triton.jit
def matvec_xq_kernel(xw_ptr, xs_ptr, sx_t, sx_g, wh, wf, out_ptr, so_t, ws_ptr, cnt_ptr, N, K, RB, GROUP_ROWS,
                     qw_ptr, qs_ptr, qsum_ptr,
                     BN: tl.constexpr, NB: tl.constexpr, R: tl.constexpr, S: tl.constexpr = 1,
                     XQOUT: tl.constexpr = False, PDL: tl.constexpr = False, DEP: tl.constexpr = False):
    """matvec_kernel for Q8C rows on x in XQ8 form (decoder 309): out[t, r] = W[r] · x[t], K split
    in S parts as there. sx_t, sx_g (values, multiples of 32): x's token stride and the column
    offset of each group of GROUP_ROWS rows. XQOUT (S = 1, N a multiple of 32): out also in XQ8
    form (qw_ptr, qs_ptr, qsum_ptr), for the next product's 309 without a launch of its own: a
    program of 32 rows or more stores its blocks, else the last of a block's 32 / BN programs to
    arrive (a ticket, as in _split_store) reads the block back from L2 and stores it.
    PDL: launched to start before the kernel ahead of it ends (_q8c_xq_rows); DEP: the kernel
    after it may launch once every program of this one has started (gdc_launch_dependents)."""
    if DEP:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    t = tl.program_id(1)
    sk = tl.program_id(2)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    xo = t * sx_t + ((pid * BN) // GROUP_ROWS) * sx_g
    y = _q8c_xq_rows(xw_ptr + xo // 2, xs_ptr + xo // 32, wf, wh, rows.to(tl.int64) * RB, rmask, K, sk, BN, NB, R, S,
                     PDL)
    _split_store(y, out_ptr + t * so_t, rows, rmask, ws_ptr + t * S * N, cnt_ptr, t * tl.num_programs(0) + pid,
                 sk, N, S)
    if XQOUT:
        qw, qs, qsum = qw_ptr + t * (N // 2), qs_ptr + t * (N // 32), qsum_ptr + t * (N // 16)
        if BN >= 32:
            b = (pid * BN) // 32 + tl.arange(0, BN // 32)
            _xq_store(tl.reshape(y, [BN // 32, 32]), qw, qs, qsum, (pid * BN) // 32, b < N // 32, True)
        else:
            blk = (pid * BN) // 32
            if _split_last(cnt_ptr, t * (N // 32) + blk, 32 // BN):
                v = tl.load(out_ptr + t * so_t + blk * 32 + tl.arange(0, 32), cache_modifier=".cg")
                _xq_store(tl.reshape(v, [1, 32]), qw, qs, qsum, blk, tl.arange(0, 1) < 1, True)
                _split_reset(cnt_ptr, t * (N // 32) + blk)


@triton.jit
def _mv_rows(xb, wb, wh, wf, gridp, ksigns, row_off, rmask, K, sk, rs, nw_ptr, eps,
             BN: tl.constexpr, TYPE: tl.constexpr, NB: tl.constexpr, VB: tl.constexpr,
             VA: tl.constexpr, NORM: tl.constexpr, S: tl.constexpr = 1):
    """W[rows] · x̂ for BN rows over part sk of S equal parts of K: the K loop of every
    matrix-vector kernel (308: VA is the rows per thread, NB the chunks per K-step). NORM with
    S = 1: the norm's scale comes from the x values the loop loads (rs unused); with S > 1 the
    caller passes it (matvec_kernel's prologue: a program then sees only part of x)."""
    if TYPE == 416 or TYPE == 417:  # no fused norm (nor in 216, 110: _mv_cfg picks the generic one then)
        y = _iq2_group_rows(xb, wh, wf, gridp, row_off, rmask, K, sk, BN, NB, S, TYPE == 417)
    elif TYPE == 308:
        y, ss = _q8c_rows(xb, wf, wh, row_off, rmask, K, sk, rs, nw_ptr, BN, NB, VA, NORM, S)
    else:
        BK: tl.constexpr = NB * VB
        IS = K // BK // S
        acc = tl.zeros([BN, NB, VA], tl.float32)
        ssv = tl.zeros([1, NB, VB], tl.float32)
        kv = tl.arange(0, NB)[None, :, None] * VB + tl.arange(0, VB)[None, None, :]
        for i in range(sk * IS, sk * IS + IS):
            if NORM != 0 and S == 1:  # (the step's x again, from L1: _mv_step loads it too)
                xr = tl.load(xb + i * BK + kv)
                ssv += xr * xr
            acc += _mv_step(xb, i * BK, wb, wh, wf, gridp, ksigns, row_off, rmask, rs, nw_ptr, TYPE, NB, VB, NORM)
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        ss = tl.sum(ssv)
    if NORM != 0 and S == 1:
        y = y / tl.sqrt_rn(ss / K + eps)
    return y


@triton.jit
def _split_store(y, out_ptr, rows, rmask, ws_ptr, cnt_ptr, tile, sk, N, S: tl.constexpr):
    """Store y [BN] (rows of one output tile) or, with K split in S parts (grid axis 2 = sk), its
    part: each program writes its partial sum to the workspace (ws_ptr: this token's [S, N]), and
    the tile's last program to arrive (a ticket from an acq_rel counter) adds the S partials in the
    order 0..S−1, so the result does not depend on the order the programs ran in, and resets the
    counter for the next launch."""
    if S == 1:
        tl.store(out_ptr + rows, y, mask=rmask)
    else:
        tl.store(ws_ptr + sk * N + rows, y, mask=rmask)
        if _split_last(cnt_ptr, tile, S):
            tl.store(out_ptr + rows, _split_sum(ws_ptr, rows, rmask, N, S), mask=rmask)
            _split_reset(cnt_ptr, tile)


@triton.jit
def _split_last(cnt_ptr, tile, S: tl.constexpr):
    """Whether this program is the last of the tile's S to arrive, once its partials are stored."""
    tl.debug_barrier()  # every thread's partial is written before the ticket is taken
    return tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == S - 1


@triton.jit
def _split_sum(ws_ptr, rows, rmask, stride, S: tl.constexpr):
    """The S partials at ws_ptr + j·stride, added in the order j = 0..S−1 (read from L2: other
    SMs wrote them)."""
    tot = tl.zeros(rows.shape, tl.float32)
    for j in tl.static_range(S):
        tot += tl.load(ws_ptr + j * stride + rows, mask=rmask, other=0.0, cache_modifier=".cg")
    return tot


@triton.jit
def _split_reset(cnt_ptr, tile):
    tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def matvec_kernel(x_ptr, sx_t, sx_g, nw_ptr, wb, wh, wf, gridp, ksigns, out_ptr, so_t, ws_ptr, cnt_ptr,
                  N, K, RB, GROUP_ROWS, eps,
                  TYPE: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, VB: tl.constexpr,
                  VA: tl.constexpr, NORM: tl.constexpr, S: tl.constexpr = 1):
    """out[t, r] = W[r] · x̂[t] for a few tokens t (grid axis 1), K split in S parts (grid axis
    2, _split_store) where the rows alone make too few programs to keep enough bytes in flight.
    NORM 1/2 applies the weighted / unweighted RMSNorm to x first: each program works out the
    scale itself (x is small, the weight is not), from the x values its K loop loads when it has
    the whole of K, else in a prologue over all of x. Either way every program redoes that work
    on x, so where the programs together would read x 2^22 times over the backend normalises x
    once first instead (norm_fuse_max). Rows r of group g = r // GROUP_ROWS read x at column
    offset g·sx_g (grouped projections)."""
    pid = tl.program_id(0)
    t = tl.program_id(1)
    sk = tl.program_id(2)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    row_off = rows.to(tl.int64) * RB
    xb = x_ptr + t * sx_t + ((pid * BN) // GROUP_ROWS) * sx_g
    rs = 1.0
    if NORM != 0 and S > 1:  # 2048 values per step: a few independent loads, not one per K-step
        kv = tl.arange(0, 2048)
        ss = tl.zeros([2048], tl.float32)
        for k0 in range(0, K, 2048):
            xv = tl.load(xb + k0 + kv, mask=k0 + kv < K, other=0.0)
            ss += xv * xv
        rs = tl.sqrt_rn(tl.sum(ss) / K + eps)
    y = _mv_rows(xb, wb, wh, wf, gridp, ksigns, row_off, rmask, K, sk, rs, nw_ptr, eps, BN, TYPE, NB, VB, VA, NORM, S)
    _split_store(y, out_ptr + t * so_t, rows, rmask, ws_ptr + t * S * N, cnt_ptr, t * tl.num_programs(0) + pid,
                 sk, N, S)


@triton.jit
def _mm_rows(x_ptr, sx_t, tm, mm, K, wb, wh, wf, gridp, ksigns, row_off, rmask,
             BM: tl.constexpr, BN: tl.constexpr, TYPE: tl.constexpr, NB: tl.constexpr,
             VB: tl.constexpr, PREC: tl.constexpr, U: tl.constexpr):
    """x[tm, :K] · W[rows]ᵀ -> [BM, BN]: the K loop of the matrix-matrix kernels (gate/up keeps
    its own, which shares each x tile between the two weights)."""
    acc = tl.zeros([BM, BN], tl.float32)
    if U > 0:
        for k0 in range(0, K, NB * U):
            acc = _dot_units(x_ptr, sx_t, tm, mm, k0, wb, wh, row_off, rmask, acc, NB, TYPE)
    else:
        BK: tl.constexpr = NB * VB
        kk = tl.arange(0, BK)
        for k0 in range(0, K, BK):
            xt = tl.load(x_ptr + tm[:, None].to(tl.int64) * sx_t + k0 + kk[None, :], mask=mm[:, None], other=0.0)
            w = tl.reshape(_wtile(wb, wh, wf, gridp, ksigns, row_off, rmask, k0 // VB, TYPE, NB, VB), [BN, BK])
            acc = tl.dot(xt, tl.trans(w), acc, input_precision=PREC)
    return acc


@triton.jit
def matmul_kernel(x_ptr, sx_t, sx_g, wb, wh, wf, gridp, ksigns, out_ptr, so_t,
                  M, N, K, RB, GROUP_ROWS,
                  TYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                  VB: tl.constexpr, PREC: tl.constexpr, U: tl.constexpr = 0):
    """out[M, N] = x[M, K] · W[N, K]ᵀ with W decoded tile by tile (prefill). U > 0: Q8_0 blocks
    as integers on bf16 tensor cores (_dot_units), NB blocks per K-step."""
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    tm = pm * BM + tl.arange(0, BM)
    mm = tm < M
    rows = pn * BN + tl.arange(0, BN)
    rmask = rows < N
    row_off = rows.to(tl.int64) * RB
    xb = x_ptr + ((pn * BN) // GROUP_ROWS) * sx_g
    acc = _mm_rows(xb, sx_t, tm, mm, K, wb, wh, wf, gridp, ksigns, row_off, rmask, BM, BN, TYPE, NB, VB, PREC, U)
    tl.store(out_ptr + tm[:, None].to(tl.int64) * so_t + rows[None, :], acc,
             mask=mm[:, None] & rmask[None, :])


# ------------------------------------------------------------------------------------------------
# routed and shared experts


@triton.jit
def moe_gateup_mv_kernel(x_ptr, sx_t, ids_ptr, wts_ptr,
                         gb, gh, gf, ub, uh, uf, gridp, ksigns, h_ptr, ws_ptr, cnt_ptr,
                         xw_ptr, xs_ptr, hw_ptr, hs_ptr, hsum_ptr,
                         F, K, RB, EXP_BYTES, KSLOTS, clamp,
                         TYPE: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, VB: tl.constexpr,
                         VA: tl.constexpr, ROUTED: tl.constexpr, S: tl.constexpr = 1,
                         QOUT: tl.constexpr = False, PF: tl.constexpr = False):
    """h[s, r] = w_s · swiglu(gate_e[r]·x, up_e[r]·x) for slot s = t·KSLOTS + j of expert
    e = ids[s] (ROUTED), or the shared expert (e = 0, no weight); K split in S parts as in
    matvec_kernel (the last program of a tile adds the partial gate and up sums, then applies
    the SwiGLU). TYPE 418 reads x in XQ form (xw_ptr, xs_ptr: [n, K/2] words, [n, K/32] scales),
    309 (Q8C, the shared expert) in XQ8 form;
    QOUT also stores h in XQ form (hw_ptr, hs_ptr, hsum_ptr) for the down decoder 111: a tile's
    BN rows (a multiple of 32) are whole blocks. PF: 418 issues each K-step's group loads one step
    ahead (_iq2_group_rows)."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    sk = tl.program_id(2)
    t = s // KSLOTS
    if ROUTED:
        e = tl.load(ids_ptr + s).to(tl.int64)
    else:
        e = 0
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < F
    row_off = e * EXP_BYTES + rows.to(tl.int64) * RB
    xb = x_ptr + t * sx_t
    if TYPE == 418:
        xw = xw_ptr + t * (K // 2)
        xs = xs_ptr + t * (K // 32)
        g = _iq2_group_rows(xw, gh, gf, gridp, row_off, rmask, K, sk, BN, NB, S, False, xs, True, PF)
        u = _iq2_group_rows(xw, uh, uf, gridp, row_off, rmask, K, sk, BN, NB, S, False, xs, True, PF)
    elif TYPE == 309:
        xw = xw_ptr + t * (K // 2)
        xs = xs_ptr + t * (K // 32)
        g = _q8c_xq_rows(xw, xs, gf, gh, row_off, rmask, K, sk, BN, NB, VA, S)
        u = _q8c_xq_rows(xw, xs, uf, uh, row_off, rmask, K, sk, BN, NB, VA, S)
    else:
        g = _mv_rows(xb, gb, gh, gf, gridp, ksigns, row_off, rmask, K, sk, 1.0, xb, 0.0, BN, TYPE, NB, VB, VA, 0, S)
        u = _mv_rows(xb, ub, uh, uf, gridp, ksigns, row_off, rmask, K, sk, 1.0, xb, 0.0, BN, TYPE, NB, VB, VA, 0, S)
    done = True
    if S > 1:  # partial sums to this slot's [S, 2, F] workspace; the tile's last program goes on
        wsl = ws_ptr + s * (S * 2 * F)
        tl.store(wsl + sk * 2 * F + rows, g, mask=rmask)
        tl.store(wsl + sk * 2 * F + F + rows, u, mask=rmask)
        tile = s * tl.num_programs(0) + pid
        done = _split_last(cnt_ptr, tile, S)
        if done:
            g = _split_sum(wsl, rows, rmask, 2 * F, S)
            u = _split_sum(wsl + F, rows, rmask, 2 * F, S)
            _split_reset(cnt_ptr, tile)
    if done:
        h = _swiglu(g, u, clamp)
        if ROUTED:
            h = h * tl.load(wts_ptr + s)
        tl.store(h_ptr + s * F + rows, h, mask=rmask)
        if QOUT:
            NBLK: tl.constexpr = BN // 32
            b0 = pid * NBLK
            _xq_store(tl.reshape(h, [NBLK, 32]), hw_ptr + s * (F // 2), hs_ptr + s * (F // 32),
                      hsum_ptr + s * (F // 16), b0, b0 + tl.arange(0, NBLK) < F // 32)


@triton.jit
def moe_down_mv_kernel(h_ptr, ids_ptr, db, dh, df, gridp, ksigns, out_ptr, ws_ptr, cnt_ptr,
                       hw_ptr, hs_ptr, hsum_ptr, E, F, RB, EXP_BYTES,
                       KSLOTS: tl.constexpr, TYPE: tl.constexpr, BN: tl.constexpr,
                       NB: tl.constexpr, VB: tl.constexpr, VA: tl.constexpr, S: tl.constexpr = 1,
                       IS: tl.constexpr = 1):
    """out[t, r] = Σ_j down_{ids[t,j]}[r] · h[t·KSLOTS + j], summed in slot order (113: the slots
    add per tile element, then the halves); F split in S parts as in matvec_kernel. TYPEs 111 and
    113 read h in XQ form (hw_ptr, hs_ptr, hsum_ptr); 113 takes NB 128-value halves per K-step, VA
    rows per thread and IS K-steps per part (_q2s_slots)."""
    pid = tl.program_id(0)
    t = tl.program_id(1)
    sk = tl.program_id(2)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < E
    out = tl.zeros([BN], tl.float32)
    if TYPE == 113:
        out = _q2s_slots(ids_ptr, t, hw_ptr, hs_ptr, hsum_ptr, db, dh, df, rows, rmask, F, RB, EXP_BYTES, sk,
                         KSLOTS, BN, NB, VA, IS)
    else:
        for j in tl.static_range(KSLOTS):
            s = t * KSLOTS + j
            e = tl.load(ids_ptr + s).to(tl.int64)
            row_off = e * EXP_BYTES + rows.to(tl.int64) * RB
            hb = h_ptr + s * F
            if TYPE == 111:
                out += _q2k_int_rows(hw_ptr + s * (F // 2), hs_ptr + s * (F // 32), hsum_ptr + s * (F // 16),
                                     db, dh, df, row_off, rmask, F, sk, BN, NB, S)
            else:
                out += _mv_rows(hb, db, dh, df, gridp, ksigns, row_off, rmask, F, sk, 1.0, hb, 0.0, BN, TYPE, NB,
                                VB, VA, 0, S)
    _split_store(out, out_ptr + t * E, rows, rmask, ws_ptr + t * S * E, cnt_ptr, t * tl.num_programs(0) + pid,
                 sk, E, S)


@triton.jit
def moe_gateup_mm_kernel(x_ptr, sx_t, tok_ptr, wts_ptr, tile_e_ptr, tile_r0_ptr, tile_end_ptr,
                         gb, gh, gf, ub, uh, uf, gridp, ksigns, h_ptr,
                         F, K, RB, EXP_BYTES, clamp,
                         TYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                         VB: tl.constexpr, ROUTED: tl.constexpr, PREC: tl.constexpr, U: tl.constexpr = 0):
    """Prefill: one tile of BM assignments (token, slot) of one expert, sorted by expert.
    h[a, r] = w_a · swiglu(gate_e[r]·x[tok_a], up_e[r]·x[tok_a])."""
    tile = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(tile_e_ptr + tile)
    if e >= 0:
        r0 = tl.load(tile_r0_ptr + tile)
        rend = tl.load(tile_end_ptr + tile)
        a = r0 + tl.arange(0, BM)
        am = a < rend
        if ROUTED:
            tok = tl.load(tok_ptr + a, mask=am, other=0).to(tl.int64)
        else:
            tok = a.to(tl.int64)
        rows = pn * BN + tl.arange(0, BN)
        rmask = rows < F
        row_off = e.to(tl.int64) * EXP_BYTES + rows.to(tl.int64) * RB
        BK: tl.constexpr = NB * VB
        kk = tl.arange(0, BK)
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        if U > 0:
            for k0 in range(0, K, NB * U):
                acc_g = _dot_units(x_ptr, sx_t, tok, am, k0, gb, gh, row_off, rmask, acc_g, NB, TYPE)
                acc_u = _dot_units(x_ptr, sx_t, tok, am, k0, ub, uh, row_off, rmask, acc_u, NB, TYPE)
        else:
            for k0 in range(0, K, BK):
                xt = tl.load(x_ptr + tok[:, None] * sx_t + k0 + kk[None, :], mask=am[:, None], other=0.0)
                wg = tl.reshape(_wtile(gb, gh, gf, gridp, ksigns, row_off, rmask, k0 // VB, TYPE, NB, VB), [BN, BK])
                acc_g = tl.dot(xt, tl.trans(wg), acc_g, input_precision=PREC)
                wu = tl.reshape(_wtile(ub, uh, uf, gridp, ksigns, row_off, rmask, k0 // VB, TYPE, NB, VB), [BN, BK])
                acc_u = tl.dot(xt, tl.trans(wu), acc_u, input_precision=PREC)
        h = _swiglu(acc_g, acc_u, clamp)
        if ROUTED:
            h = h * tl.load(wts_ptr + a, mask=am, other=0.0)[:, None]
        tl.store(h_ptr + a[:, None].to(tl.int64) * F + rows[None, :], h, mask=am[:, None] & rmask[None, :])


@triton.jit
def moe_down_mm_kernel(h_ptr, tile_e_ptr, tile_r0_ptr, tile_end_ptr, db, dh, df, gridp, ksigns, out_ptr,
                       E, F, RB, EXP_BYTES,
                       TYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                       VB: tl.constexpr, PREC: tl.constexpr, U: tl.constexpr = 0):
    """Prefill: out_sorted[a, r] = down_e[r] · h[a] for one tile of expert e's assignments."""
    tile = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(tile_e_ptr + tile)
    if e >= 0:
        r0 = tl.load(tile_r0_ptr + tile)
        rend = tl.load(tile_end_ptr + tile)
        a = r0 + tl.arange(0, BM)
        am = a < rend
        rows = pn * BN + tl.arange(0, BN)
        rmask = rows < E
        row_off = e.to(tl.int64) * EXP_BYTES + rows.to(tl.int64) * RB
        acc = _mm_rows(h_ptr, F, a, am, F, db, dh, df, gridp, ksigns, row_off, rmask, BM, BN, TYPE, NB, VB, PREC, U)
        tl.store(out_ptr + a[:, None].to(tl.int64) * E + rows[None, :], acc, mask=am[:, None] & rmask[None, :])


@triton.jit
def moe_reduce_kernel(src_ptr, inv_ptr, out_ptr, E, KSLOTS: tl.constexpr, BE: tl.constexpr):
    """out[t] = Σ_j src[inv[t·KSLOTS + j]] in slot order (the reference's summation order)."""
    t = tl.program_id(0)
    eb = tl.program_id(1)
    c = eb * BE + tl.arange(0, BE)
    cm = c < E
    acc = tl.zeros([BE], tl.float32)
    for j in tl.static_range(KSLOTS):
        r = tl.load(inv_ptr + t * KSLOTS + j).to(tl.int64)
        acc += tl.load(src_ptr + r * E + c, mask=cm, other=0.0)
    tl.store(out_ptr + t * E + c, acc, mask=cm)


@triton.jit
def router_kernel(logit_ptr, NE, bias_ptr, tid_ptr, tok_ptr, ids_ptr, w_ptr, scale,
                  KSEL: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HASH: tl.constexpr, FLOOR: tl.constexpr):
    """p = sqrt(softplus(logits)); ids = hash table row or top-k of p + bias (ties: lower id);
    weights = p[ids] / max(Σ, FLOOR) · scale (spec §3.7; FLOOR: core.rules.ROUTER_WEIGHT_FLOOR)."""
    t = tl.program_id(0)
    idx = tl.arange(0, BE)
    em = idx < NE
    x = tl.load(logit_ptr + t * NE + idx, mask=em, other=0.0)
    ex = tl.exp(tl.minimum(x, 20.0))
    one = 1.0 + ex
    lp = tl.where(one == 1.0, ex, tl.log(one) * ex / (one - 1.0))  # accurate log1p
    sp = tl.where(x > 20.0, x, tl.where(x < -20.0, tl.exp(tl.minimum(x, 0.0)), lp))
    p = tl.sqrt_rn(sp)
    kk = tl.arange(0, KP)
    km = kk < KSEL
    if HASH:
        tok = tl.load(tok_ptr + t).to(tl.int64)
        ids = tl.load(tid_ptr + tok * KSEL + kk, mask=km, other=0)
        w = tl.sum(tl.where(idx[None, :] == ids[:, None], p[None, :], 0.0), axis=1)
        w = tl.where(km, w, 0.0)
    else:
        sel = p
        if HAS_BIAS:
            sel = sel + tl.load(bias_ptr + idx, mask=em, other=0.0)
        sel = tl.where(em, sel, float("-inf"))
        ids = tl.zeros([KP], tl.int32)
        w = tl.zeros([KP], tl.float32)
        for j in tl.static_range(KSEL):
            mx = tl.max(sel, axis=0)
            i = tl.min(tl.where(sel == mx, idx, BE), axis=0)
            ids = tl.where(kk == j, i, ids)
            w = tl.where(kk == j, tl.sum(tl.where(idx == i, p, 0.0), axis=0), w)
            sel = tl.where(idx == i, float("-inf"), sel)
    tot = tl.sum(w, axis=0)
    w = w / tl.maximum(tot, FLOOR) * scale
    tl.store(ids_ptr + t * KSEL + kk, ids, mask=km)
    tl.store(w_ptr + t * KSEL + kk, w, mask=km)


# ------------------------------------------------------------------------------------------------
# element-wise, norms, mHC


@triton.jit
def embed_kernel(tok_ptr, wb, wh, wf, gridp, ksigns, x_ptr, E, RB,
                 HC: tl.constexpr, TYPE: tl.constexpr, NB: tl.constexpr, VB: tl.constexpr):
    t = tl.program_id(0)
    eb = tl.program_id(1)
    tok = tl.load(tok_ptr + t).to(tl.int64)
    BE: tl.constexpr = NB * VB
    row = _wtile(wb, wh, wf, gridp, ksigns, tok * RB + tl.zeros([1], tl.int64), tl.full([1], 1, tl.int1),
                 eb * NB, TYPE, NB, VB)
    row = tl.reshape(row, [BE])
    c = eb * BE + tl.arange(0, BE)
    for h in tl.static_range(HC):
        tl.store(x_ptr + (t * HC + h) * E + c, row)


@triton.jit
def rms_kernel(x_ptr, w_ptr, out_ptr, D, eps, xw_ptr, xs_ptr, xsum_ptr, BD: tl.constexpr, WEIGHTED: tl.constexpr,
               XQ: tl.constexpr = False, PERM: tl.constexpr = False, DEP: tl.constexpr = False):
    """One row's RMSNorm; XQ (BD = D, a multiple of 32) also stores the result in XQ form, for
    the routed experts' integer decoder (418), or XQ8 with PERM (309). DEP: as matvec_xq_kernel."""
    if DEP:
        gdc_launch_dependents()
    r = tl.program_id(0)
    c = tl.arange(0, BD)
    cm = c < D
    x = tl.load(x_ptr + r.to(tl.int64) * D + c, mask=cm, other=0.0)
    y = x / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
    if WEIGHTED:
        y = y * tl.load(w_ptr + c, mask=cm, other=0.0)
    tl.store(out_ptr + r.to(tl.int64) * D + c, y, mask=cm)
    if XQ:
        NBLK: tl.constexpr = BD // 32
        _xq_store(tl.reshape(y, [NBLK, 32]), xw_ptr + r * (D // 2), xs_ptr + r * (D // 32), xsum_ptr + r * (D // 16),
                  0, tl.arange(0, NBLK) < NBLK, PERM)


@triton.jit
def add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, tl.load(a_ptr + i, mask=m) + tl.load(b_ptr + i, mask=m), mask=m)


@triton.jit
def swiglu_kernel(g_ptr, u_ptr, out_ptr, n, clamp, BLOCK: tl.constexpr):
    """The clamped SwiGLU of gate and up products computed apart (§3.7)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, _swiglu(tl.load(g_ptr + i, mask=m), tl.load(u_ptr + i, mask=m), clamp), mask=m)


@triton.jit
def hc_mix_kernel(x_ptr, wb, wh, wf, gridp, ksigns, part_ptr, ss_ptr, n, NR, K, RB, KCHUNK,
                  y_ptr, y2_ptr, xo_ptr, post_ptr, comb_ptr, E,
                  NM: tl.constexpr, TYPE: tl.constexpr, NB: tl.constexpr, VB: tl.constexpr,
                  BT: tl.constexpr = 1, EXPAND: tl.constexpr = False, HAS_Y2: tl.constexpr = False,
                  HC: tl.constexpr = 4):
    """Partial mHC mixing projections fn[NR, K] · X[t] over one K chunk, and the partial Σ X²,
    for tokens [BT·program, +BT). BT = 1 (decode): FMAs. BT > 1 (prefill): tf32 tensor-core
    products to float32 accuracy (_dot_f32; F16 weights are exact in tf32), so that a weight
    tile read from L2 serves BT tokens instead of one (one token per program read all of fn,
    0.8 MB, per token: 26 ms of a 2048-token prefill).
    EXPAND (BT = 1): X is first computed from the previous sublayer, as hc_post_kernel would
    (X[j] = post[j]·(y + y2) + Σ_i comb[i][j]·Xo[i]), and stored to x_ptr; the expand then
    needs no launch of its own on the decode path."""
    sp = tl.program_id(1)
    nsp = tl.num_programs(1)
    rows = tl.arange(0, NM)
    rmask = rows < NR
    row_off = rows.to(tl.int64) * RB
    BK: tl.constexpr = NB * VB
    if BT == 1:
        t = tl.program_id(0)
        kv = tl.arange(0, NB)[None, :, None] * VB + tl.arange(0, VB)[None, None, :]
        acc = tl.zeros([NM, NB, VB], tl.float32)
        ss = tl.zeros([1, NB, VB], tl.float32)
        xb = x_ptr + t.to(tl.int64) * K
        for k0 in range(sp * KCHUNK, sp * KCHUNK + KCHUNK, BK):
            if EXPAND:
                k = k0 + kv
                j = k // E
                e = k - j * E
                y = tl.load(y_ptr + t.to(tl.int64) * E + e)
                if HAS_Y2:
                    y = y + tl.load(y2_ptr + t.to(tl.int64) * E + e)
                cb = comb_ptr + t * HC * HC + j
                mixed = tl.load(cb) * tl.load(xo_ptr + (t * HC).to(tl.int64) * E + e)
                for i in tl.static_range(1, HC):
                    mixed += tl.load(cb + i * HC) * tl.load(xo_ptr + (t * HC + i).to(tl.int64) * E + e)
                xv = tl.load(post_ptr + t * HC + j) * y + mixed
                tl.store(xb + k, xv)
            else:
                xv = tl.load(xb + k0 + kv)
            ss += xv * xv
            acc += _wtile(wb, wh, wf, gridp, ksigns, row_off, rmask, k0 // VB, TYPE, NB, VB) * xv
        tl.store(part_ptr + (t * nsp + sp) * NM + rows, tl.sum(tl.sum(acc, axis=2), axis=1))
        tl.store(ss_ptr + t * nsp + sp, tl.sum(ss))
    else:
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        tm = t < n
        kk = tl.arange(0, BK)
        acc = tl.zeros([BT, NM], tl.float32)
        ss = tl.zeros([BT, BK], tl.float32)
        xb = x_ptr + t[:, None].to(tl.int64) * K
        for k0 in range(sp * KCHUNK, sp * KCHUNK + KCHUNK, BK):
            xt = tl.load(xb + k0 + kk[None, :], mask=tm[:, None], other=0.0)
            ss += xt * xt
            w = tl.reshape(_wtile(wb, wh, wf, gridp, ksigns, row_off, rmask, k0 // VB, TYPE, NB, VB), [NM, BK])
            acc = _dot_f32(xt, tl.trans(w), acc, TYPE == 1)
        tp = (t * nsp + sp).to(tl.int64)
        tl.store(part_ptr + tp[:, None] * NM + rows[None, :], acc, mask=tm[:, None])
        tl.store(ss_ptr + tp, tl.sum(ss, axis=1), mask=tm)


@triton.jit
def _norm4(a, b, c, d, eps):
    """(a, b, c, d) / (a + b + c + d + eps), one division."""
    r = 1.0 / (((a + b) + c) + d + eps)
    return a * r, b * r, c * r, d * r


@triton.jit
def _softmax4(a, b, c, d, eps):
    """A row's softmax + eps (§3.2)."""
    m = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a, b, c, d = tl.exp(a - m), tl.exp(b - m), tl.exp(c - m), tl.exp(d - m)
    a, b, c, d = _norm4(a, b, c, d, 0.0)
    return a + eps, b + eps, c + eps, d + eps


@triton.jit
def _sinkhorn4(c_ptr, eps, ITERS):
    """The Sinkhorn normalisation (§3.2) of the 4×4 comb logits at c_ptr (row-major), in place,
    as 16 scalars that every thread holds. As a [4, 4] tile spread over the program's warps each
    of its 40 row / column sums was a cross-warp reduction through shared memory with a barrier;
    here it is two barriers and arithmetic (the finalize kernel: 6.3 → 5.3–5.6 µs a call on the
    H200, bench/triton/README.md)."""
    tl.debug_barrier()  # the logits were stored by other threads
    c00, c01, c02, c03 = tl.load(c_ptr + 0), tl.load(c_ptr + 1), tl.load(c_ptr + 2), tl.load(c_ptr + 3)
    c10, c11, c12, c13 = tl.load(c_ptr + 4), tl.load(c_ptr + 5), tl.load(c_ptr + 6), tl.load(c_ptr + 7)
    c20, c21, c22, c23 = tl.load(c_ptr + 8), tl.load(c_ptr + 9), tl.load(c_ptr + 10), tl.load(c_ptr + 11)
    c30, c31, c32, c33 = tl.load(c_ptr + 12), tl.load(c_ptr + 13), tl.load(c_ptr + 14), tl.load(c_ptr + 15)
    tl.debug_barrier()  # every thread has read them before any writes the result over them
    c00, c01, c02, c03 = _softmax4(c00, c01, c02, c03, eps)
    c10, c11, c12, c13 = _softmax4(c10, c11, c12, c13, eps)
    c20, c21, c22, c23 = _softmax4(c20, c21, c22, c23, eps)
    c30, c31, c32, c33 = _softmax4(c30, c31, c32, c33, eps)
    c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
    c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
    c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
    c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    for _ in range(ITERS - 1):
        c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, eps)
        c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, eps)
        c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, eps)
        c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, eps)
        c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
        c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
        c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
        c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    tl.store(c_ptr + 0, c00)
    tl.store(c_ptr + 1, c01)
    tl.store(c_ptr + 2, c02)
    tl.store(c_ptr + 3, c03)
    tl.store(c_ptr + 4, c10)
    tl.store(c_ptr + 5, c11)
    tl.store(c_ptr + 6, c12)
    tl.store(c_ptr + 7, c13)
    tl.store(c_ptr + 8, c20)
    tl.store(c_ptr + 9, c21)
    tl.store(c_ptr + 10, c22)
    tl.store(c_ptr + 11, c23)
    tl.store(c_ptr + 12, c30)
    tl.store(c_ptr + 13, c31)
    tl.store(c_ptr + 14, c32)
    tl.store(c_ptr + 15, c33)


@triton.jit
def hc_finalize_kernel(x_ptr, part_ptr, ss_ptr, scale_ptr, base_ptr, xin_ptr, post_ptr, comb_ptr,
                       n, E, eps, hc_eps, ITERS,
                       SPLIT: tl.constexpr, HC: tl.constexpr, NM: tl.constexpr, BE: tl.constexpr,
                       BT: tl.constexpr, HEAD: tl.constexpr, PART: tl.constexpr = 0):
    """mHC collapse (§3.2) of tokens [tb·BT, +BT): pre/post/comb from the mixing projections
    (Sinkhorn on comb), and x_in[e-block] = Σ_i pre[i]·X[i]. HEAD: the output head (pre only).
    PART 1: pre and x_in only; PART 2: post and comb only (one program per token block). The
    sublayer needs x_in at once and post/comb only at its expand, so a decode step runs the two
    parts side by side and the Sinkhorn iterations leave the critical path."""
    tb = tl.program_id(0)
    eb = tl.program_id(1)
    t = tb * BT + tl.arange(0, BT)
    tm = t < n
    tc = tl.where(tm, t, 0)
    sp = tl.arange(0, SPLIT)
    ss = tl.sum(tl.load(ss_ptr + tc[:, None] * SPLIT + sp[None, :]), axis=1)  # [BT]
    rs = tl.sqrt_rn(ss / (HC * E) + eps)
    pbase = part_ptr + (tc[:, None] * SPLIT + sp[None, :]) * NM  # [BT, SPLIT]
    i = tl.arange(0, HC)
    pre = tl.sum(tl.load(pbase[:, :, None] + i[None, None, :]), axis=1) / rs[:, None]  # [BT, HC]
    pre = _sigmoid(pre * tl.load(scale_ptr) + tl.load(base_ptr + i)[None, :]) + hc_eps
    if not HEAD and PART != 1:
        if eb == 0:
            post = tl.sum(tl.load(pbase[:, :, None] + HC + i[None, None, :]), axis=1) / rs[:, None]
            post = 2.0 * _sigmoid(post * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + i)[None, :])
            tl.store(post_ptr + tc[:, None] * HC + i[None, :], post, mask=tm[:, None])
            cidx = 2 * HC + i[:, None] * HC + i[None, :]  # [HC, HC]
            # all SPLIT partials in one tile (a loop of SPLIT dependent steps took 9.4 µs at 128)
            cp = part_ptr + (tc[:, None, None, None] * SPLIT + sp[None, :, None, None]) * NM
            c = tl.sum(tl.load(cp + cidx[None, None, :, :]), axis=1) / rs[:, None, None]
            c = c * tl.load(scale_ptr + 2) + tl.load(base_ptr + cidx)[None, :, :]
            if BT == 1 and HC == 4:  # (every GPU launch)
                tl.store(comb_ptr + tb * HC * HC + (cidx - 2 * HC)[None, :, :], c)
                _sinkhorn4(comb_ptr + tb * HC * HC, hc_eps, ITERS)
            else:
                c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
                c = c / tl.sum(c, axis=2)[:, :, None] + hc_eps
                c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
                for _ in range(ITERS - 1):
                    c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
                    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
                tl.store(comb_ptr + tc[:, None, None] * HC * HC + (cidx - 2 * HC)[None, :, :], c,
                         mask=tm[:, None, None])
    if PART != 2:
        e = eb * BE + tl.arange(0, BE)
        em = e < E
        X = tl.load(x_ptr + (tc[:, None, None] * HC + i[None, :, None]).to(tl.int64) * E + e[None, None, :],
                    mask=tm[:, None, None] & em[None, None, :], other=0.0)
        tl.store(xin_ptr + tc[:, None].to(tl.int64) * E + e[None, :], tl.sum(pre[:, :, None] * X, axis=1),
                 mask=tm[:, None] & em[None, :])


@triton.jit
def hc_post_kernel(y_ptr, y2_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, E,
                   HC: tl.constexpr, BE: tl.constexpr, HAS_Y2: tl.constexpr):
    """mHC expand (§3.3): X_new[j] = post[j]·y + Σ_i comb[i][j]·X[i] (y = y + y2 fused)."""
    t = tl.program_id(0)
    eb = tl.program_id(1)
    e = eb * BE + tl.arange(0, BE)
    em = e < E
    y = tl.load(y_ptr + t.to(tl.int64) * E + e, mask=em, other=0.0)
    if HAS_Y2:
        y = y + tl.load(y2_ptr + t.to(tl.int64) * E + e, mask=em, other=0.0)
    i = tl.arange(0, HC)
    X = tl.load(x_ptr + (t * HC + i[:, None]).to(tl.int64) * E + e[None, :], mask=em[None, :], other=0.0)
    post = tl.load(post_ptr + t * HC + i)
    comb = tl.load(comb_ptr + t * HC * HC + i[:, None] * HC + i[None, :])  # [i, j]
    mixed = tl.sum(comb[:, :, None] * X[:, None, :], axis=0)  # [j, e]
    out = post[:, None] * y[None, :] + mixed
    tl.store(out_ptr + (t * HC + i[:, None]).to(tl.int64) * E + e[None, :], out, mask=em[None, :])


# ------------------------------------------------------------------------------------------------
# RoPE, cache rows


@triton.jit
def rope_kernel(x_ptr, out_ptr, nw_ptr, freq_ptr, pos_ptr, ROWS, eps,
                D: tl.constexpr, NROT: tl.constexpr, BR: tl.constexpr,
                NORM: tl.constexpr, INVERSE: tl.constexpr, QAT: tl.constexpr, QS: tl.constexpr,
                LOGD: tl.constexpr, HDP: tl.constexpr):
    """Tail RoPE (adjacent pairs of the last NROT dims) of rows [n, ROWS, D] at positions p0 + t,
    optionally after a per-row RMSNorm (NORM 1 weighted, 2 unweighted) and followed by the
    indexer's Hadamard + FP4 simulation (QAT: D a power of two). HDP: D / 2 pairs padded to a
    power of two (tl.arange's sizes), the pad masked."""
    t = tl.program_id(0)
    rb = tl.program_id(1)
    HD: tl.constexpr = D // 2
    r = rb * BR + tl.arange(0, BR)
    rm = r < ROWS
    base = (t * ROWS + r).to(tl.int64) * D
    i = tl.arange(0, HDP)
    im = i < HD
    lm = rm[:, None] & im[None, :]
    pe = base[:, None] + 2 * i[None, :]
    xe = tl.load(x_ptr + pe, mask=lm, other=0.0)
    xo = tl.load(x_ptr + pe + 1, mask=lm, other=0.0)
    if NORM != 0:
        rs = tl.sqrt_rn((tl.sum(xe * xe, axis=1) + tl.sum(xo * xo, axis=1)) / D + eps)[:, None]
        xe = xe / rs
        xo = xo / rs
        if NORM == 1:
            xe = xe * tl.load(nw_ptr + 2 * i, mask=im, other=0.0)[None, :]
            xo = xo * tl.load(nw_ptr + 2 * i + 1, mask=im, other=0.0)[None, :]
    k = i - (D - NROT) // 2
    km = (k >= 0) & im
    pos = tl.load(pos_ptr) + t
    theta = pos.to(tl.float32) * tl.load(freq_ptr + k, mask=km, other=0.0)
    c = _cos(theta)[None, :]
    s = _sin(theta)[None, :]
    if INVERSE:
        s = -s
    ne = tl.where(km[None, :], xe * c - xo * s, xe)
    no = tl.where(km[None, :], xe * s + xo * c, xo)
    if QAT:
        y = _qat_rows(tl.reshape(tl.join(ne, no), [BR, D]), QS, LOGD)
        tl.store(out_ptr + base[:, None] + tl.arange(0, D)[None, :], y, mask=rm[:, None])
    else:
        tl.store(out_ptr + pe, ne, mask=lm)
        tl.store(out_ptr + pe + 1, no, mask=lm)


@triton.jit
def kv_store_kernel(kv_ptr, raw_ptr, pos_ptr, RAWCAP, D: tl.constexpr, NN: tl.constexpr, DS4: tl.constexpr,
                    DP: tl.constexpr):
    """Push K=V rows into the raw ring at (p0 + t) % RAWCAP, FP8-simulated and f16-rounded (ds4).
    DP: D padded to a power of two, the pad masked."""
    t = tl.program_id(0)
    c = tl.arange(0, DP)[None, :]
    cm = c < D
    x = tl.load(kv_ptr + t.to(tl.int64) * D + c, mask=cm, other=0.0)
    if DS4:
        if NN > 0:
            x = _fp8_rows(x, NN)
        x = _f16_round(x)
    row = (tl.load(pos_ptr) + t) % RAWCAP
    tl.store(raw_ptr + row.to(tl.int64) * D + c, x, mask=cm)


# ------------------------------------------------------------------------------------------------
# compressor (§3.5)


@triton.jit
def _comp_src(q, p0, M: tl.constexpr, CSA: tl.constexpr):
    """State row holding position q < p0 (the frontier at the chunk's start)."""
    if CSA:
        return tl.where(q // 4 == p0 // 4, 4 + q % 4, q % 4)
    else:
        return q % M


@triton.jit
def _comp_cand(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, w, p0, r0, i,
               M: tl.constexpr, D: tl.constexpr, C: tl.constexpr, CSA: tl.constexpr,
               RB: tl.constexpr, KV: tl.constexpr, NCAND: tl.constexpr):
    """Scores (ape included) and values of candidates r0..r0+RB of window w (those below NCAND),
    even / odd dims."""
    r = r0 + tl.arange(0, RB)
    if CSA:  # rows 0..3: previous window, lane 0..D-1; rows 4..7: this window, lane D..2D-1
        q = 4 * w - 4 + r
        coff = tl.where(r < 4, 0, D)
    else:
        q = w * M + r
        coff = r * 0
    inchunk = q >= p0
    valid = (q >= 0) & (r < NCAND)
    srow = _comp_src(q, p0, M, CSA)
    crow = tl.where(inchunk, q - p0, 0)
    col_e = coff[:, None] + 2 * i[None, :]
    im = (i < D // 2)[None, :]  # (the pairs' pad past D / 2)
    ld_c = (inchunk & valid)[:, None] & im
    ld_s = ((~inchunk) & valid)[:, None] & im
    qm = tl.where(valid, q % M, 0)[:, None]
    sc_e = tl.where(ld_c, tl.load(sc_ptr + crow[:, None] * C + col_e, mask=ld_c, other=0.0)
                    + tl.load(ape_ptr + qm * C + col_e, mask=ld_c, other=0.0),
                    tl.load(ssc_ptr + srow[:, None] * C + col_e, mask=ld_s, other=float("-inf")))
    sc_o = tl.where(ld_c, tl.load(sc_ptr + crow[:, None] * C + col_e + 1, mask=ld_c, other=0.0)
                    + tl.load(ape_ptr + qm * C + col_e + 1, mask=ld_c, other=0.0),
                    tl.load(ssc_ptr + srow[:, None] * C + col_e + 1, mask=ld_s, other=float("-inf")))
    if KV:
        kv_e = tl.where(ld_c, tl.load(kv_ptr + crow[:, None] * C + col_e, mask=ld_c, other=0.0),
                        tl.load(skv_ptr + srow[:, None] * C + col_e, mask=ld_s, other=0.0))
        kv_o = tl.where(ld_c, tl.load(kv_ptr + crow[:, None] * C + col_e + 1, mask=ld_c, other=0.0),
                        tl.load(skv_ptr + srow[:, None] * C + col_e + 1, mask=ld_s, other=0.0))
    else:
        kv_e = sc_e
        kv_o = sc_o
    return sc_e, sc_o, kv_e, kv_o


@triton.jit
def comp_pool_kernel(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, nw_ptr, freq_ptr, pos_ptr, rows_ptr,
                     n, eps,
                     M: tl.constexpr, D: tl.constexpr, C: tl.constexpr, NROT: tl.constexpr,
                     CSA: tl.constexpr, NCAND: tl.constexpr, RB: tl.constexpr, MODE: tl.constexpr,
                     QS: tl.constexpr, LOGD: tl.constexpr, HDP: tl.constexpr):
    """One compressed row per program: the window w = p0 // M + program that closes inside the
    chunk (others exit). Candidates are the window's M positions (CSA: the previous window's
    first lane and this window's second lane, 8 rows), read from the chunk's projections or
    from the frontier state; per-dimension softmax pooling, RMSNorm, RoPE at the window's first
    position, then MODE 1: FP8 + f16, MODE 2: Hadamard + FP4 + f16 (D a power of two), MODE 0:
    none. HDP: D / 2 pairs padded to a power of two, the pad masked."""
    p0 = tl.load(pos_ptr)
    w = p0 // M + tl.program_id(0)
    if w * M + M - 1 < p0 + n:
        HD: tl.constexpr = HDP
        i = tl.arange(0, HD)
        im = i < D // 2
        mx_e = tl.full([HD], float("-inf"), tl.float32)
        mx_o = tl.full([HD], float("-inf"), tl.float32)
        for r0 in range(0, NCAND, RB):
            sc_e, sc_o, _, _ = _comp_cand(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, w, p0, r0, i,
                                          M, D, C, CSA, RB, False, NCAND)
            mx_e = tl.maximum(mx_e, tl.max(sc_e, axis=0))
            mx_o = tl.maximum(mx_o, tl.max(sc_o, axis=0))
        safe_e = tl.where(mx_e == float("-inf"), 0.0, mx_e)
        safe_o = tl.where(mx_o == float("-inf"), 0.0, mx_o)
        se = tl.zeros([HD], tl.float32)
        so = tl.zeros([HD], tl.float32)
        ae = tl.zeros([HD], tl.float32)
        ao = tl.zeros([HD], tl.float32)
        for r0 in range(0, NCAND, RB):
            sc_e, sc_o, kv_e, kv_o = _comp_cand(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, w, p0, r0, i,
                                                M, D, C, CSA, RB, True, NCAND)
            pe = tl.exp(sc_e - safe_e[None, :])
            po = tl.exp(sc_o - safe_o[None, :])
            se += tl.sum(pe, axis=0)
            so += tl.sum(po, axis=0)
            ae += tl.sum(pe * kv_e, axis=0)
            ao += tl.sum(po * kv_o, axis=0)
        xe = tl.where(se > 0, ae / tl.where(se > 0, se, 1.0), 0.0)[None, :]
        xo = tl.where(so > 0, ao / tl.where(so > 0, so, 1.0), 0.0)[None, :]
        rs = tl.sqrt_rn((tl.sum(xe * xe, axis=1) + tl.sum(xo * xo, axis=1)) / D + eps)[:, None]
        xe = xe / rs * tl.load(nw_ptr + 2 * i, mask=im, other=0.0)[None, :]
        xo = xo / rs * tl.load(nw_ptr + 2 * i + 1, mask=im, other=0.0)[None, :]
        k = i - (D - NROT) // 2
        km = ((k >= 0) & im)[None, :]
        theta = (w * M).to(tl.float32) * tl.load(freq_ptr + k, mask=(k >= 0) & im, other=0.0)
        c = _cos(theta)[None, :]
        s = _sin(theta)[None, :]
        ne = tl.where(km, xe * c - xo * s, xe)
        no = tl.where(km, xe * s + xo * c, xo)
        y = tl.reshape(tl.join(ne, no), [1, 2 * HD])
        if MODE == 1:
            if D - NROT > 0:
                y = _fp8_rows(y, D - NROT)
            y = _f16_round(y)
        elif MODE == 2:
            y = _f16_round(_qat_rows(y, QS, LOGD))
        c = tl.arange(0, 2 * HD)[None, :]
        tl.store(rows_ptr + w.to(tl.int64) * D + c, y, mask=c < D)


@triton.jit
def comp_update_kernel(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, pos_ptr, n,
                       M: tl.constexpr, C: tl.constexpr, CSA: tl.constexpr, NR: tl.constexpr,
                       BC: tl.constexpr, NRP: tl.constexpr):
    """The frontier after the chunk, as the reference leaves it: row (CSA: 4 +) q % M holds the
    last position q of the chunk with that residue (score includes ape); CSA rows 0..3 hold the
    last window closed in the chunk."""
    p0 = tl.load(pos_ptr)
    cb = tl.program_id(0)
    col = cb * BC + tl.arange(0, BC)
    cm = col < C
    r = tl.arange(0, NRP)  # NR state rows padded to a power of two; the pad is never stored
    last = p0 + n - 1
    if CSA:
        rr = r % 4
        q_cur = last - (((last - rr) % 4) + 4) % 4
        L = (p0 + n) // 4 - 1  # the last window closed in the chunk, if L >= p0 // 4
        q_prev = 4 * L + rr
        q = tl.where(r >= 4, q_cur, q_prev)
        do = tl.where(r >= 4, q_cur >= p0, L >= p0 // 4)
        old_row = tl.where(r >= 4, r, 4 + rr)  # where a pre-chunk position of that window sits
    else:
        q = last - (((last - r) % M) + M) % M
        do = q >= p0
        old_row = r
    do = do & (r < NR)
    inchunk = do & (q >= p0)
    fromold = do & (q < p0)
    crow = tl.where(inchunk, q - p0, 0)
    m_c = inchunk[:, None] & cm[None, :]
    m_o = fromold[:, None] & cm[None, :]
    colx = col[None, :]
    kv_new = tl.load(kv_ptr + crow[:, None] * C + colx, mask=m_c, other=0.0)
    sc_new = tl.load(sc_ptr + crow[:, None] * C + colx, mask=m_c, other=0.0) + \
        tl.load(ape_ptr + (q % M)[:, None] * C + colx, mask=m_c, other=0.0)
    kv_old = tl.load(skv_ptr + old_row[:, None] * C + colx, mask=m_o, other=0.0)
    sc_old = tl.load(ssc_ptr + old_row[:, None] * C + colx, mask=m_o, other=0.0)
    kv = tl.where(inchunk[:, None], kv_new, kv_old)
    sc = tl.where(inchunk[:, None], sc_new, sc_old)
    sm = do[:, None] & cm[None, :]
    tl.store(skv_ptr + r[:, None] * C + colx, kv, mask=sm)
    tl.store(ssc_ptr + r[:, None] * C + colx, sc, mask=sm)


# ------------------------------------------------------------------------------------------------
# indexer (§3.6)


@triton.jit
def idx_score_kernel(iq_ptr, hw_ptr, keys_ptr, out_ptr, pos_ptr, cnt_ptr, bkt_ptr, M, IH, CS, TOPK, hscale,
                     IHP: tl.constexpr, ID: tl.constexpr, BC: tl.constexpr, EXACT: tl.constexpr,
                     HIST: tl.constexpr = False, CAPB: tl.constexpr = 1, IDP: tl.constexpr = 0):
    """score[t, c] = Σ_h hw[t,h]·relu(iq[t,h]·k_c) over the rows c < (p0+t+1)//M.
    HIST (one query, more than TOPK rows visible): also count the scores' order-preserving keys
    by their top 8 bits (cnt_ptr[0, 256)) and their top 14 (cnt_ptr[256, 256 + 16384)), and put
    (key, row) in the bucket of the top 14 bits (bkt_ptr: keys [16384, CAPB], then rows; the
    first CAPB of a bucket), for topk_one_kernel, which reads them and clears the counts.
    IDP: ID padded to a power of two (0: ID is one), the pad zero in both operands."""
    t = tl.program_id(0)
    cb = tl.program_id(1)
    vis = (tl.load(pos_ptr) + t + 1) // M
    if cb * BC < vis:
        c = cb * BC + tl.arange(0, BC)
        cm = c < vis
        h = tl.arange(0, IHP)
        hm = h < IH
        d = tl.arange(0, ID if IDP == 0 else IDP)
        dm = d[None, :] < ID
        q = tl.load(iq_ptr + (t * IH + h[:, None]).to(tl.int64) * ID + d[None, :], mask=hm[:, None] & dm, other=0.0)
        k = tl.load(keys_ptr + c[:, None].to(tl.int64) * ID + d[None, :], mask=cm[:, None] & dm, other=0.0)
        s = tl.maximum(_dot_f32(q, tl.trans(k), tl.zeros([IHP, BC], tl.float32), EXACT), 0.0)  # [IHP, BC]
        hw = tl.load(hw_ptr + t * IH + h, mask=hm, other=0.0) / hscale
        sc = tl.sum(hw[:, None] * s, axis=0) + 0.0  # + 0.0: -0.0 ties +0.0 as in the reference
        tl.store(out_ptr + t.to(tl.int64) * CS + c, sc, mask=cm)
        if HIST:
            if vis > TOPK:
                key = _score_key(sc)
                # the top bytes are few distinct values (sign and exponent): counted in the
                # program first, so that a bin takes one atomic add per program
                hi = tl.histogram((key >> 24).to(tl.int32), 256, mask=cm)
                tl.atomic_add(cnt_ptr + tl.arange(0, 256), hi, mask=hi > 0, sem="relaxed")
                # a key's place in its bucket is the count before its own
                b = (key >> 18).to(tl.int32)
                slot = tl.atomic_add(cnt_ptr + 256 + b, 1, mask=cm, sem="relaxed")
                keep = cm & (slot < CAPB)
                tl.store(bkt_ptr + b * CAPB + slot, key.to(tl.int32, bitcast=True), mask=keep)
                tl.store(bkt_ptr + (16384 + b) * CAPB + slot, c, mask=keep)


@triton.jit
def _score_key(sc):
    """The order-preserving uint32 key of a float32 score (larger score, larger key)."""
    b = sc.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b ^ (-2147483648), ~b).to(tl.uint32, bitcast=True)


@triton.jit
def _keys_at(score_ptr, r, m):
    """The order-preserving keys of the scores at rows r (m: the rows to load)."""
    return _score_key(tl.load(score_ptr + r, mask=m, other=0.0))


@triton.jit
def _hist_digit(hist, need):
    """From the counts of a key digit's values (among keys that agree above it): the digit of
    the need-th largest key, need less the keys of the larger digits, and the count of that
    digit. One block-wide sum after the scan, the three packed in an int64: the digit in 9 bits,
    the keys of larger digits (fewer than need, so below 2^15 for need up to 2^15) in 15, the
    count in the rest."""
    ge = tl.cumsum(hist, 0, reverse=True)  # keys with this digit or a larger one
    at = (ge >= need) & (ge - hist < need)
    pk = tl.sum((ge >= need).to(tl.int64) + (tl.where(ge < need, hist, 0).to(tl.int64) << 9)
                + (tl.where(at, hist, 0).to(tl.int64) << 24), 0)
    return (pk & 511).to(tl.int32) - 1, need - ((pk >> 9) & 32767).to(tl.int32), (pk >> 24).to(tl.int32)


@triton.jit
def _key_to_float(U):
    """Inverse of the order-preserving float -> uint32 key (as int64 scalars)."""
    k = U - 2147483648
    b = tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.int32)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def topk_kernel(score_ptr, idx_ptr, cnt_ptr, pos_ptr, M, CS, TOPK, BC: tl.constexpr, CMAX: tl.constexpr):
    """The TOPK highest scores of a query's visible rows (ties: lower row first), as an
    increasing row list; all visible rows when there are at most TOPK. CMAX > 0: the scores fit
    in registers (one load, 32 bisection passes over registers); otherwise chunked passes."""
    t = tl.program_id(0)
    vis = (tl.load(pos_ptr) + t + 1) // M
    out = idx_ptr + t.to(tl.int64) * TOPK
    srow = score_ptr + t.to(tl.int64) * CS
    if vis <= TOPK:
        for c0 in range(0, vis, BC):
            c = c0 + tl.arange(0, BC)
            tl.store(out + c, c, mask=c < vis)
        tl.store(cnt_ptr + t, vis)
    elif CMAX > 0:
        c = tl.arange(0, CMAX)
        cv = c < vis
        sc = tl.load(srow + c, mask=cv, other=float("-inf"))
        U = tl.full([1], 0, tl.int64)
        for bb in range(32):
            cand = U | (tl.full([1], 1, tl.int64) << (31 - bb))
            cnt = tl.sum((sc >= _key_to_float(cand)).to(tl.int32), axis=0)
            U = tl.where(cnt >= TOPK, cand, U)
        Tf = _key_to_float(U)
        gt = tl.sum((sc > Tf).to(tl.int32), axis=0)
        eq = (sc == Tf) & cv
        eq_rank = tl.cumsum(eq.to(tl.int32), axis=0) - eq.to(tl.int32)
        sel = (sc > Tf) | (eq & (eq_rank < TOPK - gt))
        where = tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(out + where, c, mask=sel)
        tl.store(cnt_ptr + t + tl.zeros([1], tl.int32), TOPK + tl.zeros([1], tl.int32))
    else:
        # the TOPK-th largest order-preserving key T, bit by bit from the top
        T = tl.zeros([1], tl.int64)
        for bb in range(32):
            cand = T | (tl.full([1], 1, tl.int64) << (31 - bb))
            cnt = tl.zeros([1], tl.int64)
            for c0 in range(0, vis, BC):
                c = c0 + tl.arange(0, BC)
                bits = tl.load(srow + c, mask=c < vis, other=0.0).to(tl.int32, bitcast=True).to(tl.int64)
                key = tl.where(bits >= 0, bits + 2147483648, -1 - bits)
                cnt += tl.sum(((key >= cand) & (c < vis)).to(tl.int64), axis=0)
            T = tl.where(cnt >= TOPK, cand, T)
        gt = tl.zeros([1], tl.int64)
        for c0 in range(0, vis, BC):
            c = c0 + tl.arange(0, BC)
            bits = tl.load(srow + c, mask=c < vis, other=0.0).to(tl.int32, bitcast=True).to(tl.int64)
            key = tl.where(bits >= 0, bits + 2147483648, -1 - bits)
            gt += tl.sum(((key > T) & (c < vis)).to(tl.int64), axis=0)
        need = TOPK - gt
        eq_seen = tl.zeros([1], tl.int64)
        n_out = tl.zeros([1], tl.int64)
        for c0 in range(0, vis, BC):
            c = c0 + tl.arange(0, BC)
            cv = c < vis
            bits = tl.load(srow + c, mask=cv, other=0.0).to(tl.int32, bitcast=True).to(tl.int64)
            key = tl.where(bits >= 0, bits + 2147483648, -1 - bits)
            eq = (key == T) & cv
            eq_rank = eq_seen + tl.cumsum(eq.to(tl.int64), axis=0) - eq.to(tl.int64)
            sel = ((key > T) & cv) | (eq & (eq_rank < need))
            where = n_out + tl.cumsum(sel.to(tl.int64), axis=0) - 1
            tl.store(out + where, c, mask=sel)
            eq_seen += tl.sum(eq.to(tl.int64), axis=0)
            n_out += tl.sum(sel.to(tl.int64), axis=0)
        tl.store(cnt_ptr + t + tl.zeros([1], tl.int32), TOPK + tl.zeros([1], tl.int32))


@triton.jit
def _at_least(key, row, Lk, Lr):
    """(key, lower row first) at least (Lk, Lr): selected when (Lk, Lr) is the last selected."""
    return (key > Lk) | ((key == Lk) & (row <= Lr))


@triton.jit
def topk_one_kernel(score_ptr, idx_ptr, cnt_ptr, pos_ptr, kc_ptr, bkt_ptr, M, TOPK, NP,
                    CH: tl.constexpr, CAPB: tl.constexpr, LB: tl.constexpr, NLB: tl.constexpr):
    """topk_kernel's selection for one query (decode) from what idx_score_kernel HIST left: the
    key counts and buckets. Program p writes the selected rows among [p·CH, p·CH + CH).

    Each program on its own: the counts give the top 14 bits of the threshold key T (the TOPK-th
    largest) and how many keys share them; those keys are one bucket, ranked against each other
    by (key, then lower row), which gives the last selected (key, row) L. A row is selected when
    (its key, lower row first) is at least L; its place is the count of selected rows before it.
    A bucket past CAPB keys: L from bisection passes over every score instead. The last program
    to read the counts clears them for the next step. The rows before a program's are counted in
    NLB blocks of LB (NLB·LB covers the capacity) loaded together, not one block after another."""
    pid = tl.program_id(0)
    vis = (tl.load(pos_ptr) + 1) // M
    c = pid * CH + tl.arange(0, CH)
    cv = c < vis
    if vis <= TOPK:
        tl.store(idx_ptr + c, c, mask=cv)
        if pid == 0:
            tl.store(cnt_ptr, vis)
    else:
        key = _keys_at(score_ptr, c, cv)  # (in flight while L is found)
        d1, need, _ = _hist_digit(tl.load(kc_ptr + tl.arange(0, 256)), TOPK)
        d2, need, n_c = _hist_digit(tl.load(kc_ptr + 256 + d1 * 64 + tl.arange(0, 64)), need)
        P = d1 * 64 + d2  # T's top 14 bits, shared by n_c keys; need of them are selected
        tl.debug_barrier()  # every thread's reads of the counts done before the ticket
        # (release: the loads below need not wait for it; its answer is awaited last)
        ticket = tl.atomic_add(kc_ptr + 256 + 16384, 1, sem="release")
        if n_c <= CAPB:
            i = tl.arange(0, CAPB)
            im = i < n_c
            ck = tl.load(bkt_ptr + P * CAPB + i, mask=im, other=0).to(tl.uint32, bitcast=True)
            cr = tl.load(bkt_ptr + (16384 + P) * CAPB + i, mask=im, other=0)
            rank = tl.zeros([CAPB], tl.int32)
            for j0 in range(0, n_c, 32):  # the bucket's others, 32 at a time
                j = j0 + tl.arange(0, 32)
                jm = j < n_c
                kj = tl.load(bkt_ptr + P * CAPB + j, mask=jm, other=0).to(tl.uint32, bitcast=True)
                rj = tl.load(bkt_ptr + (16384 + P) * CAPB + j, mask=jm, other=0)
                beats = (kj[None, :] > ck[:, None]) | ((kj[None, :] == ck[:, None]) & (rj[None, :] < cr[:, None]))
                rank += tl.sum((beats & jm[None, :]).to(tl.int32), 1)
            # the one ranked need - 1 (a sum picks it; its key zero-extended by hand)
            last = tl.sum(tl.where(im & (rank == need - 1), ((ck.to(tl.int64) & 0xFFFFFFFF) << 32) | cr.to(tl.int64),
                                   0), 0)
            Lk = ((last >> 32) & 0xFFFFFFFF).to(tl.uint32)
            Lr = (last & 0xFFFFFFFF).to(tl.int32)
        else:
            Lk = P.to(tl.uint32) << 18
            for bb in range(18):
                cand = Lk | (tl.full([], 1, tl.uint32) << (17 - bb))
                acc = tl.zeros([LB], tl.int32)
                for c0 in range(0, vis, LB):
                    r = c0 + tl.arange(0, LB)
                    acc += ((r < vis) & (_keys_at(score_ptr, r, r < vis) >= cand)).to(tl.int32)
                Lk = tl.where(tl.sum(acc, 0) >= TOPK, cand, Lk)
            acc = tl.zeros([LB], tl.int32)
            for c0 in range(0, vis, LB):
                r = c0 + tl.arange(0, LB)
                acc += ((r < vis) & (_keys_at(score_ptr, r, r < vis) > Lk)).to(tl.int32)
            need = TOPK - tl.sum(acc, 0)  # keys equal to T to take, lowest rows first
            seen = tl.zeros([], tl.int32)
            Lr = tl.zeros([], tl.int32) - 1
            for c0 in range(0, vis, LB):
                r = c0 + tl.arange(0, LB)
                eq = ((r < vis) & (_keys_at(score_ptr, r, r < vis) == Lk)).to(tl.int32)
                Lr = tl.maximum(Lr, tl.max(tl.where((eq > 0) & (seen + tl.cumsum(eq, 0) == need), r, -1), 0))
                seen += tl.sum(eq, 0)
        # selected rows before this program's: counted over [0, pid·CH)
        acc = tl.zeros([LB], tl.int32)
        for b in tl.static_range(NLB):
            r = b * LB + tl.arange(0, LB)
            rm = (r < vis) & (r < pid * CH)
            acc += (rm & _at_least(_keys_at(score_ptr, r, rm), r, Lk, Lr)).to(tl.int32)
        sel = cv & _at_least(key, c, Lk, Lr)
        s1 = sel.to(tl.int32)
        tl.store(idx_ptr + tl.sum(acc, 0) + tl.cumsum(s1, 0) - s1, c, mask=sel)
        if pid == 0:
            tl.store(cnt_ptr, TOPK)
        if ticket == NP - 1:  # every program has read the counts: the last clears them
            tl.atomic_add(kc_ptr + 256 + 16384, 0, sem="acquire")  # (their reads before these stores)
            tl.store(kc_ptr + tl.arange(0, 256), tl.zeros([256], tl.int32))
            for z in range(0, 16384, 4096):
                tl.store(kc_ptr + 256 + z + tl.arange(0, 4096), tl.zeros([4096], tl.int32))
            tl.store(kc_ptr + 256 + 16384, 0)


# ------------------------------------------------------------------------------------------------
# sink attention (§3.4 step 9)


@triton.jit
def attn_kernel(q_ptr, raw_ptr, comp_ptr, sel_ptr, cnt_ptr, pos_ptr, sink_ptr,
                mo_ptr, lo_ptr, ao_ptr,
                H, W, RAWCAP, M, TOPK, RS, qscale,
                D: tl.constexpr, HB: tl.constexpr, BR: tl.constexpr,
                COMP: tl.constexpr, SEL: tl.constexpr, SINGLE: tl.constexpr, KEXACT: tl.constexpr,
                F16: tl.constexpr = False, DP: tl.constexpr = 0):
    """Heads [hg·HB, +HB) of query t over its candidate rows [sp·RS, +RS): the raw window
    (positions max(0, p−W+1)..p, ring rows) then the visible (COMP) or selected (SEL) compressed
    rows. K = V. SINGLE: all rows in one program, sink included, normalised output; otherwise
    the running max, sum and unnormalised output of this split for attn_combine_kernel.

    F16 (needs KEXACT: cache rows that are f16 values): both products on fp16 tensor cores with
    the rows as exact fp16 operands and the other side in two fp16 terms (_hi_lo): q scaled per
    head by a power of two (_pow2_scale), the probabilities p <= 1 by 2^15, both undone exactly
    afterwards. That holds each term to 2^-22 of itself (of its head's largest q entry for q),
    as the tf32 pairs of the other path do, at twice their tensor-core rate and half their
    shared memory.

    DP: D padded to a power of two (0: D is one); the pad is zero in q and in the rows, so it
    adds nothing to a score, and is never stored."""
    t = tl.program_id(0)
    hg = tl.program_id(1)
    sp = tl.program_id(2)
    nsp = tl.num_programs(2)
    pos = tl.load(pos_ptr) + t
    lo = tl.maximum(pos - W + 1, 0)
    nraw = pos - lo + 1
    ncomp = 0
    if COMP:
        if SEL:
            ncomp = tl.load(cnt_ptr + t)
        else:
            ncomp = (pos + 1) // M
    R = nraw + ncomp
    start = sp * RS
    end = tl.minimum(R, start + RS)
    h = hg * HB + tl.arange(0, HB)
    hm = h < H
    DA: tl.constexpr = D if DP == 0 else DP
    d = tl.arange(0, DA)
    dm = d[None, :] < D
    q = tl.load(q_ptr + (t * H + h[:, None]).to(tl.int64) * D + d[None, :], mask=hm[:, None] & dm, other=0.0)
    m_i = tl.full([HB], _NEG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, DA], tl.float32)
    if F16:
        q_s, q_inv = _pow2_scale(tl.max(tl.abs(q), axis=1))
        q_hi, q_lo = _hi_lo(q * q_s[:, None])
    for r0 in range(start, end, BR):
        r = r0 + tl.arange(0, BR)
        rm = r < end
        is_raw = r < nraw
        raw_row = ((lo + r) % RAWCAP).to(tl.int64)
        ci = r - nraw
        if SEL:
            crow = tl.load(sel_ptr + t.to(tl.int64) * TOPK + ci, mask=rm & (~is_raw), other=0).to(tl.int64)
        else:
            crow = ci.to(tl.int64)
        if COMP:
            rowp = tl.where(is_raw, raw_ptr + raw_row * D, comp_ptr + crow * D)
        else:
            rowp = raw_ptr + raw_row * D
        k = tl.load(rowp[:, None] + d[None, :], mask=rm[:, None] & dm, other=0.0)
        if F16:
            k16 = k.to(tl.float16)  # exact: the rows are f16 values
            s = (_dot16(q_hi, q_lo, k16, tl.zeros([HB, BR], tl.float32)) * q_inv[:, None]) / qscale
        else:
            s = _dot_f32(q, tl.trans(k), tl.zeros([HB, BR], tl.float32), KEXACT) / qscale
        s = tl.where(rm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if F16:  # acc holds 2^15 times the output until the end
            p_hi, p_lo = _hi_lo(p * 32768.0)
            acc = _dot16(p_hi, p_lo, tl.trans(k16), acc * alpha[:, None])
        else:
            acc = _dot_f32(p, k, acc * alpha[:, None], KEXACT)
        m_i = m_new
    if F16:
        acc = acc * (1.0 / 32768.0)
    if SINGLE:
        sink = tl.load(sink_ptr + h, mask=hm, other=0.0)
        mx = tl.maximum(m_i, sink)
        f = tl.exp(m_i - mx)
        den = l_i * f + tl.exp(sink - mx)
        o = acc * (f / den)[:, None]
        tl.store(ao_ptr + (t * H + h[:, None]).to(tl.int64) * D + d[None, :], o, mask=hm[:, None] & dm)
    else:
        pb = (t * nsp + sp) * H + h
        tl.store(mo_ptr + pb, m_i, mask=hm)
        tl.store(lo_ptr + pb, l_i, mask=hm)
        tl.store(ao_ptr + pb[:, None].to(tl.int64) * D + d[None, :], acc, mask=hm[:, None] & dm)


@triton.jit
def attn_combine_kernel(mo_ptr, lo_ptr, ao_ptr, sink_ptr, freq_ptr, pos_ptr, out_ptr, H, qw_ptr, qs_ptr, qsum_ptr,
                        S: tl.constexpr, SP: tl.constexpr, D: tl.constexpr, NROT: tl.constexpr,
                        ROPE_INV: tl.constexpr, BI: tl.constexpr, XQ8: tl.constexpr = False,
                        DEP: tl.constexpr = False):
    """Merge the S splits of one (query, head) with the sink, for the pairs [BI·program, +BI) of
    the head (grid axis 2: one program per head left most SMs idle, 10 µs for the 20 splits of
    a decode query over top-k rows); optionally the inverse tail RoPE. XQ8 (2·BI a multiple of
    32): the result also in XQ8 form (qw_ptr, qs_ptr, qsum_ptr: a token's H·D values a row), for
    the output projection's decoder 309. DEP: as matvec_xq_kernel."""
    if DEP:
        gdc_launch_dependents()
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SP)
    spm = sp < S
    pb = (t * S + sp) * H + h
    ms = tl.load(mo_ptr + pb, mask=spm, other=_NEG)
    ls = tl.load(lo_ptr + pb, mask=spm, other=0.0)
    sink = tl.load(sink_ptr + h)
    mx = tl.maximum(tl.max(ms, axis=0), sink)
    f = tl.exp(ms - mx)
    den = tl.sum(ls * f, axis=0) + tl.exp(sink - mx)
    i = tl.program_id(2) * BI + tl.arange(0, BI)
    im = i < D // 2  # (the last program's pairs past D / 2, where BI does not divide them)
    ab = ao_ptr + pb[:, None].to(tl.int64) * D + 2 * i[None, :]
    lm = spm[:, None] & im[None, :]
    xe = tl.sum(tl.load(ab, mask=lm, other=0.0) * f[:, None], axis=0) / den
    xo = tl.sum(tl.load(ab + 1, mask=lm, other=0.0) * f[:, None], axis=0) / den
    if ROPE_INV:
        k = i - (D - NROT) // 2
        km = (k >= 0) & im
        pos = tl.load(pos_ptr) + t
        theta = pos.to(tl.float32) * tl.load(freq_ptr + k, mask=km, other=0.0)
        c = _cos(theta)
        s = -_sin(theta)
        ne = tl.where(km, xe * c - xo * s, xe)
        no = tl.where(km, xe * s + xo * c, xo)
        xe = ne
        xo = no
    ob = out_ptr + (t * H + h).to(tl.int64) * D + 2 * i
    tl.store(ob, xe, mask=im)
    tl.store(ob + 1, xo, mask=im)
    if XQ8:
        NBLK: tl.constexpr = 2 * BI // 32
        hd = H * D
        v = tl.reshape(tl.join(xe, xo), [NBLK, 32])  # the values 2i, 2i + 1 in order
        _xq_store(v, qw_ptr + t * (hd // 2), qs_ptr + t * (hd // 32), qsum_ptr + t * (hd // 16),
                  (h * D + 2 * BI * tl.program_id(2)) // 32, tl.arange(0, NBLK) < NBLK, True)


# ---- greedy decoding on the device ----------------------------------------------------------------


@triton.jit
def greedy_next_kernel(logits_ptr, V, best_ptr, at_ptr, cnt_ptr, top_ptr, tok_ptr, pos_ptr, ring_ptr,
                       R: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr):
    """The token a decode step chooses greedily, without the host: the first index of the largest
    finite logit (sampling.argmax's rule; NaN and ±inf are never chosen). With sample_next_kernel
    after it, the last kernels of a captured decode step.

    Each of the grid's programs takes BLOCK logits and leaves its best (best, at); the last to
    arrive (a ticket in cnt) picks among the G of them. The token goes where the next replay of the
    step reads it (tok), into ring[p0 % R] for the host (pinned host memory on the GPU), and the
    position p0 advances by one; the largest logit goes to top for the sampler. With no finite
    logit ring gets -1 and tok 0, so that a step queued behind this one still reads a valid
    embedding row."""
    g = tl.program_id(0)
    o = g * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(logits_ptr + o, mask=o < V, other=float("-inf"))
    ok = (o < V) & (tl.abs(v) < float("inf"))  # (NaN fails the comparison)
    v = tl.where(ok, v, float("-inf"))
    top = tl.max(v, axis=0)
    tl.store(best_ptr + g, top)
    tl.store(at_ptr + g, tl.min(tl.where(ok & (v == top), o, V), axis=0))  # V: none here
    if _split_last(cnt_ptr, 0, G):
        j = tl.arange(0, G)
        tops = tl.load(best_ptr + j, cache_modifier=".cg")
        ats = tl.load(at_ptr + j, cache_modifier=".cg")
        top = tl.max(tops, axis=0)
        first = tl.min(tl.where((tops == top) & (ats < V), ats, V), axis=0)
        none = first >= V
        p0 = tl.load(pos_ptr)
        tl.store(ring_ptr + p0 % R, tl.where(none, -1, first))
        tl.store(tok_ptr, tl.where(none, 0, first))
        tl.store(top_ptr, top)
        tl.store(pos_ptr, p0 + 1)
        _split_reset(cnt_ptr, 0)


@triton.jit
def _min_p_weights(logits_ptr, o, V, top, temp, min_p):
    """ds4's default sampling path (sampling._sample_min_p) in float64: p = exp((l - l_max) / T),
    0 where the logit is not finite or p < min_p."""
    v = tl.load(logits_ptr + o, mask=o < V, other=0.0)
    ok = (o < V) & (tl.abs(v) < float("inf"))
    p = tl.exp((v.to(tl.float64) - top.to(tl.float64)) / temp)
    return tl.where(ok & (p >= min_p), p, 0.0)


@triton.jit
def sample_next_kernel(logits_ptr, V, mass_ptr, cnt_ptr, top_ptr, tok_ptr, pos_ptr, ring_ptr, draw_ptr,
                       R: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr):
    """The token a decode step draws on ds4's default sampling path, after greedy_next_kernel
    (which advanced the position to p0 + 1 and left the largest logit in top).

    draw[p0 % R] holds (T, min_p, U), copied in by the host ahead of the step, and T goes back to
    0 once the step has read it; T <= 0 keeps greedy's token. Otherwise, as
    sampling._sample_min_p does in float64: the kept weights p_i (min-p relative to the best,
    p_best = 1), r = U·Σp, and the first token in id order whose running sum reaches r. Each
    program sums its BLOCK weights; the last to arrive finds the block where the running sum of
    the G sums reaches r and scans it. The sums run in another order than numpy's cumsum, so a
    draw within ~1e-15 of a boundary between two tokens may pick the other one."""
    slot = (tl.load(pos_ptr) - 1) % R
    temp = tl.load(draw_ptr + 3 * slot)
    top = tl.load(top_ptr)
    g = tl.program_id(0)
    finite = tl.abs(top) < float("inf")
    if (temp > 0) & (g == 0) & (finite == 0):  # no token to draw: greedy's -1 stays
        tl.store(draw_ptr + 3 * slot, 0.0)
    if (temp > 0) & finite:
        min_p = tl.load(draw_ptr + 3 * slot + 1)
        p = _min_p_weights(logits_ptr, g * BLOCK + tl.arange(0, BLOCK), V, top, temp, min_p)
        tl.store(mass_ptr + g, tl.sum(p, axis=0))
        if _split_last(cnt_ptr, 0, G):
            j = tl.arange(0, G)
            mass = tl.load(mass_ptr + j, cache_modifier=".cg")
            run = tl.cumsum(mass, axis=0)
            r = tl.load(draw_ptr + 3 * slot + 2) * tl.sum(mass, axis=0)
            # the first block with weight whose running sum reaches r (the last block with
            # weight if rounding leaves r above them all)
            c = tl.min(tl.where((mass > 0) & (run >= r), j, G), axis=0)
            c = tl.where(c < G, c, tl.max(tl.where(mass > 0, j, 0), axis=0))
            before = tl.sum(tl.where(j < c, mass, 0.0), axis=0)
            o = c * BLOCK + tl.arange(0, BLOCK)
            p = _min_p_weights(logits_ptr, o, V, top, temp, min_p)
            cum = before + tl.cumsum(p, axis=0)
            pick = tl.min(tl.where((p > 0) & (cum >= r), o, V), axis=0)
            pick = tl.where(pick < V, pick, tl.max(tl.where(p > 0, o, 0), axis=0))
            tl.store(ring_ptr + slot, pick)
            tl.store(tok_ptr, pick)
            tl.store(draw_ptr + 3 * slot, 0.0)  # (every program has read T: it took its ticket after)
            _split_reset(cnt_ptr, 0)
