"""The Triton MX grouped GEMM kernel through the interpreter (tiny shapes): every format pair against the fp32 product
(and within fp32 sums of the fp64 product) of the dequantised operands on uneven groups (empty, single-row, spanning
several tiles), launch configurations, rows past the last offset never written, NaN scales, clamped invalid offsets,
and the inputs it leaves to ATen."""

from dataclasses import replace

import pytest
import torch

import fly_lightning
from fly_lightning.kernels.triton import _mx_grouped_mm_kernel as mk
from fly_lightning.kernels.triton import _support
from fly_lightning.kernels.triton.mx_grouped_mm import _supports, mx_grouped_mm_triton
from fly_lightning.ops.mx_grouped_mm import mx_grouped_mm_reference
from tests.kernels.triton._mx_fp64 import assert_within_fp32_sums, fp64_grouped_mm

PAIRS = [("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e5m2", "mxfp8_e5m2"), ("mxfp4_e2m1", "mxfp4_e2m1"),
         ("mxfp8_e5m2", "mxfp8_e4m3"), (None, "mxfp8_e4m3"), (None, "mxfp4_e2m1")]  # fmt: skip
COUNTS = [0, 3, 70, 0, 17, 1]  # empty groups, a group spanning several 32-row tiles, sizes off multiples of 16


