"""Triton MoE routing, registered as the ``triton`` backend of ``moe_route``.

One fused forward kernel, ``_moe_route_fwd``: a persistent grid where each program walks a contiguous range of
``ROWS``-token tiles. Per tile it loads the logits once (as a ``[G, LG, ROWS, C, VEC]`` tile, see ``_select.py``),
computes the ranked values in fp32 (the logits themselves, or ``score + bias`` with node-limited groups applied),
selects the top k by descent over unique packed keys, and stores each step's winning key. A compact ``[ROWS, KP]``
epilogue then decodes ids, computes the gate weights from the unbiased scores (softmax row max and sum, or sigmoid;
renormalised, scaled), and histograms the ids into the program's per-expert tally. Two tails publish the tallies as
``counts_E`` and the inclusive ``offsets_E``, both from a workspace that every launch leaves zeroed for the next:

- packed (rows of up to 128 experts): each program adds one int64 word per expert, ``[1 contributor | tally prefix |
  tally]``, with a relaxed atomic that returns the old word; the program whose add completes an expert's word (all
  programs counted) stores that expert's count and offset and re-zeroes the word. No ticket, nobody waits. With the
  permutation the word carries the count only, and ``_perm_base`` writes the offsets.
- ticket (wider rows, or where the packed fields would overflow): each program adds its tally to an int32
  accumulator, and the last program to finish (a ticket counter) reads the totals, writes counts and offsets and
  re-zeroes the accumulator and the ticket.

No host synchronisation anywhere: the op can be captured in a CUDA graph.

With ``return_permutation`` the selection marks the chosen keys with their rank instead, and the tile also writes
each slot's rank among the program's slots of the same expert (token order) and the program's per-expert counts; two
small kernels turn those into the stable permutation: ``_perm_base`` scans the per-program counts (exclusive, per
expert, plus the expert's start offset) and ``_perm_scatter`` adds that base to each slot's rank and scatters the
slot into the sorted order.

Determinism: the counts are sums of integer atomics, which are exact and commutative, so their result does not depend
on the order the atomics land in; ``torch.use_deterministic_algorithms(True)`` changes nothing here (the outputs are
allocated without its fill, ``written_in_full``: every element is stored). The permutation uses no atomics: ranks
follow token order inside a program and program order across programs.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from fly_lightning.kernels.triton._select import (
    BF16_INF,
    FP16_INF,
    INT_MIN,
    MAX_K,
    PAD,
    block_of,
    cdiv,
    coarse_tie,
    descent_step,
    exact_step,
    float_key,
    key_float,
    marked_step,
    order_unknown,
    packed_col,
    packed_decode,
    packed_keys,
    relative_keys,
    row_max,
    row_sum,
    rows5,
    tile_cols,
)
from fly_lightning.kernels.triton._support import device_reason, interpreting, on_device, written_in_full
from fly_lightning.ops.moe_route import MOE_ROUTE, RENORM_EPS

MAX_E = 1024
# Triton after 3.6 (the H200 image's, where every timing here was taken) lowers this kernel differently. Compiled for
# sm_90 with 3.7.1 (torch 2.13's), 3.8.0 and 3.9.0, the broadcast winner-key store takes Qwen3's shape to 229-255
# registers (with spills on 3.7/3.8), so those use the direct store; the prefetch then still takes it to 166, past the
# 128 that 4 programs of 4 warps per SM allow (tests/kernels/triton/test_moe_route_sm90.py), so it stays off there.
# Both choices are untimed on those versions.
NEWER_TRITON = tuple(int(p) for p in re.match(r"(\d+)\.(\d+)", triton.__version__).groups()) >= (3, 7)
# ROCm: libdevice's fast division is CUDA's (__nv_fast_fdividef), which the AMD backend cannot link: there the fast
# sigmoid is off (tests/kernels/triton/test_moe_route_gfx950.py compiles the biased kernels for gfx950)
ON_HIP = torch.version.hip is not None
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EPS = tl.constexpr(RENORM_EPS)
_MINUS_LOG2E = tl.constexpr(-1.4426950408889634)  # tl.exp(v) is ex2(v * log2(e)): the same product, negated


@triton.jit
def _group_mask(key, G: tl.constexpr, NG: tl.constexpr, TOPK_G: tl.constexpr):
    """Node-limited routing on exact keys: keep each row's TOPK_G best groups (a group scores the sum of its top 2)."""
    m1 = tl.max(tl.max(tl.max(key, axis=4), axis=3), axis=1)  # [G, ROWS]
    is_top = key == m1[:, None, :, None, None]
    n_top = tl.sum(tl.sum(tl.sum(is_top.to(tl.int32), axis=4), axis=3), axis=1)
    m2 = tl.max(tl.max(tl.max(tl.where(is_top, INT_MIN, key), axis=4), axis=3), axis=1)
    m2 = tl.where(n_top > 1, m1, m2)  # the best value twice: top-2 counts it twice, as torch.topk does
    g = tl.arange(0, G)[:, None]
    gkey = tl.where(g < NG, float_key(key_float(m1) + key_float(m2)), INT_MIN)
    chosen = tl.zeros_like(gkey)
    for _ in tl.static_range(TOPK_G):
        gm = tl.max(gkey, axis=0)
        gi = tl.min(tl.where(gkey == gm[None, :], g, G), axis=0)  # ties: lower group first
        hit = g == gi[None, :]
        chosen = tl.where(hit, 1, chosen)
        gkey = tl.where(hit, INT_MIN, gkey)
    return tl.where(chosen[:, None, :, None, None] != 0, key, PAD)


