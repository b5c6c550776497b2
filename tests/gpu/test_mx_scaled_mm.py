"""The Triton MX GEMM on the GPU (compiled, bf16 arithmetic and wgmma, which the interpreter cannot show): every format
pair and the weight-only form, in the plans the launcher picks for few, some and many rows (swapped + split K, plain,
dequantising prepass + cuBLAS), against the fp32 reference of the dequantised operands; zero, extreme and NaN scales;
served through the dispatcher; the prepass's dequantisation equal to ``from_mx`` on every code."""

from __future__ import annotations

import pytest
import torch

import fly_lightning
from fly_lightning import DISPATCH_LOG
from fly_lightning.ops.mx_scaled_mm import mx_scaled_mm_reference
from fly_lightning.quant import formats

pytestmark = pytest.mark.gpu

PAIRS = [
    ("mxfp8_e4m3", "mxfp8_e4m3"),
    ("mxfp8_e5m2", "mxfp8_e5m2"),
    ("mxfp4_e2m1", "mxfp4_e2m1"),
    (None, "mxfp4_e2m1"),
    (None, "mxfp8_e4m3"),
]
SHAPES = [(1, 256, 512), (16, 4096, 4096), (50, 384, 1024), (200, 520, 768), (1000, 1024, 2048), (2048, 768, 512)]


def _operands(m, n, k, a_fmt, b_fmt, spread=8):
    """Operands with rows of ``x`` and columns of ``w`` scaled by powers of two in ``[2^-spread, 2^spread)``."""
    x, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    if spread:
        x = x * torch.exp2(torch.randint(-spread, spread, (m, 1), device="cuda").float())
        w = w * torch.exp2(torch.randint(-spread, spread, (1, k), device="cuda").float())
    b, bs = formats.to_mx(w, b_fmt)
    if a_fmt is None:
        return x.bfloat16(), None, b, bs
    return (*formats.to_mx(x, a_fmt), b, bs)


def _mm(a, a_s, a_fmt, b, bs, b_fmt, out_dtype=torch.float32):
    y = fly_lightning.mx_scaled_mm(a, b, bs, b_fmt, a_scale=a_s, a_fmt=a_fmt, out_dtype=out_dtype)  # default policy
    assert DISPATCH_LOG.records("mx_scaled_mm")[-1]["backend"] == "triton"
    return y


