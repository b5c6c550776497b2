"""Inputs shared by the MX cast tests (interpreter): blocks where casts go wrong, and every bf16 value."""

import torch


def cases(dtype: torch.dtype) -> torch.Tensor:
    """32-value blocks of random, zero, subnormal, huge, inf, NaN, saturating and tie values, mixed in rows."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    tiny = torch.finfo(torch.float32).tiny
    special = torch.tensor([0.0, -0.0, tiny / 8, float("inf"), float("-inf"), 3e38, 448.0 * 1.9, 5.0])
    x = torch.cat([r(24, 32), r(4, 32) * 1e-3, r(4, 32) * tiny, torch.zeros(2, 32), r(4, 32) * 1e30])
    x[::5, :8] = special
    x[7, 3] = float("nan")
    x[9] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    return x.to(dtype)


def every_bf16(block_tops: tuple[float, ...] = (1.0, 6.0, 7.9, 3e38, 1e-38, 2.0**-130, 448.0)) -> torch.Tensor:
    """Every bf16 bit pattern, in 32-value blocks as they come and again with each block's first value replaced by
    one of ``block_tops`` (so that every value is also cast under scales set by others), 256 values per row."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 32)
    blocks = [x]
    for top in block_tops:
        y = x.clone()
        y[:, 0] = top
        blocks.append(y)
    return torch.cat(blocks).reshape(-1, 256)
