"""Shared Triton helpers: scalar loads and conversions, the fp8/QAT activation roundings,
exact float32 products, and the generic block decoders `_wtile` / `_wint` / `_dot_units`.

Importing this module also patches the Triton interpreter (TRITON_INTERPRET=1) once.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ..formats import Decoder, KernelType
from .rules import rules

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
        # thrash on a busy CI machine with few cores).
        import dataclasses as _dc

        _ti.interpreter_builder.options = _dc.replace(_ti.interpreter_builder.options,
                                                      sanitize_overflow=False)
        _orig_dot = _ti.InterpreterBuilder.create_dot

        def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            if a.data.dtype == b.data.dtype == d.data.dtype == _np.float32:
                return _ti.TensorHandle(_np.einsum("...ij,...jk->...ik", a.data, b.data) + d.data, d.dtype.scalar)
            return _orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

        _ti.InterpreterBuilder.create_dot = _create_dot

# the kernels' type ids as plain ints (formats.KernelType; Q8C: Q8_0 rows in 256-value chunks)
F32, F16, Q8_0, Q2_K, Q4_K, IQ2_XXS, BF16, Q8C = (int(t) for t in (
    KernelType.F32, KernelType.F16, KernelType.Q8_0, KernelType.Q2_K, KernelType.Q4_K, KernelType.IQ2_XXS,
    KernelType.BF16, KernelType.Q8C))
# the same ids as constexprs for the kernels' TYPE tests (Triton reads only constexpr globals in
# @triton.jit code), and the specialised decoders (formats.Decoder)
T_F32, T_F16, T_BF16, T_Q8_0, T_Q2_K, T_Q4_K, T_Q8C = (tl.constexpr(t) for t in (F32, F16, BF16, Q8_0, Q2_K, Q4_K, Q8C))
D_Q2_K_UNROLLED, D_Q2_K_XQ, D_Q2S_HALVES_XQ = (tl.constexpr(int(d)) for d in (
    Decoder.Q2_K_UNROLLED, Decoder.Q2_K_XQ, Decoder.Q2S_HALVES_XQ))
D_IQ2_UNROLLED, D_IQ2_GROUPS, D_IQ2_GROUPS_SMEM, D_IQ2_GROUPS_XQ = (tl.constexpr(int(d)) for d in (
    Decoder.IQ2_UNROLLED, Decoder.IQ2_GROUPS, Decoder.IQ2_GROUPS_SMEM, Decoder.IQ2_GROUPS_XQ))
D_Q8C_FLOAT, D_Q8C_XQ8 = tl.constexpr(int(Decoder.Q8C_FLOAT)), tl.constexpr(int(Decoder.Q8C_XQ8))
# values per unit (values sharing one scale) in the decoded tiles
UNIT = {F32: 32, F16: 32, BF16: 32, Q8_0: 32, Q2_K: 16, Q4_K: 32, IQ2_XXS: 8, Q8C: 32}

_NEG = tl.constexpr(-1.0e30)  # "minus infinity" for running maxima (exp(_NEG - m) == 0, never NaN)


# ------------------------------------------------------------------------------------------------
# small helpers


# libdevice's cosf / sinf reduce |x| up to here by a few fused multiply-adds, beyond it by the
# slow path (Payne-Hanek over the bits of 2/π); RoPE angles pos·freq pass it past position 105615
FAST_TRIG_LIMIT = tl.constexpr(105615.0)
_TWO_PI = tl.constexpr(6.283185307179586)
_INV_TWO_PI = tl.constexpr(0.15915494309189535)


@triton.jit
def _cos_sin(x):
    """(cos x, sin x) of float32 angles x (θ = pos·freq: up to 10⁶ rad at long contexts), with an
    accurate range reduction. Where some |x| of the tensor passes FAST_TRIG_LIMIT the angles are
    reduced by 2π in float64 (to ~1e-9 rad for |x| < 10⁷) and take float64 cos / sin
    (libdevice's on a GPU) rounded to float32, instead of every lane waiting on float32's slow
    path; the interpreter runs the same steps. Below it, float32 libdevice as before."""
    if tl.max(tl.abs(x)) > FAST_TRIG_LIMIT:  # (the interpreter takes this path too)
        xd = x.to(tl.float64)
        r = xd - tl.floor(xd * _INV_TWO_PI + 0.5) * _TWO_PI
        c = tl.cos(r).to(tl.float32)  # (float64: libdevice's cos / sin, not the approximations)
        s = tl.sin(r).to(tl.float32)
    elif _INTERP:
        c = tl.cos(x)
        s = tl.sin(x)
    else:
        c = libdevice.cos(x)
        s = libdevice.sin(x)
    return c, s


@triton.jit
def _tail_rope(xe, xo, i, im, pos, freq_ptr, D: tl.constexpr, NROT: tl.constexpr, INVERSE: tl.constexpr):
    """The tail RoPE at position pos of the pairs i (mask im) of a D-value row, xe / xo their
    even / odd values (i broadcasts against them): the pairs of the last NROT dims rotate by
    pos·freq, the others pass unchanged; INVERSE rotates back."""
    k = i - (D - NROT) // 2
    km = (k >= 0) & im
    theta = pos.to(tl.float32) * tl.load(freq_ptr + k, mask=km, other=0.0)
    c, s = _cos_sin(theta)
    if INVERSE:
        s = -s
    ne, no = rules.rope_rotate(xe, xo, c, s)
    return tl.where(km, ne, xe), tl.where(km, no, xo)


@triton.jit
def _ld_f16(wh, byte_off, mask):
    return tl.load(wh + byte_off // 2, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_lo(w):
    """The fp16 in the low 16 bits of the integer w (higher bits ignored), as float32."""
    return (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _ld4(p, INT: tl.constexpr = False, NC: tl.constexpr = True):
    """The 4 floats at p (16-byte aligned) as 4 tensors shaped like p: one 16-byte load per
    element instead of four 4-byte ones. In the routed decoders a warp's lanes walk different
    groups of x, so every load of x touches a sector per lane; this issues a quarter of those
    requests for the same sectors. INT: 4 int32
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


_IQ2_SIGN_FIELD = tl.constexpr(0x01111111)  # an entry's 7 stored signs, interleaved (layout.py): bit 4·i
_IQ2_NIBBLE_SUM = tl.constexpr(0x11111111)  # × this sums the nibbles into the top one
_IQ2_SIGN_AT2 = tl.constexpr(0x04444444)  # the 7 stored signs at bit 2 of nibbles 0-6
_IQ2_PARITY_AT2 = tl.constexpr(0x40000000)  # the 8th sign, at bit 2 of nibble 7


@triton.jit
def _iq2_signs(aux, sub: tl.constexpr):
    """The 8 signs of grid entry sub of an IQ2_XXS group at bit 2 of 8 nibbles (the sign bit of
    the level selectors _iq2_lut takes), from the group's u32 in IQ2S (layout.py: its 7 stored
    signs at bits 4·i + sub; the 8th is their parity). One shift and a mask put the 7 at bits
    4·i + 2; multiplying by 0x11111111 sums the nibbles into the top one: 4 × (the number of
    signs set), plus at most 1 carried up from the partial sums below, so that nibble's bit 2 is
    the parity, already in its place."""
    if sub <= 2:
        m = (aux << (2 - sub)) & _IQ2_SIGN_AT2
    else:
        m = (aux >> (sub - 2)) & _IQ2_SIGN_AT2
    return m | ((m * _IQ2_NIBBLE_SUM) & _IQ2_PARITY_AT2)


@triton.jit
def _iq2_sign_index(aux, sub: tl.constexpr):
    """GGUF's 7-bit sign index of grid entry sub (the ksigns tables' row) from the group's u32 in
    IQ2S, its bits gathered back from 4·i (for the generic decoders)."""
    m = (aux >> sub) & _IQ2_SIGN_FIELD
    m = (m | (m >> 3)) & 0x03030303
    m = (m | (m >> 6)) & 0x000F000F
    return (m | (m >> 12)) & 0x7F


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
def _cache_rows(x, NN: tl.constexpr):
    """Attention cache rows x [R, D] as numerics "ds4" stores them: the FP8 round trip of dims
    [0, NN), then every value rounded to f16 (spec §3.4 steps 5-6, §3.5)."""
    if NN > 0:
        x = _fp8_rows(x, NN)
    return _f16_round(x)


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
def _dot16(xh, xl, w, acc, LO: tl.constexpr = True):
    """acc + (xh + xl)·wᵀ with float32 accumulation, the smaller term first. The fp16 products
    are exact (11 × 11 significant bits), so only the accumulation rounds. LO False: xh alone (x
    rounded once to fp16, the "f16" prefill precision; xl is not read)."""
    if _INTERP:  # the interpreter's fp16 products are not trustworthy: the same terms in float32
        wt = tl.trans(w.to(tl.float32))
        if LO:
            acc = tl.dot(xl.to(tl.float32), wt, acc, input_precision="ieee")
        acc = tl.dot(xh.to(tl.float32), wt, acc, input_precision="ieee")
    else:
        wt = tl.trans(w)
        if LO:
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
    return g * rules.sigmoid(g) * u


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
    if TYPE == T_F32:
        w = tl.load(wf + ro // 4 + u * VB + iv, mask=m, other=0.0)
    elif TYPE == T_F16:
        w = tl.load(wh + ro // 2 + u * VB + iv, mask=m, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    elif TYPE == T_BF16:  # BF16: the top half of a float32
        b = tl.load(wh + ro // 2 + u * VB + iv, mask=m, other=0).to(tl.int32) & 0xFFFF
        w = (b << 16).to(tl.float32, bitcast=True)
    elif TYPE == T_Q8_0:  # Q8_0: f16 d | int8 q[32]
        base = ro + u * 34
        d = _ld_f16(wh, base, m)
        q = tl.load(wb + base + 2 + iv, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = q * d
    elif TYPE == T_Q8C:  # Q8C: the values of block u in K order, gathered from their bytes
        so, qo = _q8c_block(ro, u)
        d = _ld_f16(wh, so, m)
        q = tl.load(wb + qo + (iv % 8) * 4 + iv // 8, mask=m, other=128).to(tl.int32)
        w = (q - 128).to(tl.float32) * d
    elif TYPE == T_Q2_K:  # Q2_K in Q2S (layout.py): qs[64] | scales[16] | f16 d, dmin; unit = 16-value sub-block
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
    elif TYPE == T_Q4_K:  # Q4_K: f16 d | f16 dmin | scales[12] | qs[128]; unit = 32-value sub-block
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
        ks = tl.load(ksigns + _iq2_sign_index(aux, sub))
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
    gathered in K order from memory instead, they made prefill slower."""
    p = tl.arange(0, 32)[None, :]
    if TYPE == T_Q8C:
        so, qo = _q8c_block(row_off, u)
        qb = tl.load(wb + qo[:, None] + p, mask=rmask[:, None], other=128)
        BN: tl.constexpr = qb.shape[0]
        q = tl.reshape(tl.permute(tl.reshape(qb, [BN, 8, 4]), (0, 2, 1)), [BN, 32]).to(tl.int32)
        return _u8f(q) - 128.0, _ld_f16(wh, so, rmask)
    base = row_off + u * 34
    q = _s8f(tl.load(wb + base[:, None] + 2 + p, mask=rmask[:, None], other=0).to(tl.int32))
    return q, _ld_f16(wh, base, rmask)


@triton.jit
def _dot_units(x_ptr, sx_t, tm, mm, k0, wb, wh, row_off, rmask, acc, NU: tl.constexpr, TYPE: tl.constexpr,
               TERMS: tl.constexpr = 3):
    """acc[BM, BN] += x[tm, k0 : k0 + 32·NU] · Wᵀ over NU Q8_0 / Q8C blocks on tensor cores, the
    quants exact as 16-bit floats. TERMS 3 ("bf16x3"): x split exactly into three bf16 terms
    (8 + 8 + 8 significant bits), so each block's product has float32 accuracy before its scale
    is applied. TERMS 1 ("f16"): one product per block on x·s rounded once to fp16 (11 significant
    bits; s a power of two per row and block, _pow2_scale, so no x overflows fp16's range): the
    precision of the activations ds4 itself feeds its GPU prefill products."""
    U: tl.constexpr = 32
    ku = tl.arange(0, U)
    for i in tl.static_range(NU):
        kb = k0 + i * U
        xt = tl.load(x_ptr + tm[:, None].to(tl.int64) * sx_t + kb + ku[None, :], mask=mm[:, None], other=0.0)
        q, sc = _wint(wb, wh, row_off, rmask, kb // U, TYPE)
        if TERMS == 1:
            s, inv = _pow2_scale(tl.max(tl.abs(xt), axis=1))
            x1 = (xt * s[:, None]).to(tl.float16)  # exact scaling, one rounding
            if _INTERP:  # the interpreter's fp16 products are not trustworthy: float32 instead
                p = tl.dot(x1.to(tl.float32), tl.trans(q), input_precision="ieee")
            else:
                p = tl.dot(x1, tl.trans(q.to(tl.float16)))
            p = p * inv[:, None]
        else:
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
