"""Triton routing kernel: tile shapes, launch configurations, the exact fallback, the permutation kernels and the
self-cleaning workspace, against the reference; outputs fully written (outputs are poisoned, see conftest.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fly_lightning.kernels.triton._moe_route_config import LaunchConfig, launch_config, tile_shape
from fly_lightning.kernels.triton._moe_route_kernel import PACK_BITS
from fly_lightning.kernels.triton._workspace import zeroed
from fly_lightning.kernels.triton.moe_route import (
    MAX_E,
    _plan,
    _supports,
    moe_route_triton,
    packed_tail_fits,
)
from fly_lightning.ops.moe_route import moe_route_reference, routing_counts


def _run(logits, k, cfg, score="softmax", renorm=True, bias=None, scale=1.0, groups=(None, None), perm=True):
    args = (logits, k, score, renorm, bias, scale, *groups, perm)
    torch.use_deterministic_algorithms(True)  # outputs are NaN / INT_MAX poisoned: unwritten elements would show
    try:
        out = moe_route_triton(*args, config=cfg)
    finally:
        torch.use_deterministic_algorithms(False)
    return out, moe_route_reference(*args)


def _check(out, ref, n_experts, perm=True):
    w, ids, counts, offsets, slots, pos = out
    assert torch.equal(ids, ref[1])
    torch.testing.assert_close(w, ref[0], rtol=2e-5, atol=1e-6, equal_nan=True)
    for got, want in zip((counts, offsets, slots, pos), routing_counts(ids, n_experts, perm), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "e, dtype, cfg",
    [
        (8, torch.bfloat16, LaunchConfig(rows_per_thread=2, num_warps=1, programs=3)),  # 64-row tiles, 3 programs
        (60, torch.bfloat16, LaunchConfig(elems_per_thread=8, num_warps=1, programs=2)),  # padded row, 8 lanes
        (128, torch.float16, LaunchConfig(elems_per_thread=16, num_warps=1)),
        (160, torch.float32, LaunchConfig(elems_per_thread=64, num_warps=2, programs=5, tail="packed")),
        (13, torch.float32, LaunchConfig(num_warps=1, programs=2)),  # odd width: 4-byte loads
        (1024, torch.bfloat16, LaunchConfig(num_warps=1, programs=2, tail="packed")),  # widest supported row
        # the next tile prefetched (one program walks both 64-row tiles: the prefetched one is ranked next, the load
        # past the last is masked), both winner-key store forms
        (8, torch.bfloat16, LaunchConfig(rows_per_thread=2, num_warps=1, programs=1, prefetch=True, direct_store=True)),
        (160, torch.float32, LaunchConfig(elems_per_thread=64, num_warps=2, programs=2, prefetch=True, tail="packed")),
        (60, torch.float16, LaunchConfig(elems_per_thread=8, num_warps=1, programs=1, prefetch=True)),
        # the ticket tail, in both memory-order forms
        (64, torch.bfloat16, LaunchConfig(num_warps=1, programs=3, relaxed_tail=True, tail="ticket")),
        (160, torch.float32, LaunchConfig(elems_per_thread=64, num_warps=2, programs=5, tail="ticket")),
        (8, torch.bfloat16, LaunchConfig(rows_per_thread=2, num_warps=1, programs=2, relaxed_tail=True, tail="ticket")),
        # (rows over 128 experts above name the packed tail: without a tail they would get the ticket, default_tail)
        # the packed tail with the permutation: offsets from the counts across several 32-expert blocks
        (100, torch.bfloat16, LaunchConfig(elems_per_thread=16, num_warps=1, programs=4)),
    ],
)
@pytest.mark.parametrize("perm", [False, True])
def test_launch_configurations(e, dtype, cfg, perm):
    k = min(e, 6)
    logits = torch.randn(75, e).to(dtype)
    out, ref = _run(logits, k, cfg, renorm=False, perm=perm)
    _check(out, ref, e, perm)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("perm", [False, True])
def test_bias_and_groups(score, perm):
    e, n_groups = 96, 6  # group size 16; 6 groups pad to 8 in the tile
    logits = torch.randn(45, e)
    bias = torch.randn(e) * 0.1
    cfg = LaunchConfig(elems_per_thread=8, num_warps=1, programs=2)
    out, ref = _run(logits, 8, cfg, score=score, bias=bias, scale=2.5, groups=(n_groups, 3), perm=perm)
    _check(out, ref, e, perm)


def test_non_power_of_two_groups():
    e, n_groups = 60, 6  # group size 10: 2-element vectors
    logits = torch.randn(30, e, dtype=torch.bfloat16)
    out, ref = _run(logits, 4, LaunchConfig(num_warps=1), score="sigmoid", groups=(n_groups, 2))
    _check(out, ref, e)


@pytest.mark.parametrize("perm", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("direct_store", [False, True])
def test_exact_fallback_for_wide_dynamic_range(perm, bias, direct_store):
    """fp32 values are ranked relative to the row max; a chosen value far below it (here 1e30 vs ~1) makes the tile
    redo the selection with exact keys."""
    logits = torch.randn(40, 32)
    logits[3, 7] = 1e30
    logits[20, :4] = torch.tensor([1e25, -1e25, 1e-30, 0.0])
    b = torch.zeros(32) if bias else None
    score = "sigmoid" if bias else "softmax"
    cfg = LaunchConfig(num_warps=1, programs=2, direct_store=direct_store)
    out, ref = _run(logits, 5, cfg, score=score, bias=b, perm=perm)
    _check(out, ref, 32, perm)


@pytest.mark.parametrize("perm", [False, True])
@pytest.mark.parametrize("k", [2, 3])
def test_values_sharing_a_compressed_step(k, perm, shared_step):
    """Far below a row's best, fp32 values 1 ulp apart share a compressed step, where the keys order them by column;
    the larger one sits at the higher column, as the last chosen (k=3) or the first left out (k=2): the tile must be
    ranked again with exact keys. The other rows are spread too (distinct steps: no second pass needed)."""
    top, a, b = shared_step(32)
    logits = torch.randn(40, 32) * 3 - 2  # chosen logits across zero: compressed distances
    logits[17, :] = -5.0 + torch.arange(32) * 1e-3
    logits[17, 0], logits[17, 4], logits[17, 9] = top, a, b
    out, ref = _run(logits, k, LaunchConfig(num_warps=1, programs=2), renorm=False, perm=perm)
    assert ref[1][17].tolist() == [0, 9, 4][:k]
    _check(out, ref, 32, perm)


def test_ties_inside_a_relative_key_tile():
    logits = torch.randint(-3, 3, (50, 40)).float()  # fp32 ties: the relative keys break them by index
    out, ref = _run(logits, 7, LaunchConfig(num_warps=1, programs=3), score="sigmoid", renorm=True)
    _check(out, ref, 40)


@settings(max_examples=15, deadline=None)
@given(
    t=st.integers(1, 70),
    e=st.sampled_from([4, 8, 24, 64, 100]),
    k=st.integers(1, 4),
    ept=st.sampled_from([8, 16, 32, 64]),
    rpt=st.sampled_from([1, 2]),
    warps=st.sampled_from([1, 2]),
    programs=st.sampled_from([None, 1, 3]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    perm=st.booleans(),
    prefetch=st.booleans(),
    direct_store=st.sampled_from([None, False, True]),
    relaxed_tail=st.booleans(),
    tail=st.sampled_from(["packed", "ticket"]),
)
def test_random_configurations(t, e, k, ept, rpt, warps, programs, dtype, perm, prefetch, direct_store, relaxed_tail,
                               tail):  # fmt: skip
    cfg = LaunchConfig(elems_per_thread=ept, rows_per_thread=rpt, num_warps=warps, programs=programs,
                       prefetch=prefetch, direct_store=direct_store, relaxed_tail=relaxed_tail, tail=tail)  # fmt: skip
    logits = torch.randn(t, e).to(dtype)
    out, ref = _run(logits, k, cfg, perm=perm)
    _check(out, ref, e, perm)


def test_non_contiguous_rows():
    base = torch.randn(33, 80, dtype=torch.bfloat16)
    logits = base[:, 8:72]  # row stride 80, 64 columns
    out, ref = _run(logits, 4, LaunchConfig(num_warps=1, programs=2))
    _check(out, ref, 64)


@pytest.mark.parametrize("perm", [False, True])
@pytest.mark.parametrize("tail", ["packed", "ticket"])
def test_workspace_is_zero_after_each_launch_and_counts_repeat(tail, perm):
    logits = torch.randn(50, 16)
    args = (logits, 2, "softmax", True, None, 1.0, None, None, perm)
    first = moe_route_triton(*args, config=LaunchConfig(programs=3, tail=tail))
    assert not zeroed(logits.device, 2 * MAX_E).any()
    second = moe_route_triton(*args, config=LaunchConfig(programs=3, tail=tail))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not zeroed(logits.device, 2 * MAX_E).any()


def test_packed_tail_only_where_its_fields_hold_the_totals():
    """Counts and offsets (up to T * k) and the contributing programs must each fit their field of the int64 word,
    else the launcher takes the ticket tail; the limits are exact."""
    slots = 1 << PACK_BITS
    assert packed_tail_fits(slots // 8 - 1, 8, 528) and not packed_tail_fits(slots // 8, 8, 528)
    assert packed_tail_fits(1000, 8, 4095) and not packed_tail_fits(1000, 8, 4096)
    cpu = torch.device("cpu")

    def planned(tokens, programs, tail="packed"):
        cfg = LaunchConfig(programs=programs, tail=tail)
        return _plan(tokens, 64, 8, torch.bfloat16, 64, "softmax", True, False, None, None, False, cpu, cfg, True)

    assert planned(4096, 4).packed_tail and planned(4096, 4).constexprs["PACKED_TAIL"]
    assert not planned(slots // 8, 4).packed_tail and not planned(slots // 8, 4).constexprs["PACKED_TAIL"]
    assert not planned(1 << 20, 4096).packed_tail
    assert not planned(4096, 4, tail="ticket").packed_tail


def test_empty_and_single_token():
    for t in (0, 1):
        logits = torch.randn(t, 12)
        out, ref = _run(logits, 3, None)
        _check(out, ref, 12)
    assert torch.equal(
        moe_route_triton(torch.randn(0, 5), 2, "softmax", True, None, 1.0, None, None, False)[3],
        torch.zeros(5, dtype=torch.int32),
    )


@pytest.mark.parametrize("e, groups", [(8, None), (60, None), (64, 8), (160, None), (256, 8), (1024, None), (13, None)])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_tile_shapes_cover_the_row_within_a_warp(e, groups, itemsize):
    cfg = launch_config(e, 4, itemsize, groups is not None)
    s = tile_shape(e, groups, e, itemsize, cfg)
    lanes = s.G * s.LG
    assert lanes <= 32 and 32 % lanes == 0  # a row never spans warps: row reductions are shuffles only
    assert s.G >= s.NG and s.LG * s.C * s.VEC >= s.SG and s.SG * s.NG == e
    assert s.VEC * itemsize <= 16 and s.SG % s.VEC == 0 and e % s.VEC == 0
    assert s.CB >= (s.G - 1) * s.SG + s.LG * s.C * s.VEC and s.CB & (s.CB - 1) == 0
    assert s.ROWS * lanes == 32 * cfg.num_warps * cfg.rows_per_thread


def test_support_reasons():
    x = torch.randn(4, 8)
    assert _supports(x, 2, "softmax", True, None, 1.0, None, None, False) is True
    assert "dtype torch.float64" in _supports(x.double(), 2, "softmax", True, None, 1.0, None, None, False)
    assert f"> {MAX_E}" in _supports(torch.randn(2, MAX_E + 1), 2, "softmax", True, None, 1.0, None, None, False)
    assert "k=17" in _supports(torch.randn(2, 32), 17, "softmax", True, None, 1.0, None, None, False)
    assert "not contiguous" in _supports(torch.randn(8, 4).t(), 2, "softmax", True, None, 1.0, None, None, False)
    assert "bias not contiguous" in _supports(x, 2, "sigmoid", True, torch.randn(16)[::2], 1.0, None, None, False)


@pytest.mark.parametrize("e, tail", [(8, "packed"), (60, "packed"), (128, "packed"), (160, "ticket"), (256, "ticket")])
def test_launcher_tail_by_row_width(e, tail):
    """The packed tail up to 128 experts, the ticket tail above (see ``launch_config``), biased or grouped or not."""
    for grouped, biased in ((False, False), (False, True), (True, True)):
        assert launch_config(e, 8, 2, grouped, biased).tail == tail
    # a hand-made configuration that names no tail gets the same one
    plan = _plan(512, e, 8, torch.bfloat16, e, "softmax", True, False, None, None, False, torch.device("cpu"),
                 LaunchConfig(programs=2), True)  # fmt: skip
    assert plan.packed_tail == (tail == "packed")