@triton.jit
def _exact_values(
    x,
    bias,
    valid,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SEL_LOGITS: tl.constexpr,
    G: tl.constexpr,
    NG: tl.constexpr,
    TOPK_G: tl.constexpr,
    FAST_SIGMOID: tl.constexpr,
):
    """Exact keys of the values ranked (``score + bias``, or the logits), groups applied; softmax row max and sum.

    ``FAST_SIGMOID``: the sigmoid as ``ex2.approx.ftz`` and ``div.approx.ftz``, where ``1 / (1 + exp(-x))`` compiles
    to ``ex2.approx`` and ``div.full`` with subnormal fix-ups around each (about three more static instructions per
    element: DeepSeek-V3 fp32's loop, two 64-element passes, 6258 -> 5877, ``moe_route_sm90_sass_triton3.6.json``). The
    values are the same bits wherever the sigmoid is a normal float (x > -87.3); below, the score is 0 instead of a
    subnormal. The interpreter has no ``div.approx``: there the plain division."""
    xf = x.to(tl.float32)
    mx = tl.zeros([x.shape[2]], tl.float32)
    z = tl.zeros([x.shape[2]], tl.float32)
    if SEL_LOGITS:  # increasing score functions: ranking the logits ranks the scores
        v = xf
    else:
        if SIGMOID and FAST_SIGMOID:
            v = libdevice.fast_dividef(1.0, 1.0 + tl.math.exp2(xf * _MINUS_LOG2E))
        elif SIGMOID:
            v = 1.0 / (1.0 + tl.exp(-xf))
        else:
            mx = row_max(tl.where(valid, xf, float("-inf")))
            ex = tl.exp(xf - rows5(mx))
            z = row_sum(tl.where(valid, ex, 0.0))
            v = ex * rows5(1.0 / z)
        if HAS_BIAS:
            v = v + bias
    key = tl.where(valid, float_key(v), PAD)
    if TOPK_G > 0:
        key = _group_mask(key, G, NG, TOPK_G)
    return key, mx, z


@triton.jit
def _load_tile(tile, last, X, stride_x, T, col, valid, ROWS: tl.constexpr):
    """The logits of tile ``tile`` as a ``[G, LG, ROWS, C, VEC]`` tile (nothing is read for a tile at or past
    ``last``: the prefetch past a program's range)."""
    rows = tile * ROWS + tl.arange(0, ROWS)
    row_ok = (rows < T) & (rows < last * ROWS)
    x_row = X + rows.to(tl.int64) * stride_x
    return tl.load(rows5(x_row) + col, mask=rows5(row_ok) & valid, other=0.0)


@triton.jit
def _store_step(ptr, v, row_ok, col, DIRECT_STORE: tl.constexpr):
    """Store one selection step's per-row value ``v`` at ``ptr`` (one per row). Triton 3.6 stores the broadcast form
    from the threads holding column 0 without a layout conversion; later versions cannot fold that mask and emit a
    predicated store per element (229-255 registers instead of 128 for Qwen3's shape), so there the row vector is
    stored directly."""
    if DIRECT_STORE:
        tl.store(ptr, v, mask=row_ok)
    else:
        tl.store(rows5(ptr) + col * 0, rows5(v) + col * 0, mask=rows5(row_ok) & (col == 0))


@triton.jit
def _load_keys(tile, W_OUT, T, kk, K: tl.constexpr, ROWS: tl.constexpr):
    """The winning keys ``_route_tile`` stored for ``tile``, as ``[ROWS, KP]``."""
    rows = tile * ROWS + tl.arange(0, ROWS)
    out_ok = (rows < T)[:, None] & (kk < K)[None, :]
    return tl.load(W_OUT.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64)[:, None] * K + kk[None, :], mask=out_ok,
                   other=0)  # fmt: skip


@triton.jit
def _finish_tile(
    tile,
    mk,
    mx,
    z,
    X,
    stride_x,
    W_OUT,
    ID_OUT,
    sel_count,
    T,
    route_scale,
    kk,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    CB: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORM: tl.constexpr,
    SEL_LOGITS: tl.constexpr,
    HALF_KEYS: tl.constexpr,
    INF16: tl.constexpr,
    PERM: tl.constexpr,
):
    """The epilogue of ``tile`` in the compact ``[ROWS, KP]`` layout, from its winning keys ``mk``: ids, gate weights
    (from the unbiased scores: softmax row max ``mx`` and sum ``z``, or sigmoid; renormalised, scaled) and the
    program's per-expert tally."""
    rows = tile * ROWS + tl.arange(0, ROWS)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    out = rows64[:, None] * K + kk[None, :]
    out_ok = row_ok[:, None] & (kk < K)[None, :]
    idx = packed_col(mk, CB)
    tl.store(ID_OUT + out, idx, mask=out_ok)
    if not PERM:
        # padding slots (k < KP, rows past T) go to bin 0 and are taken off again, instead of tl.histogram's mask:
        # with the mask, this kernel's counts came out wrong on the H200 for k=6 (KP=8) in every launch configuration
        # (moe_route_sweep_register_epilogue.md), while the interpreter and a standalone masked histogram
        # (benchmarks/probe_histogram_mask.py) were right; this form measured right everywhere (moe_route_sweep*.md)
        flat_ok = tl.reshape(out_ok, [ROWS * kk.shape[0]])
        flat = tl.where(flat_ok, tl.reshape(idx, [ROWS * kk.shape[0]]), 0)
        n_pad = ROWS * kk.shape[0] - tl.sum(flat_ok.to(tl.int32))
        bins = tl.arange(0, sel_count.shape[0])
        sel_count += tl.histogram(flat, sel_count.shape[0]) - tl.where(bins == 0, n_pad, 0)
    if HALF_KEYS:
        _, val = packed_decode(mk, INF16, X.dtype.element_ty, CB)
    else:  # the chosen logit (exact; in cache)
        val = tl.load(X + rows64[:, None] * stride_x + idx, mask=out_ok, other=0.0).to(tl.float32)
    if SIGMOID:
        w = 1.0 / (1.0 + tl.exp(-val))
    elif SEL_LOGITS and RENORM:  # softmax renormalised over the chosen: exp(x_j - x_top) / their sum
        top = tl.sum(tl.where(kk[None, :] == 0, val, 0.0), axis=1)
        w = tl.exp(val - top[:, None])
    else:
        w = tl.exp(val - mx[:, None]) / z[:, None]
    w = tl.where(out_ok, w, 0.0)
    if RENORM:
        w = w / (tl.sum(w, axis=1) + _EPS)[:, None]
    tl.store(W_OUT + out, w * route_scale, mask=out_ok)
    return sel_count


