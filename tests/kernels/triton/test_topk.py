"""Triton topk kernel: launch configurations and the exact fallback against the reference, outputs fully written."""

import pytest
import torch

from fly_lightning.kernels.triton.topk import LaunchConfig, topk_triton
from fly_lightning.ops.topk import topk_reference


def _check(x, k, cfg):
    torch.use_deterministic_algorithms(True)  # outputs are poisoned (conftest.py): unwritten elements would show
    try:
        v, i = topk_triton(x, k, config=cfg)
    finally:
        torch.use_deterministic_algorithms(False)
    rv, ri = topk_reference(x, k)
    assert torch.equal(i, ri)
    torch.testing.assert_close(v, rv, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    "n, cfg",
    [
        (8, LaunchConfig(rows_per_thread=4, num_warps=1)),
        (100, LaunchConfig(elems_per_thread=8, num_warps=2)),
        (256, LaunchConfig(elems_per_thread=64, num_warps=1)),
        (1024, LaunchConfig(num_warps=1)),
        (33, LaunchConfig(num_warps=1)),  # odd width: scalar loads
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_launch_configurations(n, cfg, dtype):
    _check(torch.randn(45, n).to(dtype), min(n, 7), cfg)


def test_exact_fallback_for_wide_dynamic_range():
    x = torch.randn(20, 64)
    x[5, 3] = 3e38
    x[6, :3] = torch.tensor([1e-38, -3e38, 0.0])
    _check(x, 6, LaunchConfig(num_warps=1))


@pytest.mark.parametrize("k", [2, 3])
def test_values_sharing_a_compressed_step(k, shared_step):
    """As in the routing kernel: the larger of two values 1 ulp apart in one compressed step, at the higher column,
    chosen last (k=3) or left out first (k=2) by the compressed keys."""
    top, a, b = shared_step(64)
    x = torch.randn(20, 64) * 3 - 2
    x[11, :] = -5.0 + torch.arange(64) * 1e-3
    x[11, 0], x[11, 4], x[11, 9] = top, a, b
    _check(x, k, LaunchConfig(num_warps=1))


def test_fp32_ties():
    _check(torch.randint(-2, 2, (40, 50)).float(), 9, LaunchConfig(num_warps=1))
