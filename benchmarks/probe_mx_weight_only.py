"""Probe (GPU): weight-only MXFP4 at few rows (the mx_gemm suite's shapes), our ``mx_scaled_mm`` plan against
variants of it and against Triton's own ``tl.dot_scaled`` (the compiler's e2m1 upcast to bf16 on Hopper, the path
OpenAI's ``triton_kernels`` builds on), with cuBLAS bf16 for scale:

- ``lut``: fp4 tiles loaded as 32-bit words and decoded by byte tables (``MXMMConfig.fp4_lut``): 489 against 512
  static main-loop instructions per thread in the swapped plan (sm90 SASS, compiled on the CPU);
- ``noswap``: the tokens on the MMA's M side (``mma.sync`` at 16 rows: no shared-memory copy of the converted
  weights into registers); 473 instructions, 411 with ``lut``;
- ``fragk``: swapped, K summed in the wgmma register fragment's order (``MXMMConfig.fragment_k``): each thread decodes
  the natural run of 32 values that its fragment needs and feeds it as it is; 453 instructions, 388 with ``lut``, no
  shared-memory round trip of the converted weights (Triton 3.6).

Device time from CUDA-graph replays, side by side; each form checked against the fp32 reference first ("!" marks
a relative error above 1e-2). Prints; not a suite.

    python -m benchmarks.probe_mx_weight_only
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

import fly_lightning
from benchmarks.harness import probe_graph_ms
from fly_lightning.kernels.triton import mx_scaled_mm as kernel
from fly_lightning.ops.mx_scaled_mm import mx_scaled_mm_reference

SHAPES = [(16, 4096, 4096), (16, 28672, 4096), (32, 4096, 14336), (64, 6144, 4096), (64, 8192, 8192)]
CALLS = 20


@triton.jit
def _ds_kernel(
    A, B, B_SCALE, OUT, M, N, K, stride_am, stride_bn, stride_bsn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    FAST: tl.constexpr,
):  # fmt: skip
    """out^T[BLOCK_N, BLOCK_M] += dot_scaled(weights e2m1, activations^T bf16) over this program's K split; fp32
    atomics into a zeroed output when K is split (a probe: summation order is not fixed)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    bn = (rn % N).to(tl.int64)
    am = (rm % M).to(tl.int64)
    k_len = K // SPLIT_K
    k_lo = tl.program_id(1) * k_len
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_len, BLOCK_K):
        w = tl.load(B + bn[:, None] * stride_bn + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :])
        s = tl.load(B_SCALE + bn[:, None] * stride_bsn + (k0 // 32 + tl.arange(0, BLOCK_K // 32))[None, :])
        a = tl.load(A + am[:, None] * stride_am + (k0 + tl.arange(0, BLOCK_K))[None, :])
        acc = tl.dot_scaled(w, s, "e2m1", tl.trans(a), None, "bf16", acc, fast_math=FAST)
    out = tl.trans(acc)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = OUT + rm[:, None] * N + rn[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, out, mask=mask)
    else:
        tl.atomic_add(ptrs, out, mask=mask, sem="relaxed")


def dot_scaled_mm(a, b, b_s, block_n: int, split: int, warps: int, fast: bool = False) -> torch.Tensor:
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    out = (torch.zeros if split > 1 else torch.empty)(m, n, device=a.device, dtype=torch.float32)
    bm = max(16, triton.next_power_of_2(m))
    grid = (triton.cdiv(n, block_n), split)
    _ds_kernel[grid](
        a, b.view(torch.uint8), b_s.view(torch.uint8), out, m, n, k, a.stride(0), b.stride(0), b_s.stride(0),
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=128, SPLIT_K=split, FAST=fast, num_warps=warps, num_stages=4,
    )  # fmt: skip
    return out


def main() -> None:
    fmt = "mxfp4_e2m1"
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        b, b_s = fly_lightning.mx_cast(w, fmt, "floor")
        ref = mx_scaled_mm_reference(x, None, None, b, b_s, fmt, torch.float32)
        plan = kernel.plan(m, n, k, None, fmt, x.device)
        fns = {
            "ours": lambda x, w, b, b_s: kernel.launch(x, None, None, b, b_s, fmt, torch.bfloat16),
            "bf16": lambda x, w, b, b_s: torch.mm(x, w.t()),
        }
        variants = []
        for split in sorted({plan.split_k, plan.split_k * 2, max(1, plan.split_k // 2)}):
            if k % (128 * split):
                continue
            for lut in (False, True):
                swapped = replace(plan, swap=True, split_k=split, fp4_lut=lut)
                variants += [replace(swapped, swap=False), swapped, replace(swapped, fragment_k=True)]
                variants.append(replace(swapped, block_n=128, num_warps=8, fragment_k=True))  # 2 warpgroups
        for cfg in {c: None for c in variants if c != plan}:
            name = cfg.label() + ("-noswap" if not cfg.swap else "")
            fns[name] = lambda x, w, b, b_s, c=cfg: kernel.launch(x, None, None, b, b_s, fmt, torch.bfloat16, c)
        for bn in (64, 128):
            for fast in (False, True):
                name = f"ds{'-fast' if fast else ''}-n{bn}-k{plan.split_k}"
                c = (bn, plan.split_k, 4, fast)
                fns[name] = lambda x, w, b, b_s, c=c: dot_scaled_mm(x, b, b_s, *c)
        inputs = [(x, w, b, b_s)]
        ms, errs = probe_graph_ms(fns, inputs, ref, f"{m}x{n}x{k}", CALLS)
        best = min((t, nm) for nm, t in ms.items() if nm not in ("ours", "bf16") and errs[nm] < 1e-2)
        print(f"w4 {m}x{n}x{k}: ours ({plan.label()}) {ms['ours'] * 1e3:.1f} us, bf16 {ms['bf16'] * 1e3:.1f} us, "
              f"best other {best[1]} {best[0] * 1e3:.1f} us", flush=True)  # fmt: skip
        print("   " + "  ".join(f"{nm}={t * 1e3:.1f}" + ("!" if errs[nm] > 1e-2 else "") for nm, t in ms.items()))


if __name__ == "__main__":
    main()
