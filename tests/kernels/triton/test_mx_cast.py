"""The Triton MX cast: bit-exact with the reference (itself bit-exact with torchao) on the blocks where casts go wrong,
every output element written (outputs are poisoned in tests), and the inputs it leaves to ATen named."""

import pytest
import torch
import triton
import triton.language as tl

import fly_lightning
from fly_lightning.kernels.triton import mx_cast as kernel
from fly_lightning.kernels.triton._mx_elements import block_scales, mantissa_bits, rceil_biased
from fly_lightning.kernels.triton.mx_cast import cast_support, launch, launch_cols, mx_cast_triton
from fly_lightning.ops.mx_cast import mx_cast_reference
from fly_lightning.quant import formats
from tests.kernels.triton._mx_inputs import cases as _cases
from tests.kernels.triton._mx_inputs import every_bf16 as _every_bf16


def _compared(x: torch.Tensor, scale: torch.Tensor, per_byte: int, mode: str = "floor") -> torch.Tensor:
    """The data bytes that must match: with floor scales all but those holding a NaN or inf input in a NaN-scale
    block (finite values there are +-0, as torchao's division by an infinite scale gives; NaN and inf codes are
    unspecified); with rceil none of a NaN block's (torchao multiplies them by the NaN quotient: NaN codes)."""
    per_block = x.shape[-1] // scale.shape[-1]
    in_nan_block = (scale.view(torch.uint8) == formats.E8M0_NAN).repeat_interleave(per_block, dim=-1)
    ok = ~in_nan_block | (x.isfinite() if mode == "floor" else False)
    return ok.reshape(*ok.shape[:-1], -1, per_byte).all(-1)


def _check(x: torch.Tensor, fmt: str, plan: tuple[int, int, int] | None = None, mode: str = "floor") -> None:
    data, scale = mx_cast_triton(x, fmt, mode, -1) if plan is None else launch(x, fmt, plan, mode)
    want_data, want_scale = mx_cast_reference(x, fmt, mode, -1)
    assert data.dtype == want_data.dtype and data.shape == want_data.shape
    assert torch.equal(scale.view(torch.uint8), want_scale.view(torch.uint8))
    valid = _compared(x, want_scale, formats.as_format(fmt).per_byte, mode)
    assert torch.equal(data.view(torch.uint8)[valid], want_data.view(torch.uint8)[valid])


MODES = [("floor", torch.float32), ("floor", torch.bfloat16), ("rceil", torch.bfloat16)]