def _problem(x_fmt, w_fmt, counts=COUNTS, k=128, n=40, tail=5, x_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(int(offs[-1]) + tail, k, generator=gen)
    w = torch.randn(len(counts), n, k, generator=gen)
    wd, ws = fly_lightning.mx_cast(w.reshape(-1, k), w_fmt)
    xd, xs = (x.to(x_dtype), None) if x_fmt is None else fly_lightning.mx_cast(x, x_fmt)
    return [xd, xs, x_fmt, wd.view(len(counts), n, -1), ws.view(len(counts), n, -1), w_fmt, offs]


def _check(out, args, tol=1e-5):
    end = int(args[-1][-1])
    ref = mx_grouped_mm_reference(*args, torch.float32)[:end]
    err = ((out[:end].float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < tol, err


@pytest.mark.parametrize("x_fmt, w_fmt", PAIRS)
def test_formats_on_uneven_groups(x_fmt, w_fmt):
    args = _problem(x_fmt, w_fmt)
    out = mx_grouped_mm_triton(*args, torch.float32)  # outputs are poisoned (NaN) in tests
    _check(out, args)  # the interpreter multiplies in fp32: only the summation order differs from the oracle
    assert out[int(args[-1][-1]) :].isnan().all()  # rows past the last offset are never written


CONFIGS = {
    "interpreter": mk.INTERPRETER_CONFIG,
    "block_k128_m16": replace(mk.INTERPRETER_CONFIG, block_m=16, block_k=128, group_m=1),
    "block_n64_k32": replace(mk.INTERPRETER_CONFIG, block_n=64, block_k=32, group_m=4),
    "prepass": mk.PREPASS,  # dequantised to bf16 in memory, then the bf16 grouped kernel
    "swapped": mk.SWAPPED,  # the plan for few rows per group on sm90: x dequantised first, weights swapped
    "swapped_mid": mk.SWAPPED_MID,  # from 65 (MXFP4 weights) or 97 rows per group on sm90, below 256
    "swapped_wide": mk.SWAPPED_WIDE,  # from 256 rows per group on sm90, below 1024
}


@pytest.mark.parametrize(
    "x_fmt, w_fmt, config",  # the swapped plans dequantise MX x first: weight-only never takes them
    [
        (x, w, c)
        for c in ("interpreter", "prepass", "swapped", "swapped_mid", "swapped_wide")
        for x, w in PAIRS
        if x is not None or not c.startswith("swapped")
    ],
)
def test_within_fp32_sums_of_the_fp64_product(x_fmt, w_fmt, config):
    """Against the fp64 product of the dequantised operands, fp32 and bf16 out."""
    args = _problem(x_fmt, w_fmt, x_dtype=torch.bfloat16, seed=2)  # high-precision x in bf16: the MMAs take it as is
    want, size = fp64_grouped_mm(*args)
    for out_dtype in (torch.float32, torch.bfloat16):
        out = torch.full((args[0].shape[0], want.shape[1]), float("nan"), dtype=out_dtype)
        mk.launch(*args, out, config=CONFIGS[config])
        assert_within_fp32_sums(out, want, size, k=128)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_launch_configurations(name):
    args = _problem("mxfp4_e2m1", "mxfp4_e2m1", k=256, n=72)
    out = torch.full((args[0].shape[0], 72), float("nan"))
    mk.launch(*args, out, config=CONFIGS[name])
    _check(out, args)
    assert out[int(args[-1][-1]) :].isnan().all()


@pytest.mark.parametrize("w_fmt", ["mxfp8_e4m3", "mxfp4_e2m1"])
@pytest.mark.parametrize("x_fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1", None])
def test_plans_by_rows_per_group(x_fmt, w_fmt):
    """MX x (every format) on sm90: swapped tiles of 64 rows up to SWAP_MAX_ROWS rows per group (SWAP_FP8_MAX_ROWS
    with MXFP8 weights), then of 128 rows, of 256 from PREPASS_MIN_ROWS up to SWAP_WIDE_MAX_ROWS, the bf16 prepass from
    there; off sm90 in-loop tiles, the prepass from PREPASS_MIN_ROWS. Weight-only never swapped (untimed) nor
    converted in memory; the interpreter its own plan."""
    rows_per_group = (1, 64, 65, 96, 97, 255, 256, 1023, 1024)
    plans = {rows: mk.choose_config(rows * 128, 128, False, x_fmt, w_fmt, sm90=True) for rows in rows_per_group}
    if x_fmt is None:
        assert all(plans[r] == mk.loop_config(r * 128, 128, x_fmt, w_fmt) for r in rows_per_group)
        assert plans[64] == mk.SMALL_GROUPS and plans[1024] == mk.WEIGHT_ONLY
    else:
        last_64 = 64 if w_fmt == "mxfp4_e2m1" else 96  # the last row count on 64-row tiles
        assert all(plans[r] == (mk.SWAPPED if r <= last_64 else mk.SWAPPED_MID) for r in rows_per_group if r < 256)
        assert plans[256] == plans[1023] == mk.SWAPPED_WIDE and plans[1024] == mk.PREPASS
    # the rows above are the table's bounds
    assert (mk.SWAP_MAX_ROWS, mk.SWAP_FP8_MAX_ROWS, mk.PREPASS_MIN_ROWS, mk.SWAP_WIDE_MAX_ROWS) == (64, 96, 256, 1024)
    for rows in rows_per_group:  # sm80, Blackwell: untimed there
        plan = mk.choose_config(rows * 128, 128, False, x_fmt, w_fmt, sm90=False)
        assert plan == (mk.PREPASS if x_fmt and rows >= 256 else mk.loop_config(rows * 128, 128, x_fmt, w_fmt)), rows
    assert mk.choose_config(64 * 128, 128, True, x_fmt, w_fmt, sm90=True) == mk.INTERPRETER_CONFIG


@pytest.mark.parametrize("capability, planned", [((9, 0), True), ((8, 0), False), ((10, 0), False), ((12, 0), False)])
def test_the_swapped_plan_is_for_hopper_only(monkeypatch, capability, planned):
    """``hopper``: sm90 only (Blackwell's MMAs and shared memory differ; SWAPPED was written and timed on Hopper)."""
    from fly_lightning.kernels.triton import _mx_dequant

    class _OnGPU:  # what hopper reads of a tensor
        is_cuda, device = True, torch.device("cuda", 0)

    monkeypatch.setattr(_mx_dequant, "interpreting", lambda: False)
    monkeypatch.setattr(_mx_dequant, "_capability", lambda index: capability)
    assert _mx_dequant.hopper(_OnGPU()) is planned
    assert not _mx_dequant.hopper(torch.zeros(1))  # CPU tensors: never


SWAPPED = replace(mk.INTERPRETER_CONFIG, block_m=16, block_n=32, block_k=128, swap=True)


@pytest.mark.parametrize("fragment_k", [False, True], ids=["natural", "fragk"])
@pytest.mark.parametrize("x_fmt, w_fmt", PAIRS)
def test_swapped_tiles(x_fmt, w_fmt, fragment_k):
    """Weights on the MMA's M side, the group's rows on its N side: every format pair on uneven groups; with
    ``fragment_k`` (high-precision x, or MX x dequantised first by ``x_prepass``) K summed in the register fragment's
    order. A NaN weight block gives its column NaN in that group only; rows past the last offset stay unwritten."""
    args = _problem(x_fmt, w_fmt, k=256, n=72)
    scales = args[4].view(torch.uint8)
    kept = scales[1, 3, 2].item()
    scales[1, 3, 2] = 255  # group 1 (3 rows), weight row 3: one NaN block
    cfg = replace(SWAPPED, fragment_k=fragment_k, x_prepass=fragment_k and x_fmt is not None)
    out = torch.full((args[0].shape[0], 72), float("nan"))
    mk.launch(*args, out, config=cfg)
    end, offs = int(args[-1][-1]), args[-1].tolist()
    nan_rows = torch.zeros(out.shape[0], dtype=torch.bool)
    nan_rows[offs[0] : offs[1]] = True
    assert out[:end, 3].isnan().equal(nan_rows[:end]) and out[end:].isnan().all()
    scales[1, 3, 2] = kept
    ref = mx_grouped_mm_reference(*args, torch.float32)[:end]
    out[offs[0] : offs[1], 3] = ref[offs[0] : offs[1], 3]
    assert ((out[:end] - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize(
    "x_fmt, cfg, match",
    [
        ("mxfp8_e4m3", replace(SWAPPED, fragment_k=True), "fragment_k is for swapped tiles"),  # MX x, no x_prepass
        (None, replace(SWAPPED, swap=False, fragment_k=True), "fragment_k is for swapped tiles"),
        (None, replace(SWAPPED, block_k=64, fragment_k=True), "fragment_k is for swapped tiles"),
        (None, replace(SWAPPED, x_prepass=True), "x_prepass needs MX x"),
    ],
)
def test_launch_rejects_fragment_k_and_x_prepass_off_their_forms(x_fmt, cfg, match):
    args = _problem(x_fmt, "mxfp4_e2m1", k=256, n=8)
    out = torch.full((args[0].shape[0], 8), float("nan"))
    with pytest.raises(ValueError, match=match):  # before any launch
        mk.launch(*args, out, config=cfg)
    assert out.isnan().all()


def test_bf16_output_and_bf16_activations():
    args = _problem(None, "mxfp8_e4m3", x_dtype=torch.bfloat16)
    out = mx_grouped_mm_triton(*args, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    _check(out, args, tol=1e-2)


def test_dispatched_call_takes_triton():
    args = _problem("mxfp8_e4m3", "mxfp8_e4m3", counts=[4, 0, 9])
    xd, xs, x_fmt, wd, ws, w_fmt, offs = args
    y = fly_lightning.mx_grouped_mm(xd, wd, ws, w_fmt, offs, x_scale=xs, x_fmt=x_fmt, out_dtype=torch.float32)
    assert fly_lightning.DISPATCH_LOG.records("mx_grouped_mm")[-1]["backend"] == "triton"
    _check(y, args)


@pytest.mark.parametrize("config", [None, mk.SWAPPED])
def test_nan_scale_gives_a_nan_row(config):
    args = _problem("mxfp8_e4m3", "mxfp8_e4m3", counts=[10, 10])
    args[1].view(torch.uint8)[12, 2] = 255  # row 12 (group 1): one NaN block
    out = mk.launch(*args, torch.zeros(25, 40), config=config)
    assert out[:20].isnan().any(1).nonzero().flatten().tolist() == [12] and out[12].isnan().all()


@pytest.mark.parametrize("config", [None, mk.PREPASS, mk.SWAPPED])
def test_invalid_device_offsets_are_clamped(config):
    # the host never reads device offsets; the kernel clamps them to [0, M] and makes the groups non-negative (the
    # prepass skips the weights of groups 0 and 2 as the GEMM, which never reads them, counts them: empty)
    args = _problem("mxfp8_e4m3", "mxfp8_e4m3", counts=[6, 6, 6], tail=0)
    bad = list(args)
    bad[-1] = torch.tensor([-3, 500, 2], dtype=torch.int32)  # read as [0, 18, 18]
    out = mk.launch(*bad, torch.full((18, 40), float("nan")), config=config)
    good = list(args)
    good[-1] = torch.tensor([0, 18, 18], dtype=torch.int32)
    _check(out, good)


def _reason(args) -> str | bool:
    return _supports(*args, torch.bfloat16)


def test_support_reasons():
    args = _problem("mxfp8_e4m3", "mxfp8_e4m3")
    assert _reason(args) is True
    short = _problem("mxfp8_e4m3", "mxfp8_e4m3", k=96)
    assert "K=96 not a multiple of 128" in _reason(short)
    strided = list(args)
    strided[3] = args[3].transpose(1, 2).contiguous().transpose(1, 2)
    assert "w last dim not contiguous" in _reason(strided) and "bytes" in _reason(strided)
    many = list(args)
    many[3] = torch.zeros(4097, 8, 128, dtype=torch.float8_e4m3fn)
    many[4] = torch.zeros(4097, 8, 4, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    many[6] = torch.arange(4097, dtype=torch.int32)
    assert "4097 groups" in _reason(many)


def test_rocm_is_left_to_aten_with_a_reason(monkeypatch):
    from fly_lightning.kernels.triton import mx_grouped_mm as module

    monkeypatch.setattr(module, "ON_HIP", True)
    assert "ROCm" in _reason(_problem("mxfp8_e4m3", "mxfp8_e4m3"))


def test_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "CPU" in _reason(_problem("mxfp8_e4m3", "mxfp8_e4m3"))
    assert _support.device_reason(torch.empty(1)) is not None
