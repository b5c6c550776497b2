"""Does ``tl.histogram(x, n, mask=m)`` honour ``m`` on this GPU? Compares it, and the unmasked-then-corrected form
the routing kernel uses, with ``torch.bincount`` over the tile shapes the routing epilogue has ([ROWS, KP] with
k < KP, and rows past T). Prints one JSON line per shape.

    python -m benchmarks.probe_histogram_mask
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl


@triton.jit
def _hist(X, OUT_MASKED, OUT_FIXED, n_rows, K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr):
    r = tl.arange(0, ROWS)[:, None]
    kk = tl.arange(0, KP)[None, :]
    ok = (r < n_rows) & (kk < K)
    idx = tl.load(X + r * K + kk, mask=ok, other=B - 1)
    flat_ok = tl.reshape(ok, [ROWS * KP])
    flat = tl.reshape(idx, [ROWS * KP])
    tl.store(OUT_MASKED + tl.arange(0, B), tl.histogram(flat, B, mask=flat_ok))
    n_pad = ROWS * KP - tl.sum(flat_ok.to(tl.int32))
    bins = tl.arange(0, B)
    fixed = tl.histogram(tl.where(flat_ok, flat, 0), B) - tl.where(bins == 0, n_pad, 0)
    tl.store(OUT_FIXED + bins, fixed)


def main() -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: under TRITON_INTERPRET=1
    for rows, n_rows, k, kp, bins, warps in [(64, 64, 6, 8, 64, 4), (128, 100, 2, 2, 8, 4), (64, 64, 8, 8, 64, 4),
                                             (32, 32, 3, 4, 16, 1), (256, 256, 6, 8, 64, 8)]:  # fmt: skip
        x = torch.randint(0, bins, (n_rows, k), device=dev, dtype=torch.int32)
        masked, fixed = (torch.empty(bins, device=dev, dtype=torch.int32) for _ in range(2))
        _hist[(1,)](x, masked, fixed, n_rows, K=k, KP=kp, ROWS=rows, B=bins, num_warps=warps)
        want = torch.bincount(x.flatten().long(), minlength=bins).int()
        print(json.dumps(dict(rows=rows, n_rows=n_rows, k=k, kp=kp, bins=bins, warps=warps,
                              masked_ok=bool(torch.equal(masked, want)), fixed_ok=bool(torch.equal(fixed, want)),
                              masked_excess=int((masked - want).sum())), sort_keys=False))  # fmt: skip


if __name__ == "__main__":
    main()
