"""Triton RMSNorm kernel paths (rows, multi-row, chunked, unaligned) against the reference, outputs fully written."""

import pytest
import torch

from fly_lightning.kernels.triton.rms_norm import LaunchConfig, launch_config, rms_norm_triton
from fly_lightning.ops.rms_norm import rms_norm_reference


def _check(x, w, cfg, cast=False, offset=0.0):
    torch.use_deterministic_algorithms(True)  # outputs are poisoned (conftest.py): unwritten elements would show
    try:
        y, rstd = rms_norm_triton(x, w, 1e-6, offset, cast, config=cfg)
    finally:
        torch.use_deterministic_algorithms(False)
    yr, rr = rms_norm_reference(x, w, 1e-6, offset, cast)
    assert torch.isfinite(y).all() and torch.isfinite(rstd).all()
    torch.testing.assert_close(rstd, rr, rtol=1e-5, atol=1e-6)
    # bf16: the normalised value may round to the neighbouring bf16 before scaling (2 ulps allowed)
    tol = dict(rtol=1e-5, atol=1e-5) if x.dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(y.float(), yr.float(), **tol)


@pytest.mark.parametrize(
    "h, cfg",
    [
        (100, LaunchConfig("rows", 128, rows=4, num_warps=2)),  # multi-row, masked tail row block
        (64, LaunchConfig("rows", 64, rows=16)),
        (4096, LaunchConfig("rows", 4096, rows=1)),  # one row per program: the 1D path
        (77, LaunchConfig("rows", 128, rows=1, num_warps=1)),
        (1000, LaunchConfig("rows", 256, rows=2)),  # chunked: BLOCK < H
        (4097, LaunchConfig("unaligned", 8192, num_warps=8)),
        (4097, LaunchConfig("unaligned", 4096)),  # the tile exactly as wide as the aligned interior can be
        (2051, LaunchConfig("unaligned", 2048, num_warps=2)),
        (40, LaunchConfig("unaligned", 64)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paths(h, cfg, dtype):
    x = torch.randn(9, h).to(dtype)
    w = torch.randn(h).to(dtype)
    _check(x, w, cfg)
    _check(x, None, cfg)
    _check(x, w, cfg, cast=True)
    _check(x, w, cfg, offset=1.0)


def test_heuristic_picks_unaligned_only_for_contiguous_misaligned_rows():
    assert launch_config(4097, 2, True).kernel == "unaligned"
    assert launch_config(4097, 2, False).kernel == "rows"
    assert launch_config(4096, 2, True).kernel == "rows"
    # the unaligned tile covers the aligned interior (h // vec * vec), not next_pow2(h): 4097 -> 4096, not 8192
    assert launch_config(4097, 2, True).block == 4096 and launch_config(4097, 4, True).block == 4096
    assert launch_config(5121, 2, True).block == 8192
    assert launch_config(4100, 4, True).kernel == "rows"  # 4100 fp32 = 16400 bytes: rows stay 16-byte aligned
    assert launch_config(100000, 2, True).block <= 32768


def test_autotune_pruning_keeps_valid_configs():
    import triton

    from fly_lightning.kernels.triton.rms_norm import _prune

    configs = [triton.Config({"ROWS": r}, num_warps=w) for r in (1, 2, 4, 8) for w in (2, 4, 8, 16)]
    wide = _prune(configs, {}, BLOCK=8192)
    assert wide and all(c.kwargs["ROWS"] * 8192 <= 64 * 32 * c.num_warps for c in wide)
    narrow = _prune(configs, {}, BLOCK=256)
    assert narrow and all(c.num_warps * 128 <= c.kwargs["ROWS"] * 256 for c in narrow)
    assert _prune(configs[:1], {}, BLOCK=1 << 20)  # never empty


@pytest.mark.parametrize("shape", [(5, 0), (0, 8), (2, 0, 3)])
def test_empty_inputs_match_the_reference(shape):
    """Nothing to launch: rows of width 0 still get their rstd (NaN, as the reference), without deterministic mode's
    fill too (``fly_lightning.kernels.outputs`` skips it for these outputs)."""
    x = torch.randn(*shape)
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.MonkeyPatch.context() as patch:  # the allocation as outside tests: no poison to hide a missed row
            from fly_lightning.kernels import outputs

            patch.setattr(outputs, "POISON", False)
            y, rstd = rms_norm_triton(x, None, 1e-6, 0.0, False)
    finally:
        torch.use_deterministic_algorithms(False)
    yr, rr = rms_norm_reference(x, None, 1e-6, 0.0, False)
    assert y.shape == yr.shape and rstd.shape == rr.shape
    torch.testing.assert_close(rstd, rr, equal_nan=True)