@triton.jit
def _route_tile(
    t,
    x,
    X,
    stride_x,
    bias,
    W_OUT,
    ID_OUT,
    POS_OUT,
    sel_count,
    carry,
    T,
    route_scale,
    col,
    valid,
    kk,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    G: tl.constexpr,
    NG: tl.constexpr,
    CB: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SEL_LOGITS: tl.constexpr,
    HALF_KEYS: tl.constexpr,
    INF16: tl.constexpr,
    TOPK_G: tl.constexpr,
    PERM: tl.constexpr,
    DIRECT_STORE: tl.constexpr,
    FAST_SIGMOID: tl.constexpr,
):
    """Rank tile ``t`` (``x``: its logits), store each step's winning key into the tile's rows of ``W_OUT`` (raw int32
    bits), then finish the tile from those keys in a compact layout (``_finish_tile``: per-row work is not replicated
    across a row's lanes). Selection: descent without permutation, marking with it (the marks give each chosen element
    its rank in place). Returns the updated tallies and carry.

    (Finishing each tile one step later instead, its keys loaded before the next tile's ranking so that their round
    trip through memory overlaps it, measured slower on every case it applies to: 0.83-0.97x, with and without the
    prefetch, ``moe_route_variants_23207fe.md``.)"""
    rows = t * ROWS + tl.arange(0, ROWS)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    mx = tl.zeros([ROWS], tl.float32)
    z = tl.zeros([ROWS], tl.float32)
    if HALF_KEYS:  # 16-bit logits ranked directly: exact packed keys
        key = packed_keys(x, col, valid, INF16, CB)
    else:
        key32, mx, z = _exact_values(x, bias, valid, SIGMOID, HAS_BIAS, SEL_LOGITS, G, NG, TOPK_G, FAST_SIGMOID)
        if SEL_LOGITS and not SIGMOID and not RENORM:  # softmax over all experts needs the row's sum
            mx = key_float(row_max(key32))
            z = row_sum(tl.where(valid, tl.exp(x.to(tl.float32) - rows5(mx)), 0.0))
        key = relative_keys(key32, col, CB)
    m = tl.zeros([ROWS], tl.int32)
    tie = m != 0  # relative keys: chosen keys whose order by value is unknown (see coarse_tie)
    # the winning keys go through W_OUT as raw int32 bits: a float view would let the GPU canonicalise keys whose bits
    # read as NaN (relative keys near the row max) or flush those that read as denormals
    out_j = W_OUT.to(tl.pointer_type(tl.int32)) + rows64 * K
    for j in tl.static_range(K):
        prev = m
        if PERM:
            key, m = marked_step(key, j)
        else:
            m = descent_step(key, m, j)
        if not HALF_KEYS and j > 0:
            tie = tie | coarse_tie(m, prev, CB)
        _store_step(out_j + j, m, row_ok, col, DIRECT_STORE)  # the winner's key, for the epilogue
        if HALF_KEYS and j == 0 and not SIGMOID and not RENORM:  # softmax over all experts needs the row's sum
            _, mx = packed_decode(m, INF16, x.dtype, CB)
            z = row_sum(tl.where(valid, tl.exp(x.to(tl.float32) - rows5(mx)), 0.0))
    chosen = key < INT_MIN + K  # PERM: marks INT_MIN + j, j < K (unused otherwise)
    if not HALF_KEYS:
        if order_unknown(key, m, tie, row_ok, K, PERM, CB):  # redo this tile with exact keys
            key, _, _ = _exact_values(x, bias, valid, SIGMOID, HAS_BIAS, SEL_LOGITS, G, NG, TOPK_G, FAST_SIGMOID)
            for j in tl.static_range(K):
                key, idx, _ = exact_step(key, col, j, CB)
                # stored in packed form with the column in the low bits (the epilogue only reads the column)
                _store_step(out_j + j, (CB - 1) - idx, row_ok, col, DIRECT_STORE)
            chosen = key < INT_MIN + K
    if PERM:
        c = (chosen & rows5(row_ok)).to(tl.int32)
        rank = tl.cumsum(c, axis=2) - c + carry[:, :, None, :, :]  # earlier slots of the same expert here
        carry += tl.sum(c, axis=2)
        tl.store(POS_OUT + rows5(rows64) * K + (key - INT_MIN), rank, mask=c != 0)
    tl.debug_barrier()  # the keys just stored are visible to every thread of the program
    mk = _load_keys(t, W_OUT, T, kk, K, ROWS)
    sel_count = _finish_tile(t, mk, mx, z, X, stride_x, W_OUT, ID_OUT, sel_count, T, route_scale, kk, K, ROWS, CB,
                             SIGMOID, RENORM, SEL_LOGITS, HALF_KEYS, INF16, PERM)  # fmt: skip
    return sel_count, carry


