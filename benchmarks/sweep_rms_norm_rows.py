"""Variants of the aligned RMSNorm rows kernel next to Liger's, timed side by side (GPU).

Liger's forward edges ours by 1-2% on 4096-wide rows (``rms_norm_h200.md``). Candidates for the difference:

- ``shipped``: ``_rms_norm_rows`` as dispatched (a ``[ROWS, BLOCK]`` tile, a row mask, fp32 weight math).
- ``row``: one row per program, 1D tile, scalar row pointer (Liger's structure), fp32 math.
- ``row+evict``: as ``row``, with x and y marked evict-first (streamed once) and the weight evict-last.
- ``row+nooffset``: as ``row``, with the weight offset known to be 0 at compile time (one add less per element).

    python -m benchmarks.sweep_rms_norm_rows        # writes rms_norm_rows_variants.json/.md
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from benchmarks.harness import Results, copy_bandwidth_gbps, rotation_count, time_graph_ms
from fly_lightning.kernels.triton.rms_norm import _rms_norm_rows

EPS = 1e-6


@triton.jit
def _row_variant(
    X,
    W,
    Y,
    RSTD,
    stride,
    eps,
    offset,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    EVICT: tl.constexpr,
    OFFSET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    if EVICT:
        x = tl.load(X + row * stride + cols, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
        w = tl.load(W + cols, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
    else:
        x = tl.load(X + row * stride + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    if OFFSET:
        w = w + offset
    y = (x * rstd * w).to(Y.dtype.element_ty)
    if EVICT:
        tl.store(Y + row * stride + cols, y, mask=m, eviction_policy="evict_first")
    else:
        tl.store(Y + row * stride + cols, y, mask=m)
    tl.store(RSTD + row, rstd)


def variant(x: torch.Tensor, w: torch.Tensor, name: str, warps: int) -> torch.Tensor:
    t, h = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(t, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(h)
    if name == "shipped":
        _rms_norm_rows[(t,)](
            x, w, y, rstd, t, h, h, EPS, 0.0, H=h, BLOCK=block, ROWS=1, CHUNKED=False, HAS_W=True, CAST_FIRST=False,
            num_warps=warps,
        )  # fmt: skip
    else:
        _row_variant[(t,)](
            x, w, y, rstd, h, EPS, 0.0, H=h, BLOCK=block, EVICT=name == "row+evict", OFFSET=name != "row+nooffset",
            num_warps=warps,
        )  # fmt: skip
    return y


def main() -> None:
    torch.manual_seed(0)
    res = Results("rms_norm_rows_variants")
    bw = copy_bandwidth_gbps()
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        LigerRMSNormFunction = None
    for t, h in ((4096, 4096), (16384, 4096), (16384, 8192), (32768, 2048)):
        nbytes = 2 * t * h * 2
        xs = [(torch.randn(t, h, device="cuda").bfloat16(),) for _ in range(rotation_count(nbytes))]
        w = (torch.randn(h, device="cuda") * 0.1 + 1).bfloat16()
        ref = torch.nn.functional.rms_norm(xs[0][0].float(), (h,), w.float(), EPS)
        cands = [(n, wp) for n in ("shipped", "row", "row+evict", "row+nooffset") for wp in (4, 8, 16)]
        if LigerRMSNormFunction is not None:
            cands.append(("liger", 0))
        for name, warps in cands:
            if name == "liger":
                fn = lambda x, w=w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)  # noqa: E731
            else:
                fn = lambda x, w=w, n=name, wp=warps: variant(x, w, n, wp)  # noqa: E731
            row = dict(T=t, H=h, kernel=name, num_warps=warps or "liger's")
            err = ((fn(xs[0][0]).float() - ref).norm() / ref.norm()).item()
            us = time_graph_ms(fn, xs)["median_ms"] * 1e3
            pct = nbytes / (us * 1e-6) / 1e9 / bw * 100
            row.update(relerr=round(err, 6), graph_us=round(us, 2), pct_bw=round(pct, 1))
            print(row, flush=True)
            res.add(**row)
    res.summary["copy_GBps"] = round(bw)
    res.notes.append("bf16 x and weight, eps 1e-6; graph replay medians; liger in its 'llama' casting mode")
    print(res.save())


if __name__ == "__main__":
    main()
