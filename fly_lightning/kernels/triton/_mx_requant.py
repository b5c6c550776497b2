"""MX operands re-expressed as fp8 e4m3 with one fp32 scale per 128 values along K, the layout of cuBLAS's
blockwise-scaled fp8 GEMM on Hopper (``torch._scaled_mm`` with 1x128 scales on both operands, CUDA >= 12.9).

Hopper has fp8 tensor cores but no MX ones; this lets MX x MX GEMMs with many rows run on the fp8 tensor cores
(``mx_scaled_mm``'s ``fp8_blockwise`` plan) instead of dequantising to bf16 first. Each 128-wide group of a row
takes one power-of-two scale ``2^(g - 127)``; every element is its code value times ``2^(s - g)``, ``s`` its own
block's E8M0 scale, rounded to e4m3 (to nearest, ties to even):

- e2m1 elements (two significant bits, at most 6): ``g`` is the largest scale among the group's blocks holding a
  non-zero element, minus 6, so the largest block's values land below 448 (e4m3's largest). Exact when the group's
  non-zero blocks' scales span at most 14; past that a small block's values round on e4m3's subnormal step,
  ``2^(g - 136)``: at most 2^-18 of the group's largest element.
- e4m3 elements: ``g`` is the largest such scale; elements of smaller blocks shift down and round where they fall
  below e4m3's normal range (``2^(g - 133)``): at most 2^-17 of the group's largest element.
- A NaN block (scale 255) decodes to NaN, as in ``formats.from_mx``; all-zero groups take ``g = 0``.

One launch converts both operands (host time, as ``_mx_dequant.dequantize``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fly_lightning.kernels import outputs
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._math import cdiv
from fly_lightning.kernels.triton._mx_dequant import FMT_CODE, _nvidia_capability
from fly_lightning.kernels.triton._support import interpreting, on_device
from fly_lightning.quant import formats

FORMATS = ("mxfp8_e4m3", "mxfp4_e2m1")
"""Element formats re-expressed exactly enough here (e5m2's range does not fit e4m3's)."""
GROUP = 128
ROWS, COLS = 16, 512  # per program: 8K elements, as the dequantising prepass


@triton.jit
def _load(DATA, rows64, rmask, cb, stride_d, C, FMT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """The tile's raw bytes ([BR, BC / 2] e2m1 pairs or [BR, BC] e4m3) and whether each 32-block holds a non-zero
    element ([BR * BC / 128, 4]; NaN codes count), read off the magnitude bits."""
    G: tl.constexpr = BC // 128
    if FMT == 3:
        half = cb * (BC // 2) + tl.arange(0, BC // 2)
        raw = tl.load(DATA + rows64[:, None] * stride_d + half[None, :], mask=rmask & (half[None, :] < C // 2), other=0)
        live = tl.max(tl.reshape(raw & 0x77, (BR * G, 4, 16)), axis=2) > 0
    else:  # e4m3 data as it is (no byte view on the host), read as its bits; masked lanes are never stored
        cols = cb * BC + tl.arange(0, BC)
        raw = tl.load(DATA + rows64[:, None] * stride_d + cols[None, :], mask=rmask & (cols[None, :] < C))
        raw = raw.to(tl.uint8, bitcast=True)
        live = tl.max(tl.reshape(raw & 0x7F, (BR * G, 4, 32)), axis=2) > 0
    return raw, live


@triton.jit
def _values_f32(raw, FMT: tl.constexpr, BC: tl.constexpr):
    """The codes as fp32 values, unscaled ([BR, BC]); NaN for e4m3's NaN codes (the interpreter's path: numpy keeps
    fp32 subnormals)."""
    x = raw.to(tl.int32)
    if FMT == 3:
        c = tl.reshape(tl.join(x & 0xF, x >> 4), (x.shape[0], BC))  # element 2j in the low nibble
        e = (c >> 1) & 3
        m = c & 1
        bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))  # 0, 0.5; (1 + m / 2) * 2^(e - 1)
        v = (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)
    else:  # exponent at fp32's with bias 7, then the missing 2^120
        mag = x & 0x7F
        v = (((x & 0x80) << 24) | (mag << 20)).to(tl.float32, bitcast=True) * 2.0**120
        v = tl.where(mag == 0x7F, float("nan"), v)
    return v


@triton.jit
def _values_f16(raw, FMT: tl.constexpr, BC: tl.constexpr):
    """The codes as fp16 values, unscaled ([BR, BC]; the GPU's path: fp16 keeps subnormals in hardware, and e4m3
    converts to it by instruction). e2m1: sign and magnitude bits placed at fp16's (value * 2^-14), then 2^14."""
    if FMT == 3:
        x = raw.to(tl.int32)
        lo = ((x & 0x7) << 9) | ((x & 0x8) << 12)  # element 2j, the low nibble
        hi = ((x & 0x70) << 5) | ((x & 0x80) << 8)
        bits = tl.reshape(tl.join(lo, hi), (x.shape[0], BC)).to(tl.int16)
        v = bits.to(tl.float16, bitcast=True) * tl.full((1, 1), 16384.0, tl.float16)
    else:
        v = raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return v


