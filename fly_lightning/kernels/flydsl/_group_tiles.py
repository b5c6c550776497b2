"""Which row tile of which group a workgroup of a FlyDSL grouped GEMM owns, found on the device from the int32 end
offsets (no host sync, no LDS, no barrier): shared by the bf16 and the MX grouped GEMMs.

Grid rows: ``(M + E * (BM - 1)) / BM``, an upper bound on ``sum_e ceil(rows_e / BM)``. Every wave works it out on its
own: lane ``j`` reads the offsets of groups ``j*S .. j*S + S - 1`` (``S = ceil(E / 64)``), clamps them to ``[0, M]``
(a wave max-scan makes them non-decreasing, as the Triton kernels read them), counts their row tiles, and a wave
sum-scan gives each group's first tile; the lane owning tile ``block_idx.y`` publishes (expert, first row, end row)
by a butterfly max. Workgroups past the last tile get first row -1.

Trace-time helpers (no runtime control flow: selects and shuffles only), called inside ``@flyc.kernel`` bodies.
"""

WAVE = 64


def butterfly(v, combine):
    """Wave-wide reduction by xor shuffles: every lane ends with ``combine`` over all 64."""
    from flydsl.expr import range_constexpr

    for s in range_constexpr(6):
        v = combine(v, v.shuffle_xor(1 << s, WAVE))
    return v


def exclusive_scan(v, lane, combine, identity):
    """Wave-wide exclusive scan with xor shuffles: lanes above a block's midpoint take its lower half's total."""
    from flydsl.expr import range_constexpr

    excl = identity
    tot = v
    for s in range_constexpr(6):
        other = tot.shuffle_xor(1 << s, WAVE)
        upper = (lane // (1 << s)) % 2 == 1
        excl = upper.select(combine(excl, other), excl)
        tot = combine(tot, other)
    return excl


def find_group_tile(offs, M, E: int, BM: int, lane, tile_t):
    """``(expert, first row, end row)`` of row tile ``tile_t`` (all -1 past the last tile); ``offs``: the int32 end
    offsets ``[E]`` as a kernel tensor argument, ``M`` the rows of x."""
    import flydsl.expr as fx
    from flydsl.expr import range_constexpr

    S = -(-E // WAVE)  # groups per lane
    offs_v = fx.logical_divide(fx.rocdl.make_buffer_tensor(offs, max_size=False), fx.make_layout(1, 1))
    i32_atom = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), 32)
    ends = []
    run_max = fx.Int32(0)
    for j in range_constexpr(S):
        r = fx.make_rmem_tensor(1, fx.Int32)
        fx.copy(i32_atom, fx.slice(offs_v, (None, lane * S + j)), r)  # past E: zero-filled
        o = fx.memref_load_vec(r)[0]
        o = (o < 0).select(0, o)
        o = (o > M).select(M, o)
        run_max = fx.max(run_max, o)
        ends.append(run_max)
    prev_max = exclusive_scan(run_max, lane, fx.max, fx.Int32(0))
    tiles = []
    lane_tiles = fx.Int32(0)
    starts = []
    start = prev_max
    for j in range_constexpr(S):
        end = fx.max(ends[j], prev_max)
        ends[j] = end
        starts.append(start)
        n_t = (end - start + (BM - 1)) // BM
        tiles.append(n_t)
        lane_tiles = lane_tiles + n_t
        start = end
    first = exclusive_scan(lane_tiles, lane, lambda a, b: a + b, fx.Int32(0))
    g_e = fx.Int32(-1)
    g_row = fx.Int32(-1)
    g_end = fx.Int32(-1)
    for j in range_constexpr(S):
        hit = (tile_t >= first) & (tile_t < first + tiles[j])
        g_e = hit.select(lane * S + j, g_e)
        g_row = hit.select(starts[j] + (tile_t - first) * BM, g_row)
        g_end = hit.select(ends[j], g_end)
        first = first + tiles[j]
    return butterfly(g_e, fx.max), butterfly(g_row, fx.max), butterfly(g_end, fx.max)
