"""The Triton MX GEMM (interpreter): against the fp32 reference (and within fp32 sums of the fp64 product of the
dequantised operands) for every format pair and the weight-only form, in each launch plan (plain, swapped, split K,
dequantising prepass), with rows and columns not multiples of the tile, zero and extreme scales and NaN blocks; every
output element written (outputs are poisoned in tests); the inputs it leaves to ATen named."""

import pytest
import torch

import fly_lightning
from fly_lightning import DISPATCH_LOG
from fly_lightning.kernels.triton._workspace import zeroed
from fly_lightning.kernels.triton.mx_scaled_mm import MXMMConfig, _supports, launch, plan
from fly_lightning.ops.mx_scaled_mm import mx_scaled_mm_reference
from fly_lightning.policy import dispatch_config
from fly_lightning.quant import formats
from tests.kernels.triton._mx_fp64 import assert_within_fp32_sums, fp64_mm

PAIRS = [
    ("mxfp8_e4m3", "mxfp8_e4m3"),
    ("mxfp8_e5m2", "mxfp8_e5m2"),
    ("mxfp4_e2m1", "mxfp4_e2m1"),
    ("mxfp8_e4m3", "mxfp4_e2m1"),
    (None, "mxfp4_e2m1"),
    (None, "mxfp8_e4m3"),
    (None, "mxfp8_e5m2"),
]
PLANS = {
    "plain": MXMMConfig(16, 32, 128),
    "swap": MXMMConfig(16, 32, 128, swap=True),
    "split": MXMMConfig(32, 16, 128, swap=True, split_k=2),
    "prepass": MXMMConfig(16, 32, 128, prepass=True),
    "auto": None,
}


