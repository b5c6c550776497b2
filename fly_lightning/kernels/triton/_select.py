"""Small-k selection along the rows of a register tile, shared by the ``topk`` and ``moe_route`` kernels.

Tile shape. A tile of ``ROWS`` rows is held as ``[G, LG, ROWS, C, VEC]``: column ``g * SG + (c * LG + lg) * VEC + v``
(``SG`` columns per group; ungrouped: ``G = 1``, ``SG`` = the row length). Loaded this way, Triton gives each thread
one 16-byte vector per chunk and puts the ``G * LG`` lanes of a row next to each other, so each thread holds
``C * VEC`` elements of a row in registers and a row reduction needs only ``log2(G * LG)`` shuffle stages. (A plain
``[ROWS, E]`` tile spreads a 128-wide bf16 row over 16 lanes: 4 shuffle stages per step and per-row work replicated 16
times.) Elements beyond the row (``valid`` false) are padding.

Keys. Values are ranked through int32 keys whose signed order is the float order, with -0.0 == +0.0 and every NaN
(any sign or payload) above +inf, as ``torch.topk`` ranks NaN. sm_90 issues integer compare/min/max at half the fp32
rate, so each form is costed in operations per element and step:

- Packed keys, for values that come from bf16/fp16 (the logits themselves): ``(key16 + bias) * CB + CB-1-col``,
  unique per row, positive, padding 0. Selection by *descent*: step 0 is a row max; step j takes the largest key below
  the previous winner as ``prev + umax(key - prev)`` (keys at or above ``prev`` wrap to small unsigned values): one
  fused subtract-max per element, no marking; the chosen ones are ``key >= last winner``. Ties go to the lower column
  (it is in the low bits); the winner's column and value decode from its key.
- Relative packed keys, for fp32 values (scores, biased scores, fp32 logits): the exact int32 key's distance below
  the row's largest key (in ulps), exact up to ``NEAR = 2**(30 - log2(CB))`` ulps (2**22 for 256 columns: from 2.5
  down to about 1.75, say) and compressed beyond it, ``4 * CB`` ulps to a step, so every distance fits (across binades
  and zero too), packed the same way: ``(LIMIT - distance) * CB + CB-1-col`` with ``LIMIT = 2**(31 - log2(CB)) - 1``.
  The same descent applies. The order is exact unless two of the chosen keys, or the last chosen and the next, share
  a compressed step (``coarse_tie``; their order by value is unknown there): then the tile is redone with exact keys.
  (A plain clamp at LIMIT, as before, sent every tile whose chosen scores spanned a few binades or crossed zero
  through that second pass: 1.8-2.4x the time on such inputs, ``moe_route_spread_2c62ad9.md``.)
- Marked packed keys (either kind, when each chosen element's rank is needed in place): a row max, then the winner is
  replaced by ``INT_MIN + j``, so ``key - INT_MIN`` is its rank. Three operations.
- Exact keys (the fallback): a row max, a min over the columns holding it (ties -> lower column), and marking the
  winner with ``INT_MIN + j``. About five operations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 16  # marks INT_MIN + j, j < 16, stay below every key and padding
INT_MIN = tl.constexpr(-(2**31))
PAD = tl.constexpr(-(2**31) + MAX_K)  # exact-key padding
BF16_INF = tl.constexpr(0x7F80)
FP16_INF = tl.constexpr(0x7C00)


@triton.jit
def tile_cols(
    G: tl.constexpr, LG: tl.constexpr, C: tl.constexpr, VEC: tl.constexpr, SG: tl.constexpr, NG: tl.constexpr
):
    """Column index ``[G, LG, 1, C, VEC]`` of each tile position and whether it is a real column."""
    g = tl.arange(0, G)[:, None, None, None, None]
    lg = tl.arange(0, LG)[None, :, None, None, None]
    c = tl.arange(0, C)[None, None, None, :, None]
    v = tl.arange(0, VEC)[None, None, None, None, :]
    w = (c * LG + lg) * VEC + v  # position inside the group
    if SG == C * LG * VEC and G == NG:  # no padding: a constant mask the compiler folds away
        return g * SG + w, tl.full([G, LG, 1, C, VEC], 1, tl.int1)
    return g * SG + w, (w < SG) & (g < NG)


@triton.jit
def rows5(x):
    """``[ROWS]`` -> ``[1, 1, ROWS, 1, 1]``."""
    return x[None, None, :, None, None]


@triton.jit
def row_max(x):
    return tl.max(tl.max(tl.max(tl.max(x, axis=4), axis=3), axis=1), axis=0)


@triton.jit
def row_min(x):
    return tl.min(tl.min(tl.min(tl.min(x, axis=4), axis=3), axis=1), axis=0)


@triton.jit
def row_sum(x):
    return tl.sum(tl.sum(tl.sum(tl.sum(x, axis=4), axis=3), axis=1), axis=0)


@triton.jit
def float_key(v):
    """fp32 -> int32 in the same order: -0.0 and +0.0 -> 0, every NaN -> 0x7F800001 (above +inf)."""
    s = v.to(tl.int32, bitcast=True)
    mag = s & 0x7FFFFFFF
    key = tl.where(s <= -0x800000, -mag, mag)  # negative and not NaN (NaN magnitudes exceed 0x7F800000)
    return tl.minimum(key, 0x7F800001)


@triton.jit
def key_float(key):
    """Inverse of ``float_key`` (NaN comes back as a NaN)."""
    b = tl.where(key < 0, (-key) | INT_MIN, key)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def half_key(x, INF16: tl.constexpr):
    """bf16/fp16 tensor -> int32 in ``[-INF16, INF16 + 1]``, same order, -0 == +0, every NaN -> INF16 + 1."""
    s = x.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended bits
    mag = s & 0x7FFF
    key = tl.where(s <= INF16 - 32768, -mag, mag)  # negative and not NaN
    return tl.minimum(key, INF16 + 1)


@triton.jit
def packed_keys(x, col, valid, INF16: tl.constexpr, CB: tl.constexpr):
    """Unique positive keys of a bf16/fp16 tile, 0 on padding (CB: a power of two above every column)."""
    low = (INF16 + 1) * CB + (CB - 1) - col  # per position, loop-invariant: one multiply-add per element
    return tl.where(valid, half_key(x, INF16) * CB + low, 0)


@triton.jit
def relative_keys(key, col, CB: tl.constexpr):
    """Exact keys -> unique non-negative keys relative to each row's largest, the distance compressed beyond ``NEAR``
    ulps (see the module docstring)."""
    LIMIT: tl.constexpr = (2**31) // CB - 1
    NEAR: tl.constexpr = (2**30) // CB
    STEP: tl.constexpr = 4 * CB
    top = row_max(key)
    dist = (rows5(top) - key).to(tl.uint32, bitcast=True)  # < 2**32: keys lie in [INT_MIN, 0x7F800001]
    # exact below NEAR, then one step per STEP ulps: monotone, and the largest (2**32 - 1) still fits under LIMIT
    dist = tl.minimum(dist, dist // STEP + (NEAR - NEAR // STEP)).to(tl.int32, bitcast=True)
    return (LIMIT - dist) * CB + ((CB - 1) - col)


@triton.jit
def coarse(m, CB: tl.constexpr):
    """Whether relative key ``m`` lies in the compressed range (beyond NEAR ulps below its row's best)."""
    LIMIT: tl.constexpr = (2**31) // CB - 1
    NEAR: tl.constexpr = (2**30) // CB
    return m // CB <= LIMIT - NEAR


@triton.jit
def coarse_tie(a, b, CB: tl.constexpr):
    """Whether relative keys ``a`` and ``b`` share one compressed step: their order by value is unknown."""
    return (a // CB == b // CB) & coarse(a, CB)


@triton.jit
def order_unknown(key, m, tie, row_ok, K: tl.constexpr, MARKED: tl.constexpr, CB: tl.constexpr):
    """After K descent or marking steps over relative keys (``m``: each row's last winner; ``tie``: rows where two
    chosen keys share a compressed step): whether any row of the tile has an order by value that the keys do not
    know, the last chosen key and the next one included. The next key is looked up only in tiles where some last
    chosen key lies in the compressed range. ``MARKED``: the chosen keys were marked (they lie below every other)."""
    gate = tl.max((row_ok & (tie | coarse(m, CB))).to(tl.int32))
    unknown = gate < 0
    if gate > 0:
        if MARKED:
            nxt = row_max(key)
        else:
            nxt = descent_step(key, m, K)
        unknown = tl.max((row_ok & (tie | coarse_tie(nxt, m, CB))).to(tl.int32)) > 0
    return unknown


@triton.jit
def packed_col(m, CB: tl.constexpr):
    return (CB - 1) - (m & (CB - 1))


@triton.jit
def packed_decode(m, INF16: tl.constexpr, HALF: tl.constexpr, CB: tl.constexpr):
    """Packed key -> (column, fp32 value)."""
    col = (CB - 1) - (m & (CB - 1))
    key = (m // CB) - (INF16 + 1)
    b = tl.where(key < 0, (-key) | 0x8000, key)
    return col, b.to(tl.int16).to(HALF, bitcast=True).to(tl.float32)


@triton.jit
def descent_step(key, prev, j: tl.constexpr):
    """Largest packed key of each row below ``prev`` (step 0: the largest)."""
    if j == 0:
        return row_max(key)
    d = (key - rows5(prev)).to(tl.uint32, bitcast=True)  # keys >= prev wrap to small values
    return prev + row_max(d).to(tl.int32, bitcast=True)


@triton.jit
def marked_step(key, j: tl.constexpr):
    """Packed keys: (key with each row's max marked ``INT_MIN + j``, the max)."""
    m = row_max(key)
    return tl.where(key == rows5(m), INT_MIN + j, key), m


@triton.jit
def exact_step(key, col, j: tl.constexpr, CB: tl.constexpr):
    """Exact keys: (key with the winner marked ``INT_MIN + j``, winner column, winner key)."""
    m = row_max(key)
    idx = row_min(tl.where(key == rows5(m), col, CB))
    return tl.where(col == rows5(idx), INT_MIN + j, key), idx, m


def float_key_host(values: torch.Tensor) -> torch.Tensor:
    """Host copy of ``float_key`` (int64), for tests and probes."""
    s = values.float().view(torch.int32).long()
    mag = s & 0x7FFFFFFF
    return torch.where(s <= -0x800000, -mag, mag).clamp(max=0x7F800001)


def relative_distance(values: torch.Tensor, cb: int) -> torch.Tensor:
    """Host copy of ``relative_keys``' distance (int64, per row of fp32 values): each value's distance in ulps below
    its row's best, exact up to NEAR and compressed beyond, as the kernels rank it (for tests and probes)."""
    key = float_key_host(values)
    dist = key.max(-1, keepdim=True).values - key
    near, step = 2**30 // cb, 4 * cb
    return torch.minimum(dist, dist // step + near - near // step)