@pytest.mark.parametrize("m, n, k", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("a_fmt, b_fmt", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_matches_the_reference(a_fmt, b_fmt, m, n, k):
    a, a_s, b, bs = _operands(m, n, k, a_fmt, b_fmt)
    y = _mm(a, a_s, a_fmt, b, bs, b_fmt)
    want = mx_scaled_mm_reference(a, a_s, a_fmt, b, bs, b_fmt, torch.float32)
    # exact bf16 operands, fp32 sums: only the summation order differs from the reference
    tol = 2e-5 * want.abs().amax()
    assert ((y - want).abs() <= tol).all(), ((y - want).abs().max().item(), tol.item())
    y16 = _mm(a, a_s, a_fmt, b, bs, b_fmt, torch.bfloat16)
    assert torch.allclose(y16.float(), want, rtol=1e-2, atol=1e-2 * want.abs().amax().item())


@pytest.mark.parametrize("m", [24, 300], ids=["loop", "prepass"])
@pytest.mark.parametrize("a_fmt, b_fmt", PAIRS[:4], ids=["e4m3", "e5m2", "fp4", "w-fp4"])
def test_zero_extreme_and_nan_scales(a_fmt, b_fmt, m):
    a, a_s, b, bs = _operands(m, 256, 512, a_fmt, b_fmt, spread=2)
    bs = bs.view(torch.uint8).clone()
    bs[0, :] = 0  # 2^-127: products far below 2^-126
    bs[1, 0] = 225  # 2^98 on one block: large products, finite in fp32 and bf16
    bs[2, 3] = 255  # NaN block
    bs = bs.view(torch.float8_e8m0fnu)
    y = _mm(a, a_s, a_fmt, b, bs, b_fmt)
    want = mx_scaled_mm_reference(a, a_s, a_fmt, b, bs, b_fmt, torch.float32)
    assert torch.equal(y.isnan(), want.isnan()) and y[:, 2].isnan().all()
    finite = ~want.isnan()
    scale = want[finite].abs().amax()
    assert ((y - want)[finite].abs() <= 2e-5 * scale).all()
    assert torch.isfinite(y[:, 1]).all() and (y[:, 1].abs() > 1e20).any()


@pytest.mark.parametrize("fp8_cvt", ["bits", "hw", "prepass"])
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2"])
@pytest.mark.parametrize("m", [16, 300])
def test_fp8_conversions_agree_on_every_code(fmt, m, fp8_cvt):
    """Both fp8 conversions in the main loop (float8 -> f16 instructions, the default; bit placement), in the in-loop
    plan for these rows, and the dequantising prepass, on data holding every code, NaN and inf included."""
    from dataclasses import replace

    from fly_lightning.kernels.triton.mx_scaled_mm import launch, plan

    n, k = 256, 512
    codes = torch.arange(256, device="cuda", dtype=torch.int32).to(torch.uint8)
    a = codes.repeat(m, k // 256).roll(1, 0)  # rows shifted so NaN codes do not line up everywhere
    b = codes.repeat(n, k // 256)
    a[:, :] = torch.where(torch.rand(m, k, device="cuda") < 0.999, a.roll(7, 1) & 0x7B, a)  # mostly finite codes
    b = torch.where(torch.rand(n, k, device="cuda") < 0.999, b & 0x7B, b)
    a_s = torch.randint(110, 140, (m, k // 32), device="cuda", dtype=torch.uint8).view(torch.float8_e8m0fnu)
    bs = torch.randint(110, 140, (n, k // 32), device="cuda", dtype=torch.uint8).view(torch.float8_e8m0fnu)
    dt = formats.FORMATS[fmt].torch_dtype
    a, b = a.view(dt), b.view(dt)
    base = replace(plan(m, 128 if m > 64 else n, k, fmt, fmt, a.device, out_dtype=torch.float32), prepass=False)
    cfg = replace(base, prepass=True) if fp8_cvt == "prepass" else replace(base, fp8_cvt=fp8_cvt)
    y = launch(a, a_s, fmt, b, bs, fmt, torch.float32, cfg)
    want = mx_scaled_mm_reference(a, a_s, fmt, b, bs, fmt, torch.float32)
    assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.isinf(), want.isinf())
    finite = torch.isfinite(want)
    assert finite.any()
    assert ((y - want)[finite].abs() <= 2e-5 * want[finite].abs().amax()).all()


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1"])
def test_prepass_dequantisation_equals_from_mx_on_every_code(fmt):
    from fly_lightning.kernels.triton._mx_dequant import dequantize, hw_cvt

    per_byte = 2 if fmt == "mxfp4_e2m1" else 1
    r, c = 37, 1088  # rows and columns off the kernel's 16 x 512 tile
    codes = (torch.arange(c // per_byte, device="cuda", dtype=torch.int32) % 256).to(torch.uint8).repeat(r, 1)
    data = codes.roll(3, 1) if per_byte == 2 else codes.view(formats.FORMATS[fmt].torch_dtype)
    # every scale: 0 (2^-127) and small ones (subnormal bf16 products), 254 (2^127: e4m3 and e5m2 overflow bf16 to
    # inf, as from_mx's rounding), 255 (NaN blocks)
    s = (torch.arange(r * (c // 32), device="cuda", dtype=torch.int32) % 256).to(torch.uint8).reshape(r, c // 32)
    s = s.view(torch.float8_e8m0fnu)
    y = dequantize(data, s, fmt)
    want = formats.from_mx(data, s, fmt).bfloat16()
    assert y.dtype == torch.bfloat16 and hw_cvt(data)
    assert torch.equal(y.isnan(), want.isnan())
    assert torch.equal(y[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [2, 8])
def test_split_k_reduction_in_the_kernel(split, out_dtype):
    """K split across programs that run concurrently: each tile's last program to arrive sums the fp32 partials in
    split order. Right against the reference, and bit-identical over repeated calls whatever the arrival order
    (many tiles, calls queued back to back on one stream)."""
    from fly_lightning.kernels.triton.mx_scaled_mm import MXMMConfig, launch

    m, n, k = 48, 4160, 4096
    a, _, b, bs = _operands(m, n, k, None, "mxfp4_e2m1", spread=2)
    cfg = MXMMConfig(64, 64, 128, swap=True, split_k=split, fp8_cvt="hw")
    ys = [launch(a, None, None, b, bs, "mxfp4_e2m1", out_dtype, cfg) for _ in range(20)]
    want = mx_scaled_mm_reference(a, None, None, b, bs, "mxfp4_e2m1", torch.float32)
    tol = (2e-5 if out_dtype == torch.float32 else 1e-2) * want.abs().amax()
    assert ((ys[0].float() - want).abs() <= tol).all()
    assert all(torch.equal(y, ys[0]) for y in ys[1:])


def test_split_k_counters_in_captured_graphs_and_eager_calls_between():
    """The arrival counters live in zeroed workspaces that each launch re-zeroes: two captured graphs (each with a
    capture slot of its own) replayed in turn with eager calls between them on the same stream, and a call on
    another stream, all equal the eager result; the workspaces are zero afterwards."""
    from fly_lightning.kernels.triton import _workspace
    from fly_lightning.kernels.triton.mx_scaled_mm import MXMMConfig, launch

    m, n, k, fmt = 16, 4096, 4096, "mxfp4_e2m1"
    a, _, b, bs = _operands(m, n, k, None, fmt, spread=2)
    cfg = MXMMConfig(16, 64, 128, split_k=4, fp8_cvt="hw", fp4_lut=True)
    run = lambda: launch(a, None, None, b, bs, fmt, torch.bfloat16, cfg)  # noqa: E731
    want = run()
    graphs, outs = [], []
    for _ in range(2):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs.append(run())
        graphs.append(g)
    side = torch.cuda.Stream()
    for _ in range(3):
        for g, y in zip(graphs, outs, strict=True):
            g.replay()
            assert torch.equal(run(), want)
            torch.cuda.synchronize()
            assert torch.equal(y, want)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y_side = run()
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(y_side, want)
    torch.cuda.synchronize()
    assert not any(ws.any() for ws in _workspace._WORKSPACES.values())


@pytest.mark.parametrize("activation", ["mxfp8_e4m3", "mxfp4_e2m1", None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flymxlinear_forms_are_bit_equal_from_128_rows(activation, dtype):
    """From 128 rows the Triton ``mx_scaled_mm`` dequantises to bf16 and runs cuBLAS for an fp32 output (and for
    weight-only); the emulated form gives cuBLAS the same bf16 values (fp32 masters through the bf16 GEMM with an fp32
    result, as the prepass): equal bit for bit. bf16 layers with MX activations take the fp8 prepass: close there.
    ``auto`` is the emulated form for bf16 and the MX GEMM form for fp32 MX x MX (Triton takes it). Weight-only fp32
    runs ``mx_scaled_mm``'s ATen path, which rounds the product to bf16 first: close there, not equal."""
    from fly_lightning.quant.linear import FlyMXLinear, MXSpec

    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 384, bias=False, device="cuda", dtype=dtype)
    x = torch.randn(256, 512, device="cuda", dtype=dtype)
    fmt = activation or "mxfp4_e2m1"
    y, ops = {}, {}
    for preference in ("auto", "emulated", "mx_gemm"):
        layer = FlyMXLinear.from_linear(lin, MXSpec(fmt, activation, kernel_preference=preference))
        DISPATCH_LOG.reset()
        with torch.no_grad():
            y[preference] = layer(x)
        ops[preference] = {r["op"]: r["backend"] for r in DISPATCH_LOG.records()}
    auto_mx_gemm = dtype == torch.float32 and activation is not None
    assert ("mx_scaled_mm" in ops["auto"]) == auto_mx_gemm and ("mx_fake_quantize" in ops["auto"]) != auto_mx_gemm
    assert y["auto"].dtype == dtype and torch.equal(y["auto"], y["mx_gemm" if auto_mx_gemm else "emulated"])
    if activation is None and dtype == torch.float32:
        assert ops["mx_gemm"]["mx_scaled_mm"] == "aten"
        torch.testing.assert_close(y["emulated"], y["mx_gemm"], rtol=1e-2, atol=1e-2)
    elif dtype == torch.bfloat16 and activation is not None:  # MX x MX, bf16 output: the fp8 prepass (fp8 sums)
        assert ops["mx_gemm"]["mx_scaled_mm"] == "triton"
        torch.testing.assert_close(y["emulated"], y["mx_gemm"], rtol=1e-2, atol=1e-2)
    else:
        assert ops["mx_gemm"]["mx_scaled_mm"] == "triton"
        assert torch.equal(y["emulated"], y["mx_gemm"])


@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "unswapped"])
@pytest.mark.parametrize("activation", ["mxfp4_e2m1", None], ids=["fp4", "w-fp4"])
def test_fp4_byte_tables_equal_the_pair_form_on_every_code(activation, swap):
    """``MXMMConfig.fp4_lut`` (32-bit words decoded by byte tables, one scale multiply per word) gives the outputs of
    the same plan's pair form bit for bit, on weights holding every byte (both nibbles of every code, signs and -0)
    under scales from 100 to 154 plus 0, 254 and one NaN block, and against the reference where finite."""
    from dataclasses import replace

    from fly_lightning.kernels.triton.mx_scaled_mm import MXMMConfig, launch

    m, n, k = 24, 320, 1024
    fmt = "mxfp4_e2m1"
    a, a_s, _, _ = _operands(m, n, k, activation, fmt, spread=2)
    codes = torch.arange(256, device="cuda", dtype=torch.int32).to(torch.uint8)
    b = codes.repeat(n, k // 2 // 256).roll(5, 1)
    b = torch.stack([r.roll(i, 0) for i, r in enumerate(b)])  # every byte in every column position
    bs = torch.randint(100, 155, (n, k // 32), device="cuda", dtype=torch.uint8)
    bs[0, :] = 0
    bs[1, 2] = 254
    bs[2, 5] = 255
    bs = bs.view(torch.float8_e8m0fnu)
    b = b.view(formats.FORMATS[fmt].torch_dtype)
    cfg = MXMMConfig(16 if swap else 32, 64, 128, swap=swap, split_k=2, fp8_cvt="hw")
    pairs = launch(a, a_s, activation, b, bs, fmt, torch.float32, cfg)
    lut = launch(a, a_s, activation, b, bs, fmt, torch.float32, replace(cfg, fp4_lut=True))
    assert torch.equal(lut.isnan(), pairs.isnan()) and lut[:, 2].isnan().all()
    assert torch.equal(lut.nan_to_num(), pairs.nan_to_num())
    want = mx_scaled_mm_reference(a, a_s, activation, b, bs, fmt, torch.float32)
    finite = torch.isfinite(want) & torch.isfinite(lut)
    assert finite[:, 3:].all()
    assert ((lut - want)[finite].abs() <= 2e-5 * want[finite].abs().amax()).all()


@pytest.mark.parametrize("m", [1, 16, 32])
def test_planned_byte_tables_fall_back_on_unaligned_rows(m):
    """The plan picks the byte tables for weight-only MXFP4 up to 32 rows; weights whose rows are not 4-byte aligned
    (a view one byte into a wider buffer) take the pair decode of the same tiles instead of failing."""
    n, k = 256, 1024
    a, _, b, bs = _operands(m, n, k, None, "mxfp4_e2m1", spread=2)
    wide = torch.empty(n, k // 2 + 4, device="cuda", dtype=torch.uint8)
    wide[:, 1 : 1 + k // 2] = b.view(torch.uint8)
    shifted = wide[:, 1 : 1 + k // 2].view(b.dtype)
    assert shifted.data_ptr() % 4
    want = mx_scaled_mm_reference(a, None, None, b, bs, "mxfp4_e2m1", torch.float32)
    for w in (b, shifted):
        y = _mm(a, None, None, w, bs, "mxfp4_e2m1")
        assert ((y - want).abs() <= 2e-5 * want.abs().amax()).all()


@pytest.mark.parametrize("tiles", [(64, 4), (128, 8)], ids=["n64-w4", "n128-w8"])
@pytest.mark.parametrize(  # byte tables decode MXFP4 only
    "fmt, lut",
    [("mxfp4_e2m1", False), ("mxfp4_e2m1", True), ("mxfp8_e4m3", False), ("mxfp8_e5m2", False)],
    ids=["mxfp4_e2m1-pairs", "mxfp4_e2m1-lut", "mxfp8_e4m3-pairs", "mxfp8_e5m2-pairs"],
)
@pytest.mark.parametrize("m", [1, 16, 50])
def test_fragment_k_matches_the_reference(m, fmt, lut, tiles):
    """``MXMMConfig.fragment_k`` compiled: K summed in the wgmma fragment's order, the weights' decoded registers fed
    as they are (the sm90 compile check shows no shared-memory round trip). Against the reference, split and not,
    with a NaN block and scales 0 and 254; close to the natural order's output (only the order of fp32 sums differs)."""
    from dataclasses import replace

    from fly_lightning.kernels.triton.mx_scaled_mm import MXMMConfig, launch

    n, k = 320, 2048
    a, _, b, bs = _operands(m, n, k, None, fmt, spread=2)
    bs = bs.view(torch.uint8).clone()
    bs[0, :], bs[1, 2], bs[2, 5] = 0, 254, 255
    bs = bs.view(torch.float8_e8m0fnu)
    want = mx_scaled_mm_reference(a, None, None, b, bs, fmt, torch.float32)
    bm = max(16, 1 << (m - 1).bit_length())
    cfg = MXMMConfig(bm, tiles[0], 128, num_warps=tiles[1], swap=True, fp8_cvt="hw", fp4_lut=lut)
    outs = [launch(a, None, None, b, bs, fmt, torch.float32, replace(cfg, fragment_k=True, split_k=s)) for s in (1, 4)]
    for y in outs:
        assert y[:, 2].isnan().all() and not y[:, 3:].isnan().any()
        finite = torch.isfinite(want)
        assert ((y - want)[finite].abs() <= 2e-5 * want[finite].abs().amax()).all()
    natural = launch(a, None, None, b, bs, fmt, torch.float32, cfg)
    assert torch.allclose(outs[0].nan_to_num(), natural.nan_to_num(), rtol=1e-5, atol=1e-5 * want[:, 3:].abs().amax())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_aten_fallback_rounds_fp32_sums_once(out_dtype):
    """The ATen path (bf16 dequantisation, cuBLAS) keeps fp32 sums for an fp32 / fp16 output instead of rounding them
    through bf16 first: as close to the fp32 reference as the Triton path."""
    from fly_lightning.ops.mx_scaled_mm import MX_SCALED_MM

    a, a_s, b, bs = _operands(64, 256, 1024, "mxfp8_e4m3", "mxfp8_e4m3", spread=0)
    ref = mx_scaled_mm_reference(a, a_s, "mxfp8_e4m3", b, bs, "mxfp8_e4m3", torch.float32)
    y = MX_SCALED_MM.impls["aten"].fn(a, a_s, "mxfp8_e4m3", b, bs, "mxfp8_e4m3", out_dtype)
    tol = 1e-5 if out_dtype == torch.float32 else 1e-3  # bf16 rounding would be about 4e-3
    assert y.dtype == out_dtype and ((y.float() - ref).norm() / ref.norm()).item() < tol


@pytest.mark.parametrize(
    "a_fmt, b_fmt",
    [("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp4_e2m1", "mxfp4_e2m1"), ("mxfp8_e4m3", "mxfp4_e2m1")],
    ids=["e4m3", "fp4", "e4m3-fp4"],
)
def test_fp8_blockwise_plan(a_fmt, b_fmt, monkeypatch):
    """Many rows, bf16 output, on Hopper: the launcher re-expresses both operands and runs cuBLAS's blockwise fp8
    GEMM (seen through the requantising call), with zero, extreme and NaN scales; its error against the fp32 reference
    as small as the bf16 prepass's, NaN where the reference has them."""
    from dataclasses import replace

    from fly_lightning.kernels.triton import mx_scaled_mm as kernel
    from fly_lightning.kernels.triton._mx_requant import available

    m, n, k = 300, 256, 512
    a, a_s, b, bs = _operands(m, n, k, a_fmt, b_fmt, spread=2)
    if not available(a.device):
        pytest.skip("cuBLAS's blockwise fp8 GEMM: Hopper with CUDA >= 12.9")
    bs = bs.view(torch.uint8).clone()
    bs[0, :] = 0  # 2^-127
    bs[1, 0] = 225  # 2^98 on one block: the row's other blocks round within 2^-17 of it
    bs[2, 3] = 255  # NaN block
    bs = bs.view(torch.float8_e8m0fnu)
    calls = []
    real = kernel.requantize
    monkeypatch.setattr(kernel, "requantize", lambda *t: calls.append(1) or real(*t))
    cfg = kernel.plan(m, n, k, a_fmt, b_fmt, a.device)
    assert cfg.fp8_blockwise
    y = _mm(a, a_s, a_fmt, b, bs, b_fmt, torch.bfloat16)
    assert calls, "the dispatched call did not take the fp8 plan"
    want = mx_scaled_mm_reference(a, a_s, a_fmt, b, bs, b_fmt, torch.float32)
    y_bf16 = kernel.launch(a, a_s, a_fmt, b, bs, b_fmt, torch.bfloat16, replace(cfg, fp8_blockwise=False))
    assert torch.equal(y.isnan(), want.isnan()) and y[:, 2].isnan().all()
    finite = ~want.isnan()
    scale = want[finite].abs().amax()
    err, err_bf16 = ((t.float() - want)[finite].abs().amax() / scale for t in (y, y_bf16))
    assert err <= max(1.5 * err_bf16, 2e-5), (err.item(), err_bf16.item())
    cols = finite.all(0)  # columns without NaN: relative error as a whole
    rel = ((y.double() - want.double())[:, cols].norm() / want.double()[:, cols].norm()).item()  # fp32 overflows
    assert rel < 4e-3, rel