@triton.jit
def _e4m3_codes(q):
    """fp32 values (|q| <= 448, or NaN) to e4m3fn codes, rounded to nearest, ties to even, in integer steps: the
    interpreter's float8 conversion is not trusted to round (its bf16 one truncates)."""
    u = q.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    mag = u & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)  # 23 -> 3 mantissa bits; carries step exponent
    small = mag < (121 << 23)  # below 2^-6: subnormal (8 steps of 2^-9 are 2^-6 itself, code 8)
    ax = tl.where(small, mag, 0).to(tl.float32, bitcast=True)
    sub = (ax * 512.0 + 8388608.0 - 8388608.0).to(tl.int32)  # to the nearest step, ties to even
    code = tl.where(small, sub, normal)
    return tl.where(mag > 0x7F800000, 0x7F, sign | code)


@triton.jit
def _requant_tile(
    DATA, SCALE, Q, QS, R, C, stride_d, stride_s, stride_q, tile, n_col_tiles,
    FMT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    G: tl.constexpr = BC // 128
    rows = (tile // n_col_tiles) * BR + tl.arange(0, BR)
    cb = tile % n_col_tiles
    live_rows = rows < R
    rmask = live_rows[:, None]
    rows64 = rows.to(tl.int64)
    sb = cb * (BC // 32) + tl.arange(0, BC // 32)
    s = tl.load(SCALE + rows64[:, None] * stride_s + sb[None, :], mask=rmask & (sb[None, :] < C // 32), other=127)
    s3 = tl.reshape(s.to(tl.int32), (BR * G, 4))
    raw, live = _load(DATA, rows64, rmask, cb, stride_d, C, FMT, BR, BC)
    top = tl.max(tl.where(live & (s3 != 255), s3, -1), axis=1)  # -1: nothing non-zero in the group
    if FMT == 3:
        g = tl.maximum(top - 6, 0)
    else:
        g = tl.maximum(top, 0)
    d = tl.minimum(s3 - g[:, None], 6)  # at most 6 where anything is non-zero; all-zero blocks clamped (0 * 2^6)
    if HW_CVT:  # fp16 products: exact down to 2^-21; anything smaller rounds to 0 in e4m3 all the same
        fb = tl.where(d >= -14, (d + 15) << 10, tl.where(d >= -24, 1 << (d + 24).to(tl.int32), 0))
        f = tl.where(s3 == 255, 0x7E00, fb).to(tl.int16).to(tl.float16, bitcast=True)  # 255: NaN
        v3 = tl.reshape(_values_f16(raw, FMT, BC), (BR * G, 4, 32))
        codes = tl.reshape(v3 * f[:, :, None], (BR, BC)).to(tl.float8e4nv)
    else:
        f = tl.where(d >= -126, ((d + 127) << 23).to(tl.float32, bitcast=True), 0.0)  # below: under e4m3's last step
        f = tl.where(s3 == 255, float("nan"), f)
        v3 = tl.reshape(_values_f32(raw, FMT, BC), (BR * G, 4, 32))
        # bytes to a byte view of Q: the interpreter has no bitcast to fp8
        codes = _e4m3_codes(tl.reshape(v3 * f[:, :, None], (BR, BC))).to(tl.uint8)
    cols = cb * BC + tl.arange(0, BC)
    tl.store(Q + rows64[:, None] * stride_q + cols[None, :], codes, mask=rmask & (cols[None, :] < C))
    # group scales, outer-dim-major ([C / 128, R]): 2^(g - 127); g = 0 is 2^-127, an fp32 subnormal
    gbits = tl.where(g > 0, g << 23, 0x00400000).to(tl.float32, bitcast=True)
    i = tl.arange(0, BR * G)
    r = (tile // n_col_tiles) * BR + i // G
    gi = cb * G + i % G
    r_live = tl.reshape(tl.broadcast_to(live_rows[:, None], (BR, G)), (BR * G,))  # r's row: rows[i // G]
    tl.store(QS + gi.to(tl.int64) * R + r, gbits, mask=r_live & (gi < C // 128))


@triton.jit
def _requant_kernel(
    A, A_SCALE, A_Q, A_QS, RA, stride_a, stride_as,
    B, B_SCALE, B_Q, B_QS, RB, stride_b, stride_bs, C,
    A_FMT: tl.constexpr, B_FMT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    """Both operands in one launch: the first ``cdiv(RA, BR) * cdiv(C, BC)`` programs take A's tiles, the rest B's."""
    n_col_tiles = tl.cdiv(C, BC)
    tiles_a = tl.cdiv(RA, BR) * n_col_tiles
    pid = tl.program_id(0)
    if pid < tiles_a:
        _requant_tile(A, A_SCALE, A_Q, A_QS, RA, C, stride_a, stride_as, C, pid, n_col_tiles, A_FMT, BR, BC, HW_CVT)
    else:
        _requant_tile(B, B_SCALE, B_Q, B_QS, RB, C, stride_b, stride_bs, C, pid - tiles_a, n_col_tiles,
                      B_FMT, BR, BC, HW_CVT)  # fmt: skip


_REQUANT = FastLaunch(_requant_kernel)


_CUDA = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])


def available(device: torch.device) -> bool:
    """Whether cuBLAS's blockwise fp8 GEMM serves ``device``: an NVIDIA Hopper (sm90, where it was measured; not
    ROCm, nor the interpreter) with a CUDA build from 12.9 (its 1x128 scaling)."""
    return _CUDA >= (12, 9) and _nvidia_capability(device)[0] == 9


def reference(data: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in plain torch (torch's own float8 rounding), for one operand: ``(e4m3 [R, K], fp32 scales
    [R, K / 128])``, the scales row-major."""
    s = scale.view(torch.uint8).long()
    ones = torch.full_like(s, 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    v = formats.from_mx(data, ones, fmt)  # the codes' values
    r, k = v.shape
    v4, s3 = v.view(r, k // GROUP, 4, 32), s.view(r, k // GROUP, 4)
    live = (v4 != 0).any(-1) & (s3 != 255)
    top = torch.where(live, s3, -1).amax(-1)
    g = (top - 6 if fmt == "mxfp4_e2m1" else top).clamp_min(0)
    d = (s3 - g[..., None]).clamp_max(6)
    f = torch.where(d >= -126, torch.exp2(d.double()), 0.0).float()
    f = torch.where(s3 == 255, float("nan"), f)
    q = (v4 * f[..., None]).view(r, k).to(torch.float8_e4m3fn)
    return q, torch.exp2((g - 127).double()).float()


def requantize(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_fmt: str,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_fmt: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MX ``a`` ``[M, K / per_byte]`` and ``b`` ``[N, ...]`` (formats in ``FORMATS``; K % 128; last dims contiguous)
    to ``(qa [M, K], sa [M, K / 128], qb [N, K], sb [K / 128, N])``: e4m3 elements and fp32 group scales laid out
    as ``torch._scaled_mm(qa, qb.t(), sa, sb)`` takes them (``sa`` outer-dim-major)."""
    for fmt in (a_fmt, b_fmt):
        if fmt not in FORMATS:
            raise ValueError(f"requantize: {fmt} is not one of {FORMATS}")
    m, n, k = a_scale.shape[0], b_scale.shape[0], a_scale.shape[1] * 32
    if k % GROUP or b_scale.shape[1] * 32 != k:
        raise ValueError(f"requantize: K={k} (a) and {b_scale.shape[1] * 32} (b) must agree and divide by {GROUP}")
    groups = k // GROUP
    # one allocation each, the operands' parts as views (host time: each allocation, view or slice costs it)
    q = outputs.empty(m + n, k, dtype=torch.float8_e4m3fn, device=a.device)
    qs = outputs.empty((m + n) * groups, dtype=torch.float32, device=a.device)
    qa, qb = q[:m], q[m:]
    sa, sb = qs.as_strided((m, groups), (1, m)), qs.as_strided((groups, n), (n, 1), m * groups)
    tiles = (cdiv(m, ROWS) + cdiv(n, ROWS)) * cdiv(k, COLS)
    if tiles:
        # e4m3 data goes as it is, e2m1 pairs are bytes already; E8M0 scales cannot be kernel arguments: bytes
        hw = a.is_cuda and not interpreting()
        out_a, out_b = (qa, qb) if hw else (qa.view(torch.uint8), qb.view(torch.uint8))
        with on_device(a):
            _REQUANT(
                (tiles,),
                (a, a_scale.view(torch.uint8), out_a, sa, m, a.stride(0), a_scale.stride(0),
                 b, b_scale.view(torch.uint8), out_b, sb, n, b.stride(0), b_scale.stride(0), k),
                A_FMT=FMT_CODE[a_fmt], B_FMT=FMT_CODE[b_fmt], BR=ROWS, BC=COLS, HW_CVT=hw, num_warps=4,
            )  # fmt: skip
    return qa, sa, qb, sb