def _operands(m, n, k, a_fmt, b_fmt, seed=0, spread=8):
    """Random operands whose rows (a) and K columns (b) span 2^-spread..2^spread: blocks with different scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-spread, spread, (m, 1), generator=g).float())
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-spread, spread, (1, k), generator=g).float())
    b, bs = formats.to_mx(w, b_fmt)
    if a_fmt is None:
        return x.bfloat16(), None, b, bs
    a, a_s = formats.to_mx(x, a_fmt)
    return a, a_s, b, bs


def _check(a, a_s, a_fmt, b, bs, b_fmt, out_dtype=torch.float32, config=None):
    y = launch(a, a_s, a_fmt, b, bs, b_fmt, out_dtype, config)
    want = mx_scaled_mm_reference(a, a_s, a_fmt, b, bs, b_fmt, torch.float32)
    assert y.dtype == out_dtype and y.shape == want.shape
    nan = want.isnan()
    assert torch.equal(y.isnan(), nan)
    # exact products of the dequantised values, fp32 sums: only the order of the sums differs
    scale = want.nan_to_num(0).abs().amax().clamp_min(1e-30)
    tol = 1e-5 if out_dtype == torch.float32 else 8e-3
    assert ((y.float() - want).nan_to_num(0).abs() <= tol * scale).all(), (y - want).abs().max()
    return y, want


@pytest.mark.parametrize("plan_name", sorted(PLANS))
@pytest.mark.parametrize("a_fmt, b_fmt", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_matches_the_reference(a_fmt, b_fmt, plan_name):
    # M and N not multiples of the tiles; K of 2 steps (3 for the plain plan's own shape)
    m, n, k = (37, 45, 256) if plan_name != "plain" else (21, 70, 384)
    a, a_s, b, bs = _operands(m, n, k, a_fmt, b_fmt)
    _check(a, a_s, a_fmt, b, bs, b_fmt, config=PLANS[plan_name])


@pytest.mark.parametrize("plan_name", ["auto", "split", "prepass"])
@pytest.mark.parametrize("a_fmt, b_fmt", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_within_fp32_sums_of_the_fp64_product(a_fmt, b_fmt, plan_name):
    """Against the fp64 product of the dequantised operands (not only an fp32 GEMM of them), fp32 and bf16 out."""
    m, n, k = 37, 45, 256
    a, a_s, b, bs = _operands(m, n, k, a_fmt, b_fmt, seed=3)
    want, size = fp64_mm(a, a_s, a_fmt, b, bs, b_fmt)
    for out_dtype in (torch.float32, torch.bfloat16):
        assert_within_fp32_sums(launch(a, a_s, a_fmt, b, bs, b_fmt, out_dtype, PLANS[plan_name]), want, size, k)


@pytest.mark.parametrize("plan_name", ["auto", "prepass"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_output_dtypes(out_dtype, plan_name):
    a, a_s, b, bs = _operands(20, 33, 128, "mxfp8_e4m3", "mxfp8_e4m3", seed=1, spread=2)  # within fp16
    _check(a, a_s, "mxfp8_e4m3", b, bs, "mxfp8_e4m3", out_dtype, PLANS[plan_name])


@pytest.mark.parametrize("plan_name", ["auto", "prepass"])
@pytest.mark.parametrize("a_fmt, b_fmt", PAIRS[:3] + PAIRS[4:5], ids=["e4m3", "e5m2", "fp4", "w-fp4"])
def test_zero_extreme_and_nan_scales(a_fmt, b_fmt, plan_name):
    """Scales 0 (2^-127) and 254 (2^127) on the elements, a NaN block, and elements whose products leave bf16's normal
    range: exact agreement needs the tolerance only for underflow far below every other term."""
    m, n, k = 8, 24, 256
    a, a_s, b, bs = _operands(m, n, k, a_fmt, b_fmt, seed=2)
    bs = bs.view(torch.uint8).clone()
    bs[0, :] = 0  # a column computed at 2^-127 scales: the products are far below 2^-126
    bs[1, 0] = 254
    bs[2, 3] = 255  # NaN block: column 2 is NaN
    bs[3, :] = 140
    bs = bs.view(torch.float8_e8m0fnu)
    if a_s is not None:
        a_s = a_s.view(torch.uint8).clone()
        a_s[1, 0] = 0
        a_s[4, :] = 100
        a_s = a_s.view(torch.float8_e8m0fnu)
    y, want = _check(a, a_s, a_fmt, b, bs, b_fmt, config=PLANS[plan_name])
    assert y[:, 2].isnan().all() and not y[:, 3:].isnan().any()
    assert (y[:, 1] != 0).all()  # 2^127 times the first block: large, finite where the reference is


def test_zero_column_of_scales_is_tiny_not_lost():
    """A weight row whose scales are all 0 (2^-127): its column equals the reference's tiny values within bf16's
    subnormal precision, relative to that column."""
    a, a_s, b, bs = _operands(4, 8, 128, "mxfp8_e4m3", "mxfp8_e4m3", seed=3)
    a_s = torch.full_like(a_s.view(torch.uint8), 127).view(torch.float8_e8m0fnu)
    bs = bs.view(torch.uint8).clone()
    bs[0] = 0
    bs = bs.view(torch.float8_e8m0fnu)
    y = launch(a, a_s, "mxfp8_e4m3", b, bs, "mxfp8_e4m3", torch.float32)
    want = mx_scaled_mm_reference(a, a_s, "mxfp8_e4m3", b, bs, "mxfp8_e4m3", torch.float32)
    col = want[:, 0].abs().amax()
    assert 0 < col < 1e-30
    assert ((y[:, 0] - want[:, 0]).abs() <= 0.1 * col).all()
    assert torch.allclose(y[:, 1:], want[:, 1:], rtol=1e-5, atol=1e-5 * want.abs().amax().item())


def test_strided_rows_and_empty():
    a, a_s, b, bs = _operands(12, 40, 256, "mxfp4_e2m1", "mxfp4_e2m1", seed=4)
    wide = torch.zeros(12, 200, dtype=torch.uint8)
    wide[:, 8:136] = a
    _check(wide[:, 8:136], a_s, "mxfp4_e2m1", b, bs, "mxfp4_e2m1")  # rows of a wider buffer
    y = launch(a[:0], a_s[:0], "mxfp4_e2m1", b, bs, "mxfp4_e2m1", torch.bfloat16)
    assert y.shape == (0, 40)


def test_plans():
    assert plan(16, 4096, 4096, None, "mxfp4_e2m1", torch.device("cpu")).swap
    cuda = torch.device("cuda")
    small = plan(16, 4096, 4096, None, "mxfp4_e2m1", cuda, sms=132)
    # weight-only MXFP4 up to 32 rows: unswapped, byte tables; at 64 rows unswapped, pairs; fp8 weights swapped
    assert not small.swap and small.fp4_lut and small.split_k == 4 and 4096 % (small.block_k * small.split_k) == 0
    at64 = plan(64, 4096, 4096, None, "mxfp4_e2m1", cuda, sms=132)
    assert not (at64.swap or at64.fp4_lut)
    fp8 = plan(16, 4096, 4096, None, "mxfp8_e4m3", cuda, sms=132)
    assert fp8.swap and not fp8.fp4_lut and fp8.split_k == small.split_k
    big = plan(8192, 8192, 8192, "mxfp8_e4m3", "mxfp8_e4m3", cuda, sms=132, fp8_gemm=False)
    assert big.prepass and big.label() == "prepass-cublas"  # many rows: dequantise once, then cuBLAS
    # with cuBLAS's blockwise fp8 GEMM (Hopper): e4m3 / e2m1 operands re-expressed for it, bf16 output, from 128 rows
    fp8_plan = plan(128, 4096, 4096, "mxfp8_e4m3", "mxfp4_e2m1", cuda, sms=132, fp8_gemm=True)
    assert fp8_plan.prepass and fp8_plan.fp8_blockwise and fp8_plan.label() == "prepass-fp8-cublas"
    for args, kw in [
        ((8192, 8192, 8192, "mxfp8_e5m2", "mxfp8_e5m2"), {}),  # e5m2: out of e4m3's range
        ((8192, 8192, 8192, "mxfp8_e4m3", "mxfp8_e4m3"), {"out_dtype": torch.float32}),  # fp32 sums kept exact
        ((8192, 8200, 8192, "mxfp4_e2m1", "mxfp4_e2m1"), {}),  # N % 16
        ((127, 8192, 8192, "mxfp4_e2m1", "mxfp4_e2m1"), {}),  # below the prepass
        ((8192, 8192, 8192, None, "mxfp4_e2m1"), {}),  # bf16 activations
    ]:
        assert not plan(*args, cuda, sms=132, fp8_gemm=True, **kw).fp8_blockwise, (args, kw)
    assert not plan(8192, 8192, 8192, "mxfp8_e4m3", "mxfp8_e4m3", cuda, sms=132).fp8_blockwise  # CPU torch: no CUDA
    mid = plan(100, 8192, 8192, "mxfp8_e4m3", "mxfp8_e4m3", cuda, sms=132)
    assert not (mid.prepass or mid.swap) and mid.split_k == 1 and mid.block_k == 128
    assert not plan(8192, 64, 128, "mxfp8_e4m3", "mxfp8_e4m3", torch.device("cpu")).prepass  # interpreter: in-loop


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_split_k_sums_in_the_kernel_in_split_order(out_dtype):
    """Four K splits over several output tiles: the last program of each tile sums the fp32 partials in split order,
    so the result is the same sums as adding the four partial products in order, on every call (bf16: within
    ``_check``'s tolerance, as the interpreter's float -> bf16 conversion truncates). The tiles' arrival counters
    live in the shared zeroed workspace: zero again after each launch, so the next call counts from zero."""
    m, n, k, split = 37, 45, 512, 4
    a, a_s, b, bs = _operands(m, n, k, None, "mxfp4_e2m1", seed=5)
    cfg = MXMMConfig(16, 16, 128, swap=True, split_k=split)
    y, _ = _check(a, a_s, None, b, bs, "mxfp4_e2m1", out_dtype, cfg)
    assert not zeroed(a.device, 12).any()  # 3 x 3 tiles counted, then zeroed
    assert torch.equal(y, launch(a, a_s, None, b, bs, "mxfp4_e2m1", out_dtype, cfg))
    assert not zeroed(a.device, 12).any()
    if out_dtype != torch.float32:
        return
    q = k // split
    parts = [
        launch(a[:, i * q : (i + 1) * q], None, None, b[:, i * q // 2 : (i + 1) * q // 2],
               bs[:, i * q // 32 : (i + 1) * q // 32], "mxfp4_e2m1", torch.float32, MXMMConfig(16, 16, 128, swap=True))
        for i in range(split)
    ]  # fmt: skip
    assert torch.equal(y, parts[0] + parts[1] + parts[2] + parts[3])


WEIGHT_ONLY = [pair for pair in PAIRS if pair[0] is None]


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("b_fmt", [b for _, b in WEIGHT_ONLY])
def test_fragment_k_matches_the_reference(b_fmt, split_k):
    """``fragment_k``: the MMA sums K in ``_fragment_k``'s order (weights decoded in natural order, then renamed;
    activations read in that order), the same products as the reference, with rows and columns off the tiles, blocks
    of scale 0 (2^-127) and 254, and a NaN block."""
    m, n, k = 37, 45, 512
    a, _, b, bs = _operands(m, n, k, None, b_fmt, seed=7)
    bs = bs.view(torch.uint8).clone()
    bs[1, 0], bs[2, 5], bs[3, :] = 254, 255, 0
    bs = bs.view(torch.float8_e8m0fnu)
    cfg = MXMMConfig(16, 32, 128, swap=True, split_k=split_k, fragment_k=True)
    y, _ = _check(a, None, None, b, bs, b_fmt, config=cfg)
    assert y[:, 2].isnan().all() and not y[:, 3:].isnan().any() and (y[:, 1] != 0).all()
    assert cfg.label().endswith("-fragk")


@pytest.mark.parametrize(
    "a_fmt, cfg",
    [
        ("mxfp8_e4m3", MXMMConfig(16, 32, 128, swap=True, fragment_k=True)),  # MX activations
        (None, MXMMConfig(16, 32, 128, fragment_k=True)),  # not swapped: the weights are not the register operand
    ],
)
def test_launch_rejects_fragment_k_off_swapped_weight_only(a_fmt, cfg):
    a, a_s, b, bs = _operands(4, 8, 128, a_fmt, "mxfp4_e2m1")
    with pytest.raises(ValueError, match="fragment_k is for swapped weight-only plans"):  # before any launch
        launch(a, a_s, a_fmt, b, bs, "mxfp4_e2m1", torch.float32, cfg)


@pytest.mark.parametrize(
    "a_fmt, b_fmt, out_dtype",
    [("mxfp8_e5m2", "mxfp8_e5m2", torch.bfloat16), ("mxfp8_e4m3", "mxfp8_e4m3", torch.float32)],
)
def test_launch_rejects_fp8_blockwise_off_its_operands(a_fmt, b_fmt, out_dtype):
    a, a_s, b, bs = _operands(4, 16, 128, a_fmt, b_fmt)
    cfg = MXMMConfig(128, 256, 128, prepass=True, fp8_blockwise=True)
    with pytest.raises(ValueError, match="N % 16 and a bf16 output"):  # before any launch
        launch(a, a_s, a_fmt, b, bs, b_fmt, out_dtype, cfg)


def test_launch_rejects_a_split_that_does_not_divide_k():
    a, a_s, b, bs = _operands(4, 8, 128, "mxfp8_e4m3", "mxfp8_e4m3")
    with pytest.raises(ValueError, match="multiple of block_k"):
        launch(a, a_s, "mxfp8_e4m3", b, bs, "mxfp8_e4m3", torch.float32, MXMMConfig(16, 16, 128, split_k=2))


def test_launch_rejects_swapped_mxfp4_plans_off_the_planned_block_k():
    a, a_s, b, bs = _operands(4, 8, 128, None, "mxfp4_e2m1")
    with pytest.raises(ValueError, match="need block_k 128"):  # before any launch
        launch(a, a_s, None, b, bs, "mxfp4_e2m1", torch.float32, MXMMConfig(16, 16, 64, swap=True))


def test_dispatch_serves_it_and_records_fallbacks():
    a, a_s, b, bs = _operands(9, 16, 128, "mxfp8_e4m3", "mxfp8_e4m3")
    with dispatch_config(backends=("triton",)):
        y = fly_lightning.mx_scaled_mm(a, b, bs, "mxfp8_e4m3", a_scale=a_s, a_fmt="mxfp8_e4m3")
        assert DISPATCH_LOG.records("mx_scaled_mm")[-1]["backend"] == "triton"
        want = mx_scaled_mm_reference(a, a_s, "mxfp8_e4m3", b, bs, "mxfp8_e4m3", torch.bfloat16)
        assert torch.allclose(y.float(), want.float(), rtol=8e-3, atol=1e-3)
        a2, a2_s, b2, b2s = _operands(9, 16, 96, "mxfp8_e4m3", "mxfp8_e4m3")  # K % 128 != 0: ATen
        fly_lightning.mx_scaled_mm(a2, b2, b2s, "mxfp8_e4m3", a_scale=a2_s, a_fmt="mxfp8_e4m3")
        assert DISPATCH_LOG.records("mx_scaled_mm")[-1]["backend"] == "aten"


@pytest.mark.parametrize(
    "build, reason",
    [
        (lambda: _operands(4, 8, 96, "mxfp8_e4m3", "mxfp8_e4m3"), "not a multiple of 128"),
        (lambda: (torch.randn(4, 128), None, *_operands(4, 8, 128, None, "mxfp4_e2m1")[2:]), "activations"),
    ],
)
def test_support_reasons(build, reason):
    a, a_s, b, bs = build()
    a_fmt = "mxfp8_e4m3" if a_s is not None else None
    got = _supports(a, a_s, a_fmt, b, bs, "mxfp8_e4m3" if a_s is not None else "mxfp4_e2m1", torch.bfloat16)
    assert isinstance(got, str) and reason in got


def test_support_names_a_layout_copy_with_its_bytes():
    a, a_s, b, bs = _operands(8, 8, 128, "mxfp8_e4m3", "mxfp8_e4m3")
    bt = b.view(torch.uint8).t().contiguous().t().view(torch.float8_e4m3fn)  # same values, column-major
    got = _supports(a, a_s, "mxfp8_e4m3", bt, bs, "mxfp8_e4m3", torch.bfloat16)
    assert isinstance(got, str) and "b last dim not contiguous" in got and f"{8 * 128} bytes" in got
    assert _supports(a, a_s, "mxfp8_e4m3", b, bs, "mxfp8_e4m3", torch.bfloat16) is True