@pytest.mark.parametrize("mode, dtype", MODES, ids=[f"{m}-{str(d)[6:]}" for m, d in MODES])
@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
@pytest.mark.parametrize("k", [32, 96, 320])
def test_bit_exact_with_the_reference(fmt, mode, dtype, k):
    x = _cases(dtype).reshape(-1)
    x = x[: x.numel() // k * k].reshape(-1, k)  # rows not a multiple of the tile's, K of 1, 3 and 10 blocks
    _check(x, fmt, mode=mode)


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("plan", [(8, 16, 4), (64, 4, 8)])
def test_other_launch_plans(plan, mode):
    """Two other launch plans (rows, blocks, warps) give the same bits, rows and blocks not multiples of theirs."""
    x = _cases(torch.bfloat16).repeat(6, 1).reshape(-1)[: 42 * 160].reshape(42, 160)
    for fmt in ("mxfp8_e4m3", "mxfp4_e2m1"):
        _check(x, fmt, plan, mode)


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_fp4_pairs_bit_exact_on_every_bf16_value(monkeypatch, mode):
    """bf16 to MXFP4 reads pairs (``_mx_cast_fp4_pairs``, its rounding on f16 bits): every bf16 value, alone in its
    block and under larger ones, gives the reference's code and scale."""
    calls = []
    monkeypatch.setattr(kernel, "_CAST", lambda *a, **k: calls.append(a))  # the element kernel must not run
    _check(_every_bf16(), "mxfp4_e2m1", mode=mode)
    assert calls == []


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2"])
def test_rceil_fp8_bit_exact_on_every_bf16_value(fmt):
    """rceil scales from bf16 (``rceil_biased``: exponent and mantissa bits against the format's largest value)
    equal the reference's ``ceil(log2(amax / max))`` for every bf16 value as a block's largest, alone and under
    others; the elements follow."""
    _check(_every_bf16(), fmt, mode="rceil")


@triton.jit
def _rceil_of(AMAX, OUT, n, EMAX: tl.constexpr, MANT_MAX: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(AMAX + i, mask=i < n, other=0)
    tl.store(OUT + i, rceil_biased(bits.to(tl.float32, bitcast=True), EMAX, MANT_MAX), mask=i < n)


@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_rceil_scale_rule_on_every_bf16_amax(fmt):
    """The scale rule alone (``rceil_biased``) against the formula in fp64, exact here: every non-negative bf16
    value, zero, subnormals and inf included, as a block's largest."""
    f = formats.as_format(fmt)
    amax = torch.arange(0, 0x7F81, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()  # 0 .. inf
    got = torch.empty(amax.numel(), dtype=torch.int32)
    n = amax.numel()
    _rceil_of[(triton.cdiv(n, 4096),)](amax.view(torch.int32), got, n, f.emax, mantissa_bits(f.max), BLOCK=4096)
    a = amax.double()
    want = torch.where(a.isinf(), 254, (torch.ceil(torch.log2(a / f.max)).clamp(-127, 127) + 127).nan_to_num(0, 0, 0))
    assert torch.equal(got.long(), want.long())


@triton.jit
def _multipliers(OUT, RCEIL: tl.constexpr):
    """``block_scales`` on block maxima ``2^(s - 127)`` (exponent field s, EMAX 0: the biased scale is s; field 255
    is inf) and a NaN block, for every s: the multiplier it pairs with each biased scale."""
    s = tl.arange(0, 256)
    amax = (s << 23).to(tl.float32, bitcast=True)
    has_nan = s == 256  # none: 255 comes from the inf maximum (floor) ...
    biased, mult = block_scales(amax, has_nan, 0, RCEIL, 0x7FFFFF)
    tl.store(OUT + s, biased)
    tl.store(OUT + 256 + s, mult.to(tl.int32, bitcast=True))
    nan_biased, nan_mult = block_scales(amax, s >= 0, 0, RCEIL, 0x7FFFFF)  # ... or from NaN blocks (both modes)
    tl.store(OUT + 512 + s, nan_biased)
    tl.store(OUT + 768 + s, nan_mult.to(tl.int32, bitcast=True))


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_multiplier_from_bits_on_every_scale(mode):
    """``block_scales``' element multiplier, built from bits, for every biased scale it gives (0 to 254 from block
    maxima, 255 from NaN blocks and, floor, inf maxima) equals the reference's: floor ``1 / max(2^(s - 127),
    2^-126)``, rceil ``2^(127 - s)`` with 1 for scale 0; 0 in NaN blocks."""
    out = torch.empty(1024, dtype=torch.int32)
    _multipliers[(1,)](out, RCEIL=mode == "rceil")
    biased = torch.cat([out[:256], out[512:768]]).long()
    got = torch.cat([out[256:512], out[768:]]).view(torch.float32)
    assert torch.equal(out[512:768], torch.full((256,), 255, dtype=torch.int32))
    s = torch.arange(256)
    assert torch.equal(out[:255].long(), s[:255]) and out[255] == (255 if mode == "floor" else 254)
    if mode == "floor":
        want = 1.0 / torch.clamp((biased.int() << 23).view(torch.float32), min=2.0**-126)
    else:
        want = torch.where(biased == 0, 1.0, torch.exp2(127.0 - biased.double())).float()
        want[biased == 255] = 0.0
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_fp4_rows_not_readable_as_pairs_take_the_element_kernel(monkeypatch):
    """An odd storage offset cannot be read as int32 pairs: ``_mx_cast_rows`` casts it, with the same bits."""
    x = _cases(torch.bfloat16).reshape(-1)[1 : 1 + 16 * 64].reshape(16, 64)
    assert kernel._as_pairs(x) is None
    calls = []
    monkeypatch.setattr(kernel, "_CAST_FP4_PAIRS", lambda *a, **k: calls.append(a))
    _check(x, "mxfp4_e2m1")
    assert calls == []


def _check_cols(
    x: torch.Tensor, fmt: str, mode: str, plan: tuple[int, int, int] | None = None, fp4_words: bool | None = None
) -> None:
    """Column-wise: against the reference along axis 0, bytes compared as for the row-wise cast of ``x.t()``."""
    if plan is None and fp4_words is None:
        data, scale = mx_cast_triton(x, fmt, mode, 0)
    else:
        data, scale = launch_cols(x, fmt, mode, plan, fp4_words)
    want_data, want_scale = mx_cast_reference(x, fmt, mode, 0)
    assert data.shape == want_data.shape and scale.shape == want_scale.shape and data.is_contiguous()
    assert torch.equal(scale.view(torch.uint8), want_scale.view(torch.uint8))
    valid = _compared(x.t(), want_scale.t(), formats.as_format(fmt).per_byte, mode).t()
    assert torch.equal(data.view(torch.uint8)[valid], want_data.view(torch.uint8)[valid])


@pytest.mark.parametrize("mode, dtype", MODES, ids=[f"{m}-{str(d)[6:]}" for m, d in MODES])
@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
@pytest.mark.parametrize("k, n", [(32, 70), (96, 37), (320, 9)])
def test_column_wise_bit_exact_with_the_reference(fmt, mode, dtype, k, n):
    """Blocks down the columns of ``[K, N]`` (a weight stored K-major): the special blocks of the row-wise tests,
    columns not a multiple of the tile's, K of 1, 3 and 10 blocks."""
    x = _cases(dtype).t().reshape(-1).repeat(3)  # each column of x below holds rows of the cases
    _check_cols(x[: k * n].reshape(n, k).t().contiguous(), fmt, mode)


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4_e2m1"])
def test_column_wise_on_every_bf16_value_in_other_plans(fmt, mode):
    """Every bf16 value, alone and under larger block maxima, down the columns; a plan of other tile sizes, and the
    rows of a wider buffer (row stride past N)."""
    x = _every_bf16().t()  # [256, rows]: each column a row of the row-wise test
    _check_cols(x.contiguous(), fmt, mode, plan=(128, 4, 4))
    wide = torch.zeros(64, 300, dtype=torch.bfloat16)
    wide[:, 10:270] = x[:64, :260]
    _check_cols(wide[:, 10:270], fmt, mode)
    if fmt == "mxfp4_e2m1":  # the two-column word kernel: a row stride past the width, in words
        _check_cols(wide[:, 10:270], fmt, mode, fp4_words=True)


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_column_wise_fp4_words_bit_exact_with_the_reference(mode, monkeypatch):
    """bf16 -> MXFP4 down columns, two columns per int32 word (the default where x reads as words): every bf16
    value and the special blocks, in its plan and three others; it ran, not the pairs kernel, wherever x reads as
    words; unmasked (``EVEN``) where every tile lies inside x, masked elsewhere."""
    pairs, even = [], []
    real, real_words = kernel._CAST_COLS_FP4_PAIRS, kernel._CAST_COLS_FP4_WORDS
    monkeypatch.setattr(kernel, "_CAST_COLS_FP4_PAIRS", lambda *a, **k: pairs.append(1) or real(*a, **k))
    monkeypatch.setattr(kernel, "_CAST_COLS_FP4_WORDS", lambda *a, **k: even.append(k["EVEN"]) or real_words(*a, **k))
    every = _every_bf16().t().contiguous()  # [256, rows]: each column a row of the row-wise test
    special = _cases(torch.bfloat16).t().reshape(-1).repeat(3)[: 96 * 36].reshape(36, 96).t().contiguous()
    for x in (every, special):
        for plan in (None, (128, 1, 1), (64, 2, 4), (32, 4, 1)):
            _check_cols(x, "mxfp4_e2m1", mode, plan, fp4_words=True)
    assert pairs == [] and set(even) == {True, False}
    # odd width or an odd offset: not readable as words, the pairs kernel takes them
    _check_cols(special[:, :35], "mxfp4_e2m1", mode, fp4_words=True)
    _check_cols(special[:, 1:35], "mxfp4_e2m1", mode, fp4_words=True)
    assert len(pairs) == 2


def test_leading_dims_and_strided_rows():
    x = _cases(torch.bfloat16)[:36].reshape(2, 9, 64)
    _check(x, "mxfp4_e2m1")
    wide = torch.randn(17, 128)
    _check(wide[:, :64], "mxfp8_e4m3")  # rows of a wider tensor


def test_empty_input():
    data, scale = mx_cast_triton(torch.empty(0, 64), "mxfp8_e4m3", "floor", -1)
    assert data.shape == (0, 64) and scale.shape == (0, 2)


@pytest.mark.parametrize(
    "args, reason",
    [
        ((torch.randn(4, 64), "mxfp8_e4m3", "rceil", -1), "rceil scales from torch.float32"),
        ((torch.randn(4, 64).t(), "mxfp8_e4m3", "floor", 0), "columns not contiguous"),
        ((torch.randn(64, 8).t(), "mxfp8_e4m3", "floor", -1), "not contiguous"),
    ],
)
def test_unsupported_inputs_run_on_aten_with_the_reason(args, reason):
    assert reason in cast_support(*args)
    data, scale = fly_lightning.mx_cast(*args)
    want = mx_cast_reference(*args)
    assert torch.equal(scale.view(torch.uint8), want[1].view(torch.uint8))
    (rec,) = fly_lightning.DISPATCH_LOG.records("mx_cast")
    assert rec["backend"] == "aten" and reason in rec["reason"]


def test_conversion_instructions_only_on_nvidia_sm89_and_later(monkeypatch):
    """fp8 rounding by instructions needs Triton's fp8 types (sm89+) and a single rounding (not ROCm's fp16 detour);
    the column-wise word kernel's ``max.u16x2`` is PTX for sm90 on. Neither under the interpreter."""
    from fly_lightning.kernels.triton import _mx_dequant

    class OnCuda:
        is_cuda, device = True, torch.device("cuda", 0)

    gates = (kernel._hw_cvt, kernel.ptx_u16x2)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.version, "hip", None)
    try:
        for cap, want in (((8, 0), (False, False)), ((8, 9), (True, False)), ((9, 0), (True, True))):
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, cap=cap: cap)
            _mx_dequant._capability.cache_clear()  # the capability is cached per device
            assert tuple(gate(OnCuda()) for gate in gates) == want, cap
        monkeypatch.setattr(torch.version, "hip", "7.0")
        assert not any(gate(OnCuda()) for gate in gates)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not any(gate(OnCuda()) or gate(torch.zeros(1)) for gate in gates)
    finally:
        _mx_dequant._capability.cache_clear()  # no faked capability left for later tests


@pytest.mark.parametrize("fmt, words", [("mxfp8_e4m3", None), ("mxfp4_e2m1", True), ("mxfp4_e2m1", False)])
def test_column_launch_stays_within_the_grid_limit(fmt, words, monkeypatch):
    # a column past 65535 row blocks of the plan: each program takes more blocks (grid axis 1 holds 65535 at most)
    grids = []
    for name in ("_CAST_COLS", "_CAST_COLS_FP4_PAIRS", "_CAST_COLS_FP4_WORDS"):
        monkeypatch.setattr(kernel, name, lambda grid, args, **kw: grids.append((grid, kw["G"])))
    k = 32 * (65535 * 2 + 3)
    launch_cols(torch.zeros(k, 2, dtype=torch.bfloat16), fmt, "floor", (64, 2, 1), words)
    ((grid, g),) = grids
    assert grid[1] <= 65535 and grid[1] * g * 32 >= k and g == 4
