"""Variants of the unaligned-H RMSNorm kernel, timed side by side (GPU), to choose what the shipped kernel does.

``_rms_norm_unaligned`` moves each row's 16-byte-aligned interior with vector loads, but its weight slice starts at a
per-row element offset, so the weight load is scalar. When this sweep was written its tile was ``next_pow2(H)`` wide
(8192 lanes for H=4097, half of them masked); ``shipped`` below still times that launch. The sweep chose ``mid``, which
the launcher now uses (``launch_config``). Variants here:

- ``block``: the tile ``next_pow2(H)`` (``full``, the launch before) or ``next_pow2(H // VEC * VEC)`` (``mid``: the
  interior never needs more).
- ``w``: ``pointer`` (shipped, scalar), ``gather`` (aligned vector load of the weight, shifted in registers with
  ``tl.gather``; full-width tile only), ``table`` (a ``[VEC, HP]`` table of the weight shifted by 0..VEC-1, built
  per call, so each row's slice is an aligned vector load; its build time is included).

    python -m benchmarks.sweep_rms_norm_unaligned        # writes rms_norm_unaligned_variants.json/.md
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from benchmarks.harness import Results, copy_bandwidth_gbps, rotation_count, time_graph_ms
from fly_lightning.kernels.triton.rms_norm import _rms_norm_unaligned, _scale

W_MODES = {"pointer": 0, "gather": 1, "table": 2}


@triton.jit
def _variant(
    X,
    W,
    WSH,
    Y,
    RSTD,
    eps,
    offset,
    H: tl.constexpr,
    HP: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    W_MODE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * H
    first = tl.multiple_of((base + VEC - 1) // VEC * VEC, VEC)
    last = tl.multiple_of((base + H) // VEC * VEC, VEC)
    n_mid = tl.multiple_of(last - first, VEC)
    head = (first - base).to(tl.int32)
    cols = tl.arange(0, BLOCK)
    edge = tl.arange(0, VEC)
    mid_m = cols < n_mid
    head_m = edge < head
    tail_m = edge < base + H - last
    x_mid = tl.load(X + first + cols, mask=mid_m, other=0.0).to(tl.float32)
    x_head = tl.load(X + base + edge, mask=head_m, other=0.0).to(tl.float32)
    x_tail = tl.load(X + last + edge, mask=tail_m, other=0.0).to(tl.float32)
    ss = tl.sum(x_mid * x_mid, axis=0) + tl.sum(x_head * x_head, axis=0) + tl.sum(x_tail * x_tail, axis=0)
    rstd = tl.rsqrt(ss / H + eps)
    y_mid, y_head, y_tail = x_mid * rstd, x_head * rstd, x_tail * rstd
    if W_MODE == 0:
        w_mid = tl.load(W + head + cols, mask=mid_m, other=0.0)
    elif W_MODE == 1:
        w_all = tl.load(W + cols, mask=cols < H, other=0.0)
        w_mid = tl.gather(w_all, tl.minimum(cols + head, BLOCK - 1), axis=0)
    else:
        w_mid = tl.load(WSH + tl.multiple_of(head * HP, VEC) + cols, mask=mid_m, other=0.0)
    w_head = tl.load(W + edge, mask=head_m, other=0.0)
    w_tail = tl.load(W + (last - base) + edge, mask=tail_m, other=0.0)
    y_mid = _scale(y_mid, w_mid, offset, False, X.dtype.element_ty, W.dtype.element_ty)
    y_head = _scale(y_head, w_head, offset, False, X.dtype.element_ty, W.dtype.element_ty)
    y_tail = _scale(y_tail, w_tail, offset, False, X.dtype.element_ty, W.dtype.element_ty)
    tl.store(Y + first + cols, y_mid.to(Y.dtype.element_ty), mask=mid_m)
    tl.store(Y + base + edge, y_head.to(Y.dtype.element_ty), mask=head_m)
    tl.store(Y + last + edge, y_tail.to(Y.dtype.element_ty), mask=tail_m)
    tl.store(RSTD + row, rstd)


def shifted_table(w: torch.Tensor, vec: int) -> tuple[torch.Tensor, int]:
    """``table[s, j] = w[s + j]`` (0 past the end), rows padded to a multiple of ``vec``."""
    h = w.shape[0]
    hp = triton.cdiv(h, vec) * vec
    padded = torch.nn.functional.pad(w, (0, hp + vec))
    idx = torch.arange(vec, device=w.device)[:, None] + torch.arange(hp, device=w.device)[None, :]
    return padded[idx].contiguous(), hp


def run(x: torch.Tensor, w: torch.Tensor, block: str, w_mode: str, warps: int, eps: float = 1e-6):
    t, h = x.shape
    vec = 16 // x.element_size()
    y = torch.empty_like(x)
    rstd = torch.empty(t, dtype=torch.float32, device=x.device)
    width = triton.next_power_of_2(h) if block == "full" else triton.next_power_of_2(h // vec * vec)
    wsh, hp = shifted_table(w, vec) if w_mode == "table" else (w, vec)
    _variant[(t,)](
        x, w, wsh, y, rstd, eps, 0.0, H=h, HP=hp, VEC=vec, BLOCK=width, W_MODE=W_MODES[w_mode], num_warps=warps
    )
    return y


def shipped(x: torch.Tensor, w: torch.Tensor, warps: int, eps: float = 1e-6):
    t, h = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(t, dtype=torch.float32, device=x.device)
    vec = 16 // x.element_size()
    _rms_norm_unaligned[(t,)](
        x, w, y, rstd, eps, 0.0, H=h, VEC=vec, BLOCK=triton.next_power_of_2(h), HAS_W=True, CAST_FIRST=False,
        num_warps=warps,
    )  # fmt: skip
    return y


def main() -> None:
    torch.manual_seed(0)
    res = Results("rms_norm_unaligned_variants")
    bw = copy_bandwidth_gbps()
    for t, h in ((16384, 4097), (16384, 2049), (8192, 5121), (4096, 11001)):
        nbytes = 2 * t * h * 2
        xs = [(torch.randn(t, h, device="cuda").bfloat16(),) for _ in range(rotation_count(nbytes))]
        w = (torch.randn(h, device="cuda") * 0.1 + 1).bfloat16()
        ref = torch.nn.functional.rms_norm(xs[0][0].float(), (h,), w.float(), 1e-6).bfloat16()
        cands = [("shipped", "-", "-", warps) for warps in (4, 8, 16)]
        combos = itertools.product(("full", "mid"), W_MODES, (4, 8, 16))
        # gather shifts within the loaded tile, so the tile must cover head + interior: full width only
        cands += [("variant", b, m, wp) for b, m, wp in combos if not (b == "mid" and m == "gather")]
        for kind, block, mode, warps in cands:
            if kind == "shipped":
                fn = lambda x, w=w, wp=warps: shipped(x, w, wp)  # noqa: E731
            else:
                fn = lambda x, w=w, b=block, m=mode, wp=warps: run(x, w, b, m, wp)  # noqa: E731
            row = dict(T=t, H=h, kernel=kind, block=block, w=mode, num_warps=warps)
            try:
                err = (fn(xs[0][0]).float() - ref.float()).abs().max().item()
                us = time_graph_ms(fn, xs)["median_ms"] * 1e3
                pct = nbytes / (us * 1e-6) / 1e9 / bw * 100
                row.update(max_abs_err=err, graph_us=round(us, 2), pct_bw=round(pct, 1))
            except Exception as exc:  # noqa: BLE001 (a variant that does not compile is a result too)
                row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            print(row, flush=True)
            res.add(**row)
    # the ceiling at small sizes: a same-size copy (launch ramp and tail included) against the 2 GiB copy bandwidth
    for t, h in ((4096, 4096), (16384, 4096), (16384, 4097)):
        nbytes = 2 * t * h * 2
        pairs = [
            (torch.randn(t, h, device="cuda").bfloat16(), torch.empty(t, h, device="cuda", dtype=torch.bfloat16))
            for _ in range(rotation_count(nbytes))
        ]
        us = time_graph_ms(lambda a, b: b.copy_(a), pairs)["median_ms"] * 1e3
        pct = nbytes / (us * 1e-6) / 1e9 / bw * 100
        res.add(T=t, H=h, kernel="same-size copy", graph_us=round(us, 2), pct_bw=round(pct, 1))
        print(res.rows[-1], flush=True)
    res.summary["copy_GBps"] = round(bw)
    res.notes.append("bf16, weight ~1 +- 0.1, eps 1e-6; graph replay medians; table build time included")
    print(res.save())


if __name__ == "__main__":
    main()
