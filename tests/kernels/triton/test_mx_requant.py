"""MX operands re-expressed as e4m3 with 1x128 fp32 scales (interpreter): bit-exact against the module's plain-torch
``reference`` (torch's own float8 rounding), exact where the group's scales allow it, bounded where they do not; NaN
blocks, zero groups, rows and K off the tile; the arguments refused before any launch."""

import pytest
import torch

from fly_lightning.kernels.triton._mx_requant import reference, requantize
from fly_lightning.quant import formats


def _blocks(x, g, spread):
    """Each 32-block of ``x`` scaled by its own power of two in [2^-spread, 2^spread]."""
    r, k = x.shape
    e = torch.randint(-spread, spread + 1, (r, k // 32, 1), generator=g).float()
    return (x.view(r, k // 32, 32) * torch.exp2(e)).view(r, k)


def _check_rule(a, a_s, a_fmt, b, b_s, b_fmt):
    qa, sa, qb, sb = requantize(a, a_s, a_fmt, b, b_s, b_fmt)
    for q, sc, data, scale, fmt in ((qa, sa, a, a_s, a_fmt), (qb, sb.t(), b, b_s, b_fmt)):
        want_q, want_s = reference(data, scale, fmt)
        assert q.dtype == torch.float8_e4m3fn and sc.dtype == torch.float32
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(sc, want_s)
    assert sa.stride(0) == 1 and sb.is_contiguous()  # outer-dim-major a scales; b's [K / 128, N]
    return qa, sa, qb, sb


def _values(q, sc):
    r, k = q.shape
    return (q.float().view(r, k // 128, 128) * sc[..., None]).view(r, k)


@pytest.mark.parametrize("a_fmt, b_fmt", [("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp4_e2m1", "mxfp4_e2m1"),
                                          ("mxfp8_e4m3", "mxfp4_e2m1")])  # fmt: skip
def test_exact_within_the_groups_range(a_fmt, b_fmt):
    """Blocks within 2^3 of each other: e2m1 exact (span <= 14), e4m3 within its bound; rows off the 16-row tile,
    K = 384 off the 512-wide tile."""
    g = torch.Generator().manual_seed(0)
    a, a_s = formats.to_mx(_blocks(torch.randn(37, 384, generator=g), g, 3), a_fmt)
    b, b_s = formats.to_mx(_blocks(torch.randn(21, 384, generator=g), g, 3), b_fmt)
    qa, sa, qb, sb = _check_rule(a, a_s, a_fmt, b, b_s, b_fmt)
    for q, sc, data, scale, fmt in ((qa, sa, a, a_s, a_fmt), (qb, sb.t(), b, b_s, b_fmt)):
        got, want = _values(q, sc), formats.from_mx(data, scale, fmt)
        if fmt == "mxfp4_e2m1":
            assert torch.equal(got, want)
        else:  # elements of the smaller blocks shift down and may round: within the bound, never above it
            r = want.shape[0]
            err = (got - want).abs().view(r, -1, 128).amax(-1)
            assert (err <= 2.0**-17 * want.abs().view(r, -1, 128).amax(-1)).all()


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4_e2m1"])
def test_wide_groups_round_within_the_bound(fmt):
    """Blocks 2^20 apart in one group: the small block's elements round on e4m3's steps, at most 2^-17 of the
    group's largest element (the rule's ties and subnormals checked bit for bit)."""
    g = torch.Generator().manual_seed(1)
    a, a_s = formats.to_mx(_blocks(torch.randn(16, 256, generator=g), g, 10), fmt)
    qa, sa, _, _ = _check_rule(a, a_s, fmt, a, a_s, fmt)
    want = formats.from_mx(a, a_s, fmt).view(16, 2, 128)
    err = (_values(qa, sa).view(16, 2, 128) - want).abs().amax(-1)
    assert (err <= 2.0**-17 * want.abs().amax(-1)).all()
    assert (err > 0).any()  # the case does round somewhere


def test_nan_blocks_zero_groups_and_extreme_scales():
    g = torch.Generator().manual_seed(2)
    for fmt in ("mxfp8_e4m3", "mxfp4_e2m1"):
        a, a_s = formats.to_mx(torch.randn(4, 256, generator=g), fmt)
        a_s = a_s.view(torch.uint8).clone()
        a_s[0, 1] = 255  # NaN block
        a_s[1, 4:] = 254  # 2^127 group
        a_s[3, :4] = 0  # 2^-127 group
        a = a.clone()
        a[2] = 0  # zero row: g = 0, scale 2^-127
        a_s = a_s.view(torch.float8_e8m0fnu)
        qa, sa, _, _ = _check_rule(a, a_s, fmt, a, a_s, fmt)
        vals = _values(qa, sa)
        assert vals[0, 32:64].isnan().all() and not vals[0, 64:].isnan().any()
        assert (vals[2] == 0).all() and (sa[2] == 2.0**-127).all()
        assert torch.equal(vals[1, 128:], formats.from_mx(a, a_s, fmt)[1, 128:])


def test_refuses_before_any_launch():
    a, a_s = formats.to_mx(torch.randn(4, 128), "mxfp8_e5m2")
    b, b_s = formats.to_mx(torch.randn(4, 128), "mxfp8_e4m3")
    with pytest.raises(ValueError, match="not one of"):
        requantize(a, a_s, "mxfp8_e5m2", b, b_s, "mxfp8_e4m3")
    c, c_s = formats.to_mx(torch.randn(4, 256), "mxfp8_e4m3")
    with pytest.raises(ValueError, match="must agree"):
        requantize(b, b_s, "mxfp8_e4m3", c, c_s, "mxfp8_e4m3")


@pytest.mark.parametrize(
    "capability, cuda, hip, planned",
    [((9, 0), (12, 9), None, True), ((9, 0), (13, 0), None, True), ((9, 0), (12, 8), None, False),
     ((10, 0), (13, 0), None, False), ((8, 0), (13, 0), None, False), ((9, 0), (13, 0), "7.0", False)],
)  # fmt: skip
def test_available_on_hopper_with_cuda_12_9(monkeypatch, capability, cuda, hip, planned):
    """cuBLAS's blockwise fp8 GEMM: sm90 (where it was measured) with a CUDA build from 12.9; not Blackwell, older
    GPUs, ROCm builds, the interpreter, nor CPU tensors."""
    from fly_lightning.kernels.triton import _mx_dequant, _mx_requant

    monkeypatch.setattr(_mx_dequant, "interpreting", lambda: False)
    monkeypatch.setattr(_mx_dequant, "_capability", lambda index: capability)
    monkeypatch.setattr(_mx_requant, "_CUDA", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert _mx_requant.available(torch.device("cuda", 0)) is planned
    assert not _mx_requant.available(torch.device("cpu"))
    monkeypatch.setattr(_mx_dequant, "interpreting", lambda: True)
    assert not _mx_requant.available(torch.device("cuda", 0))
