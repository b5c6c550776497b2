"""Triton MoE routing: the jitted kernels (the launcher and its registration as the ``triton`` backend of
``moe_route``: ``moe_route.py``; launch configurations: ``_moe_route_config.py``).

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
allocated without its fill, ``fly_lightning.kernels.outputs``: every element is stored). The permutation uses no
atomics: ranks follow token order inside a program and program order across programs.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from fly_lightning.kernels.triton._select import (
    INT_MIN,
    PAD,
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
from fly_lightning.ops.moe_route import RENORM_EPS

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