@triton.jit
def _moe_route_fwd(
    X,
    stride_x,
    BIAS,
    W_OUT,
    ID_OUT,
    POS_OUT,
    HIST,
    COUNTS,
    OFFSETS,
    WS,
    T,
    n_tiles,
    tiles_per_prog,
    route_scale,
    E: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    G: tl.constexpr,
    LG: tl.constexpr,
    ROWS: tl.constexpr,
    C: tl.constexpr,
    VEC: tl.constexpr,
    SG: tl.constexpr,
    NG: tl.constexpr,
    CB: tl.constexpr,
    ALIGN: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SEL_LOGITS: tl.constexpr,
    HALF_KEYS: tl.constexpr,
    INF16: tl.constexpr,
    TOPK_G: tl.constexpr,
    PERM: tl.constexpr,
    DIRECT_STORE: tl.constexpr,
    PREFETCH: tl.constexpr,
    FAST_SIGMOID: tl.constexpr,
    TALLY_SEM: tl.constexpr,
    READ_SEM: tl.constexpr,
    PACKED_TAIL: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    stride_x = (stride_x // ALIGN) * ALIGN  # no-op that tells the compiler the rows' alignment (vector loads)
    col, valid = tile_cols(G, LG, C, VEC, SG, NG)
    kk = tl.arange(0, KP)
    bias = tl.zeros([G, LG, 1, C, VEC], tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS + col, mask=valid, other=0.0).to(tl.float32)
    sel_count = tl.zeros([BLOCK_E], tl.int32)  # slots per expert, over this program's tiles
    carry = tl.zeros([G, LG, C, VEC], tl.int32)  # PERM: this program's slots per expert so far
    tile = pid * tiles_per_prog
    last = tl.minimum(tile + tiles_per_prog, n_tiles)
    if PREFETCH:
        x = _load_tile(tile, last, X, stride_x, T, col, valid, ROWS)
    if INTERPRET:  # the interpreter cannot take runtime scalars as range() bounds
        while tile < last:
            if PREFETCH:
                x_cur = x
                x = _load_tile(tile + 1, last, X, stride_x, T, col, valid, ROWS)
            else:
                x_cur = _load_tile(tile, last, X, stride_x, T, col, valid, ROWS)
            sel_count, carry = _route_tile(tile, x_cur, X, stride_x, bias, W_OUT, ID_OUT, POS_OUT, sel_count, carry, T,
                                           route_scale, col, valid, kk, K, ROWS, G, NG, CB, SIGMOID, RENORM, HAS_BIAS,
                                           SEL_LOGITS, HALF_KEYS, INF16, TOPK_G, PERM, DIRECT_STORE,
                                           False)  # fmt: skip
            tile += 1
    else:
        for t in tl.range(tile, last, num_stages=NUM_STAGES):
            if PREFETCH:  # the next tile's loads are in flight while this one is ranked
                x_cur = x
                x = _load_tile(t + 1, last, X, stride_x, T, col, valid, ROWS)
            else:
                x_cur = _load_tile(t, last, X, stride_x, T, col, valid, ROWS)
            sel_count, carry = _route_tile(t, x_cur, X, stride_x, bias, W_OUT, ID_OUT, POS_OUT, sel_count, carry, T,
                                           route_scale, col, valid, kk, K, ROWS, G, NG, CB, SIGMOID, RENORM, HAS_BIAS,
                                           SEL_LOGITS, HALF_KEYS, INF16, TOPK_G, PERM, DIRECT_STORE,
                                           FAST_SIGMOID)  # fmt: skip
    # Integer atomics: exact and order-independent, hence deterministic.
    if PACKED_TAIL:
        _packed_tail(WS, HIST, COUNTS, OFFSETS, sel_count, carry, col, valid, pid, E, BLOCK_E, PERM)
    else:
        _ticket_tail(WS, HIST, COUNTS, OFFSETS, sel_count, carry, col, valid, pid, E, BLOCK_E, PERM, TALLY_SEM,
                     READ_SEM)  # fmt: skip


# The packed tail's int64 accumulator word per expert: [contributors | inclusive prefix | count]. Fields hold totals
# (no carries between them) while T * k < 2**PACK_BITS and there are fewer than 2**(64 - 2 * PACK_BITS) programs.
PACK_BITS = 26
_PACK = tl.constexpr(PACK_BITS)
_FIELD = tl.constexpr((1 << PACK_BITS) - 1)
_WHO = tl.constexpr((1 << (64 - 2 * PACK_BITS)) - 1)
_ONE = tl.constexpr(1 << (2 * PACK_BITS))  # one contributor


@triton.jit
def _packed_tail(WS, HIST, COUNTS, OFFSETS, sel_count, carry, col, valid, pid, E: tl.constexpr,
                 BLOCK_E: tl.constexpr, PERM: tl.constexpr):  # fmt: skip
    """One relaxed int64 atomic per expert and program, no ticket: every program adds ``1`` (it contributed), its
    tally and its inclusive tally prefix to the expert's packed word, and the atomic returns the word before the add.
    The program whose add completes an expert's word (all programs counted) holds that expert's final count and
    offset in registers: it stores them and re-zeroes the word for the next launch. Nothing waits on another program
    (the ticket tail's last program waits for every tally, then reads them back).

    ``PERM``: the program's tallies sit in the selection tile's layout, where a prefix over experts is not at hand;
    the word packs the count only and ``_perm_base`` makes the offsets from the counts.
    """
    if PERM:
        col4 = tl.max(col, axis=2)
        valid4 = tl.max(valid.to(tl.int32), axis=2) != 0
        tl.store(HIST + pid * E + col4, carry, mask=valid4)
        add = carry.to(tl.int64) + _ONE
        total = tl.atomic_add(WS + col4, add, mask=valid4, sem="relaxed") + add
        done = valid4 & (((total >> (2 * _PACK)) & _WHO) == tl.num_programs(0))
        tl.store(COUNTS + col4, (total & _FIELD).to(tl.int32), mask=done)
        tl.store(WS + col4, tl.zeros_like(total), mask=done)
    else:
        e = tl.arange(0, BLOCK_E)
        e_ok = e < E
        upto = tl.cumsum(sel_count, axis=0)
        add = (upto.to(tl.int64) << _PACK) + sel_count.to(tl.int64) + _ONE
        total = tl.atomic_add(WS + e, add, mask=e_ok, sem="relaxed") + add
        done = e_ok & (((total >> (2 * _PACK)) & _WHO) == tl.num_programs(0))
        tl.store(COUNTS + e, (total & _FIELD).to(tl.int32), mask=done)
        tl.store(OFFSETS + e, ((total >> _PACK) & _FIELD).to(tl.int32), mask=done)
        tl.store(WS + e, tl.zeros_like(total), mask=done)


@triton.jit
def _ticket_tail(WS, HIST, COUNTS, OFFSETS, sel_count, carry, col, valid, pid, E: tl.constexpr, BLOCK_E: tl.constexpr,
                 PERM: tl.constexpr, TALLY_SEM: tl.constexpr, READ_SEM: tl.constexpr):  # fmt: skip
    """Tallies into the zeroed int32 workspace ``[ticket, accumulator[E]]``; the last program (a ticket) publishes
    counts and offsets and re-zeroes it.

    The ticket orders the tallies before the last program reads the totals. Relaxed form (TALLY_SEM "relaxed",
    READ_SEM "relaxed"): relaxed tallies, barrier, one acq_rel ticket by one thread (the pattern of cooperative
    groups' grid sync: the barrier makes the block's tallies precede that thread's release), relaxed reads and
    re-zeroing after the acquire. Otherwise every tally is a release (a fence per thread, which also waits for the
    tile's output stores) and the reads are acq_rel.
    """
    if PERM:
        col4 = tl.max(col, axis=2)
        valid4 = tl.max(valid.to(tl.int32), axis=2) != 0
        tl.store(HIST + pid * E + col4, carry, mask=valid4)
        tl.atomic_add(WS + 1 + col4, carry, mask=valid4 & (carry != 0), sem=TALLY_SEM)
    else:
        e = tl.arange(0, BLOCK_E)
        tl.atomic_add(WS + 1 + e, sel_count, mask=(e < E) & (sel_count != 0), sem=TALLY_SEM)
    tl.debug_barrier()
    ticket = tl.atomic_add(WS, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        tl.debug_barrier()
        e = tl.arange(0, BLOCK_E)
        e_ok = e < E
        # read the totals and re-zero for the next launch (the next launch is ordered by the kernel boundary)
        counts = tl.atomic_xchg(WS + 1 + e, 0, mask=e_ok, sem=READ_SEM)
        tl.store(COUNTS + e, counts, mask=e_ok)
        tl.store(OFFSETS + e, tl.cumsum(tl.where(e_ok, counts, 0), axis=0), mask=e_ok)
        tl.atomic_xchg(WS, 0, sem=READ_SEM)


@triton.jit
def _perm_base(HIST, COUNTS, OFFSETS, n_progs, E, EB: tl.constexpr, PB: tl.constexpr, OFFSETS_HERE: tl.constexpr):
    """In place: per-program counts ``HIST[p, e]`` -> the position of program p's first slot of expert e.

    ``OFFSETS_HERE`` (the packed tail, which leaves only the counts with the permutation): each program also writes
    its experts' offsets, from the counts before its block of experts and its own.
    """
    e0 = tl.program_id(0) * EB
    e = e0 + tl.arange(0, EB)
    e_ok = e < E
    n_e = tl.load(COUNTS + e, mask=e_ok, other=0)
    if OFFSETS_HERE:
        before = 0
        c = 0
        while c < e0:
            before += tl.sum(tl.load(COUNTS + c + tl.arange(0, EB)))  # whole blocks, all below E
            c += EB
        upto = before + tl.cumsum(n_e, axis=0)
        tl.store(OFFSETS + e, upto, mask=e_ok)
        carry = upto - n_e
    else:
        carry = tl.load(OFFSETS + e, mask=e_ok, other=0) - n_e
    p0 = 0
    while p0 < n_progs:  # (a while loop: the interpreter cannot take runtime range() bounds)
        p = p0 + tl.arange(0, PB)
        m = (p < n_progs)[:, None] & e_ok[None, :]
        ptr = HIST + p[:, None] * E + e[None, :]
        h = tl.load(ptr, mask=m, other=0)
        tl.store(ptr, tl.cumsum(h, axis=0) - h + carry[None, :], mask=m)
        carry += tl.sum(h, axis=0)
        p0 += PB


@triton.jit
def _perm_scatter(ID, POS, BASE, SORTED, n_slots, E, rows_per_prog, K: tl.constexpr, BLOCK: tl.constexpr):
    """Slot s = t * K + j: final position = base of (its program, its expert) + its rank; scatter s there."""
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = s < n_slots
    e = tl.load(ID + s, mask=ok, other=0)
    prog = (s // K) // rows_per_prog
    pos = tl.load(BASE + prog * E + e, mask=ok, other=0) + tl.load(POS + s, mask=ok, other=0)
    tl.store(POS + s, pos, mask=ok)
    tl.store(SORTED + pos, s, mask=ok)


@dataclass(frozen=True)
class LaunchConfig:
    elems_per_thread: int = 32  # row elements per thread; sets the lanes per row (fewer lanes: fewer shuffles)
    rows_per_thread: int = 1
    num_warps: int = 4
    programs_per_sm: int = 4  # persistent grid: SMs * programs_per_sm programs (fewer when there are fewer tiles)
    num_stages: int = 1  # software pipelining of the tile loop
    prefetch: bool = False  # load the next tile into registers before ranking this one
    fast_sigmoid: bool = True  # see _exact_values (CUDA only: off on ROCm, see ON_HIP)
    direct_store: bool | None = None  # see _store_step; None: by the Triton version
    relaxed_tail: bool = False  # see _ticket_tail
    # "packed": _packed_tail where its fields fit (else the ticket); "ticket": _ticket_tail; None: by row width, as
    # launch_config picks (default_tail: wider rows than 128 experts measured slower with the packed tail)
    tail: str | None = None
    programs: int | None = None  # exact number of programs (tests); overrides programs_per_sm


@dataclass(frozen=True)
class TileShape:
    """The ``[G, LG, ROWS, C, VEC]`` tile (see ``_select.py``) and the packed-key column base ``CB``."""

    G: int
    LG: int
    ROWS: int
    C: int
    VEC: int
    SG: int  # columns per group (all columns when ungrouped)
    NG: int
    CB: int


def tile_shape(n_experts: int, n_groups: int | None, row_stride: int, itemsize: int, cfg: LaunchConfig) -> TileShape:
    groups = n_groups or 1
    sg = n_experts // groups
    vec = 16 // itemsize  # one 16-byte load per chunk, as long as rows and groups stay aligned to it
    while vec > 1 and (sg % vec or row_stride % vec):
        vec //= 2
    g = block_of(groups)
    sgp = max(block_of(sg), vec)
    lg = max(1, min(sgp // max(cfg.elems_per_thread, vec), 32 // g))
    rows = (32 // (g * lg)) * cfg.num_warps * cfg.rows_per_thread
    return TileShape(
        G=g, LG=lg, ROWS=rows, C=sgp // (lg * vec), VEC=vec, SG=sg, NG=groups, CB=block_of((g - 1) * sg + sgp)
    )


def default_tail(n_experts: int) -> str:
    """The counting tail by row width: packed up to 128 experts, ticket above (see ``launch_config``)."""
    return "packed" if block_of(n_experts) <= 128 else "ticket"


def launch_config(n_experts: int, k: int, itemsize: int, grouped: bool, biased: bool = False) -> LaunchConfig:
    """Heuristic, from the H200 sweeps (``benchmarks/bench_moe_route.py --sweep [--pipeline]``,
    ``moe_route_sweep_dcd9d8f.md``, then ``moe_route_sweep_pipeline.md``): 32 row elements per thread and tiles of
    about 4096 elements, except where one change measured faster. A full sweep around the result (bfbab72,
    ``moe_route_sweep.md``) finds every case within 3% of its best configuration but Llama-4's 16 experts (4.3 vs
    4.0 us with 64 elements per thread):

    - 16-bit rows of 128+ experts, ungrouped: 64 elements per thread (fewer lanes per row, fewer shuffle stages;
      GLM-4.5's 160 experts 32.0 -> 26.1 us, Qwen3's 128 9.7 -> 8.5 us).
    - fp32 rows of up to 64 experts: 16 elements per thread (DeepSeek-V2-Lite 19.9 -> 15.6 us).
    - expert groups: two rows per thread (DeepSeek-V3 65k tokens 67.7 -> 57.3 us, fp32 16k 25.6 -> 23.2 us).
    - up to 8 experts: one row per thread, so a 16k-token batch spreads over 128 programs (Mixtral 4.6 -> 4.2 us).
    - the next tile prefetched, except for 16-bit rows of up to 64 experts (one tile per program at the suite's
      sizes; prefetching cost Mixtral 3.9 -> 4.1 us, OLMoE 7.1 -> 7.3): DeepSeek-V2-Lite 14.7 -> 13.6 us,
      Qwen3 65k 16.5 -> 16.0 (``moe_route_sweep_pipeline_explore.md``; Triton 3.6, off with later versions, see
      ``NEWER_TRITON``). Off for grouped scores since the compressed keys' check (f26d70a): with it the grouped
      kernels spilled (DeepSeek-V3 fp32 120 bytes, sm_90, Triton 3.6). Both changes together, side by side
      (``moe_route_spread_2c62ad9_repeat.md`` / ``moe_route_spread_108eedf.md``): DeepSeek-V3 fp32 20.1 -> 20.1 us,
      65k 53.7 -> 56.9 on the suite's inputs.
    - biased or grouped scores: 2 programs per SM. Those kernels take 255 registers, so only two programs of 4 warps
      fit on an SM and a 4-per-SM grid runs in two waves (GLM-4.5 26.3 -> 20.6 us, DeepSeek-V3 65k 58.4 -> 54.7, fp32
      16k 25.6 -> 21.7, with the prefetch; ``moe_route_sweep_pipeline_explore.md``).
    - the sigmoid of ranked scores (biased or grouped sigmoid routers) as ``ex2.approx.ftz`` and ``div.approx.ftz``
      (``fast_sigmoid``, see ``_exact_values``), side by side at 23207fe (``moe_route_variants_23207fe.md``):
      DeepSeek-V3 65k 57.0 -> 52.0 us, GLM-4.5 19.8 -> 19.1, DeepSeek-V3 fp32 20.4 -> 20.2 (its scores are fp32
      logits' sigmoids: the same instructions, a smaller share of the time).
    - the relaxed counting tail (``_ticket_tail``): 1.04-1.35x on every case, most on the small ones
      (Mixtral 4.10 -> 3.03 us, Qwen3 65k 15.8 -> 14.8; ``moe_route_sweep_pipeline.md``).
    - rows of up to 128 experts: the packed tail (``_packed_tail``). Ticket -> packed, side by side in one run at
      f0b67ee (``moe_route_floor_f0b67ee.md``): Mixtral 3.15 -> 2.20 us, Qwen2-MoE 4.06 -> 3.36, OLMoE 6.00 -> 4.94,
      Qwen3 7.66 -> 6.45, Llama-4 4.25 -> 3.34, DeepSeek-V2-Lite 12.75 -> 11.57, Qwen3 65k 14.67 -> 14.73; the pipeline
      sweep of the same run agrees. Wider rows lost (GLM-4.5's 160: 18.98 -> 21.59, DeepSeek-V3 fp32's 256: 19.97 ->
      21.25); why is not established (every program adds a word for every expert, where the ticket tail skips zero
      tallies, but GLM-4.5's 128-token programs have few of those). (The floors agree, though their stand-in tally
      leaves half the experts at zero, which favours the ticket tail. DeepSeek-V3 65k tied, 53.3 vs 52.5.) In the
      255-register biased kernels over 128 experts it also spilled 16 bytes (outside the main loop; sm_90, Triton 3.6).

    Tried and dropped: tiles drawn from a counter (one relaxed atomic per tile, the next one drawn while the current
    is ranked) instead of a fixed range per program, against the load imbalance that makes spread inputs slower (the
    programs that draw an exact-pass tile finish last, ``route_ncu_5b20dfb.md``): 0.80-0.94x on the suite's inputs
    of six cases, 0.88-1.01x on spread ones (``moe_route_variants_dynamic_0bc91f4.md``).
    The selection steps after the first, the exact pass's steps, or both, as loops instead of
    unrolled (a third to a half of the code, against the instruction-fetch stalls the profile shows on the long
    biased/grouped loops): 0.93-1.01x on DeepSeek-V3 fp32 and 65k and DeepSeek-V2-Lite fp32, suite and spread inputs
    (``moe_route_variants_roll_9547a40.md``; GLM-4.5 spilled with either, Qwen3 65k needed 168 registers).
    Finishing each tile one loop step later, its winning keys loaded before the next tile is
    ranked (the profile, ``route_ncu_5b20dfb.md``, has the reload after the barrier as the loop's most sampled stall
    on Qwen3 65k): slower on all seven cases it compiled for without spilling, 0.83-0.97x, with or without the
    prefetch (``moe_route_variants_23207fe.md``).

    Tried and dropped before the packed tail (``moe_route_sweep_pipeline_{98ecaa1,8285c4e,d578312}.md``, ticket vs the
    alternative in each run): an atomic tail (every program adds its tally into zeroed ``counts_E`` and its prefix into
    ``offsets_E``; no ticket). With one memset over both outputs it won on rows of up to 64 experts (OLMoE 6.10 -> 5.64
    us, Llama-4 4.10 -> 3.77) and lost from 128 (Qwen3 7.6 -> 8.2, GLM-4.5 19.2 -> 22.1), but a custom op's outputs may
    not alias, so the op would need two zeroings: by one foreach launch it was mixed (OLMoE 6.12 -> 6.92, Llama-4 5.05
    -> 4.00), by two memsets slower on four of five (Mixtral 3.18 -> 4.01, OLMoE 6.06 -> 7.61). And the accumulator in
    copies (program p adds into copy p % 4, spreading the atomics over more cache lines): Qwen3 16k 7.6 -> 7.2 in two
    runs, no gain or a loss elsewhere (DeepSeek-V3 fp32 19.8 -> 20.8), and 32 bytes of spills in the 255-register
    kernels.
    """
    width = block_of(n_experts)
    per_row = min(32, width)
    ept = 32
    if itemsize == 2 and n_experts >= 128 and not grouped:
        ept = 64
    elif itemsize == 4 and width <= 64:
        ept = 16
    if grouped:
        rows = 2
    elif width <= 8:
        rows = 1
    else:
        rows = max(1, 32 // per_row)
    return LaunchConfig(
        relaxed_tail=True,
        tail=default_tail(n_experts),
        elems_per_thread=ept,
        rows_per_thread=rows,
        num_warps=4,
        programs_per_sm=2 if grouped or biased else 4,
        prefetch=not (itemsize == 2 and width <= 64) and not grouped and not NEWER_TRITON,
    )


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _grid(device: torch.device, cfg: LaunchConfig, n_tiles: int) -> tuple[int, int]:
    """(programs, tiles per program); every program gets at least one tile."""
    if cfg.programs is not None:
        progs = cfg.programs
    elif device.type == "cuda":
        progs = _sm_count(device.index) * cfg.programs_per_sm
    else:  # the interpreter runs programs one after another: a few are enough to exercise the multi-program logic
        progs = 4
    per = cdiv(n_tiles, max(1, min(progs, n_tiles)))
    return cdiv(n_tiles, per), per


_WORKSPACES: dict[tuple, torch.Tensor] = {}
_CAPTURE_POOL_INTS = 1 << 18  # 1 MiB: room for ~248 captured launches with 1024 experts (ticket tail), ~8000 with 8
_CAPTURE_SLOT_ALIGN = 32  # ints: slots start on their own 128-byte line
_capture_pools: dict[torch.device, list] = {}  # device -> [zeroed pool, next free int]


def _capture_slot(device: torch.device, ints: int) -> torch.Tensor | None:
    """A zeroed ``[ints]`` int32 slot owned by one captured launch for good, or None when the pool is used up.

    Slots come from a pool zeroed outside capture (when the first launch on the device ran), so a captured launch
    needs no memset node: each replay finds its slot zero because the kernel re-zeroes it. Slots are never handed out
    twice, so graphs never share one, however they are replayed.
    """
    pool = _capture_pools.get(device)
    if pool is None:
        return None
    size = cdiv(ints, _CAPTURE_SLOT_ALIGN) * _CAPTURE_SLOT_ALIGN
    start = pool[1]
    if start + size > pool[0].numel():
        return None
    pool[1] = start + size
    return pool[0][start : start + ints]


def _workspace(device: torch.device, ints: int = 2 * MAX_E) -> torch.Tensor:
    """At least ``ints`` int32, zero between launches (every launch re-zeroes what it used): the ticket tail's
    ``[ticket, count accumulator[E]]``, or the packed tail's ``E`` int64 words (a view of the first ``2 E``).

    One per (device, stream), so launches on different streams never share it. Under CUDA graph capture each
    captured launch gets its own zeroed slot: from the pre-zeroed pool when it has room, else a buffer whose zeroing
    is captured too (one more graph node). Either way a graph may be replayed anywhere.
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        slot = _capture_slot(device, ints)
        return slot if slot is not None else torch.zeros(ints, dtype=torch.int32, device=device)
    if device.type == "cuda" and device not in _capture_pools:
        _capture_pools[device] = [torch.zeros(_CAPTURE_POOL_INTS, dtype=torch.int32, device=device), 0]
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    ws = _WORKSPACES.get((device, stream))
    if ws is None:
        ws = _WORKSPACES[(device, stream)] = torch.zeros(2 * MAX_E, dtype=torch.int32, device=device)
    return ws


def _supports(
    logits_TE: torch.Tensor,
    k: int,
    score: str,
    renormalize: bool,
    bias_E: torch.Tensor | None,
    route_scale: float,
    n_groups: int | None,
    topk_groups: int | None,
    return_permutation: bool,
) -> bool | str:
    if (reason := device_reason(logits_TE, bias_E)) is not None:
        return reason
    if logits_TE.dtype not in _DTYPES:
        return f"dtype {logits_TE.dtype}"
    if bias_E is not None and bias_E.dtype not in _DTYPES:
        return f"bias dtype {bias_E.dtype}"
    n_experts = logits_TE.shape[1]
    if n_experts > MAX_E:
        return f"{n_experts} experts > {MAX_E}"
    if k > MAX_K:
        return f"k={k} > {MAX_K}"
    if n_experts > 1 and logits_TE.stride(1) != 1:
        return "last dim not contiguous"
    if bias_E is not None and n_experts > 1 and bias_E.stride(0) != 1:
        return "bias not contiguous"
    if n_groups is not None and n_groups > 32:
        return f"{n_groups} groups > 32"
    return True


@dataclass(frozen=True)
class _Plan:
    programs: int
    tiles: int
    tiles_per_program: int
    rows: int
    packed_tail: bool
    constexprs: dict


@functools.lru_cache(maxsize=512)
def _plan(
    n_tokens: int,
    n_experts: int,
    k: int,
    dtype: torch.dtype,
    row_stride: int,
    score: str,
    renormalize: bool,
    has_bias: bool,
    n_groups: int | None,
    topk_groups: int | None,
    perm: bool,
    device: torch.device,
    config: LaunchConfig | None,
    interpret: bool,
) -> _Plan:
    """Everything about a launch that depends only on the call's signature (cached: the eager path is host-bound)."""
    itemsize = torch.finfo(dtype).bits // 8
    cfg = config or launch_config(n_experts, k, itemsize, n_groups is not None, has_bias)
    shape = tile_shape(n_experts, n_groups, row_stride, itemsize, cfg)
    tiles = cdiv(n_tokens, shape.ROWS)
    programs, per_program = _grid(device, cfg, tiles)
    sel_logits = not has_bias and n_groups is None
    packed = (cfg.tail or default_tail(n_experts)) == "packed" and packed_tail_fits(n_tokens, k, programs)
    constexprs = dict(
        E=n_experts,
        K=k,
        KP=block_of(k),
        BLOCK_E=block_of(n_experts),
        G=shape.G,
        LG=shape.LG,
        ROWS=shape.ROWS,
        C=shape.C,
        VEC=shape.VEC,
        SG=shape.SG,
        NG=shape.NG,
        CB=shape.CB,
        ALIGN=shape.VEC,
        SIGMOID=score == "sigmoid",
        RENORM=renormalize,
        HAS_BIAS=has_bias,
        SEL_LOGITS=sel_logits,
        HALF_KEYS=sel_logits and dtype in (torch.bfloat16, torch.float16),
        INF16=FP16_INF if dtype == torch.float16 else BF16_INF,
        TOPK_G=topk_groups or 0,
        PERM=perm,
        DIRECT_STORE=NEWER_TRITON if cfg.direct_store is None else cfg.direct_store,
        PREFETCH=cfg.prefetch,
        FAST_SIGMOID=cfg.fast_sigmoid and not ON_HIP,
        TALLY_SEM="relaxed" if cfg.relaxed_tail else "release",
        READ_SEM="relaxed" if cfg.relaxed_tail else "acq_rel",
        PACKED_TAIL=packed,
        NUM_STAGES=cfg.num_stages,
        INTERPRET=interpret,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return _Plan(programs, tiles, per_program, shape.ROWS, packed, constexprs)


def packed_tail_fits(n_tokens: int, k: int, programs: int) -> bool:
    """Whether the packed tail's fields hold this launch's totals (else the launcher uses the ticket tail)."""
    return n_tokens * k < 1 << PACK_BITS and programs <= (1 << (64 - 2 * PACK_BITS)) - 1


@MOE_ROUTE.implement(
    "triton",
    supports=_supports,
    constraints="logits [T, E] fp32/bf16/fp16, E <= 1024, k <= 16, softmax/sigmoid, selection bias, up to 32 "
    "expert groups; counts, offsets and stable permutation fused; no host sync",
)
def moe_route_triton(
    logits_TE: torch.Tensor,
    k: int,
    score: str,
    renormalize: bool,
    bias_E: torch.Tensor | None,
    route_scale: float,
    n_groups: int | None,
    topk_groups: int | None,
    return_permutation: bool,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, ...]:
    n_tokens, n_experts = logits_TE.shape
    dev = logits_TE.device
    i32 = dict(dtype=torch.int32, device=dev)
    plan = None
    if n_tokens:
        plan = _plan(
            n_tokens,
            n_experts,
            k,
            logits_TE.dtype,
            logits_TE.stride(0),
            score,
            renormalize,
            bias_E is not None,
            n_groups,
            topk_groups,
            return_permutation,
            dev,
            config,
            interpreting(),
        )
    # every output element is stored (counts and offsets of every expert by the tail; each program's count of every
    # expert in hist)
    with written_in_full():
        weights = torch.empty((n_tokens, k), dtype=torch.float32, device=dev)
        ids = torch.empty((n_tokens, k), **i32)
        counts = torch.empty((n_experts,), **i32)
        offsets = torch.empty((n_experts,), **i32)
        if return_permutation:
            sorted_slots, slot_pos = torch.empty((n_tokens * k,), **i32), torch.empty((n_tokens, k), **i32)
        else:
            sorted_slots, slot_pos = torch.empty((0,), **i32), torch.empty((0,), **i32)
        hist = torch.empty((plan.programs * n_experts,), **i32) if plan is not None and return_permutation else counts
    if plan is None:  # no tokens
        counts.zero_()
        offsets.zero_()
        return weights, ids, counts, offsets, sorted_slots, slot_pos
    with on_device(logits_TE):  # the workspace, the capture check and the launches all on the logits' GPU
        if plan.packed_tail:  # one int64 word per expert
            ws = _workspace(dev, 2 * n_experts)[: 2 * n_experts].view(torch.int64)
        else:
            ws = _workspace(dev, 1 + n_experts)
        _moe_route_fwd[(plan.programs,)](
            logits_TE,
            logits_TE.stride(0),
            bias_E if bias_E is not None else logits_TE,
            weights,
            ids,
            slot_pos if return_permutation else ids,
            hist,
            counts,
            offsets,
            ws,
            n_tokens,
            plan.tiles,
            plan.tiles_per_program,
            route_scale,
            **plan.constexprs,
        )
        if return_permutation:
            _perm_base[(cdiv(n_experts, 32),)](hist, counts, offsets, plan.programs, n_experts, EB=32, PB=64,
                                               OFFSETS_HERE=plan.packed_tail)  # fmt: skip
            n_slots = n_tokens * k
            _perm_scatter[(cdiv(n_slots, 1024),)](
                ids,
                slot_pos,
                hist,
                sorted_slots,
                n_slots,
                n_experts,
                plan.tiles_per_program * plan.rows,
                K=k,
                BLOCK=1024,
                num_warps=4,
            )
    return weights, ids, counts, offsets, sorted_slots, slot_pos
