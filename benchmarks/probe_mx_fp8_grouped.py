"""Probe (GPU): grouped GEMM on fp8 tensor cores for MX operands, in forms of the K loop, against the bf16 grouped
GEMM (ours, on the dequantised operands) and the MX grouped plan, on grouped suite cases:

- ``step``: e4m3 with 1x128 scales (``_mx_requant``), each 128-wide step's fp8 product scaled into the fp32
  accumulator right away (the form tried at 8620c77: about 330 TFLOP/s on the H100);
- ``lagged``: the same sums, each step's product scaled one step later, after the next step's MMA is issued;
- ``row``: one scale per row over the whole K (rows of x, and of each expert's weight), the fp8 MMAs accumulating
  across K with a promotion to fp32 every 128 (``max_num_imprecise_acc``), both scales in the epilogue;
- ``row_fast``: the same without promotion (the fp8 MMA's own accumulation across K).

- ``k-<tiles>``: the product's fp8 grouped kernel (``_mx_fp8_grouped_kernel``: TMA loads of the codes, pointer
  loads of the scales), the ``step`` sums, in tile configurations and programs per SM.

The re-expression is done beforehand (not timed): the GEMM forms alone, device time from CUDA-graph replays, side by
side, after a check against the fp32 product of the dequantised operands; beside them ``plan`` (the public call),
``prepass`` (the bf16 prepass plan) and ``fp8-plan-<tiles>`` (the fp8 plan, its re-expression included).
Prints; not a suite.

    python -m benchmarks.probe_mx_fp8_grouped             # the product kernel's configurations (k-*), the plans
    python -m benchmarks.probe_mx_fp8_grouped --all       # and the probe's own forms (step, lagged, row, row_fast)
    python -m benchmarks.probe_mx_fp8_grouped --band      # the plans alone over K and rows per group (the band)

``--band`` times the plans alone (bf16 GEMM on dequantised operands, the bf16 prepass plan and the fp8 plan) on
uniform loads of 256 to 768 rows per group over K 768 to 2048, and on half the groups empty: where the fp8 plan's
band should start and end in K and in rows per group.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

import fly_lightning
from benchmarks.grouped_mm_cases import Case, cases, empty_counts, mx_probe_operands, uniform_counts
from benchmarks.harness import probe_each, probe_graph_ms
from fly_lightning.kernels.triton import _mx_fp8_grouped_kernel as fk
from fly_lightning.kernels.triton import _mx_grouped_mm_kernel as mk
from fly_lightning.kernels.triton._grouped_mm_kernel import _advance, _band_swizzle, _scan_start
from fly_lightning.kernels.triton._mx_requant import requantize
from fly_lightning.quant.formats import from_mx

CASES = (
    "uniform-E128-m64-K4096-N1024",
    "uniform-E128-m128-K2048-N1536",
    "uniform-E64-m256-K2048-N2048",
    "uniform-E32-m512-K2048-N4096",
    "qwen3-30b-a3b-gate_up",
    "olmoe-1b-7b-down",
    "deepseek-v3-ep8-down",
    "mixtral-8x7b-down",
    "uniform-E8-m4096-K4096-N4096",
)
TILES = {  # block_m, block_n, group_m, stages, warps, programs per SM
    "128x128-w8-p1": (128, 128, 8, 4, 8, 1),
    "64x128-w4-p2-s3": (64, 128, 8, 3, 4, 2),
    "64x128-w4-p2-s4": (64, 128, 8, 4, 4, 2),
    "64x256-w8-p1-s3": (64, 256, 8, 3, 8, 1),
    "128x64-w4-p2-s3": (128, 64, 8, 3, 4, 2),
}
MODES = {"step": 0, "lagged": 1, "row": 2, "row_fast": 3}
ALL = "--all" in sys.argv
BAND = "--band" in sys.argv
BAND_ROWS = (256, 512, 768)
BAND_K = (768, 1024, 1536, 2048)
BAND_E, BAND_N = 128, 2048


@triton.jit
def _ld(ptrs):
    return tl.load(ptrs).to(tl.float8e4nv, bitcast=True)


# fmt: off
@triton.jit
def _tile(tile, g, g_first, g_start, g_size, X, XS, W, WS, OUT, N, stride_xm, stride_xsk, stride_we, stride_wn,
          stride_wsk, stride_om, num_n, k_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          GROUP_M: tl.constexpr, MODE: tl.constexpr):
    pid_m, pid_n = _band_swizzle(tile - g_first, tl.cdiv(g_size, BLOCK_M), num_n, GROUP_M)
    rows = g_start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < g_start + g_size
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    src = tl.where(row_ok, rows, 0).to(tl.int64)
    col = tl.where(col_ok, cols, 0).to(tl.int64)
    ks = tl.arange(0, 128)
    xp = X + src[:, None] * stride_xm + ks[None, :]
    wp = W + g.to(tl.int64) * stride_we + col[:, None] * stride_wn + ks[None, :]
    xs = XS + src
    ws = WS + g.to(tl.int64) * N + col
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MODE == 0:
        for kk in range(0, k_tiles):
            p = tl.dot(_ld(xp + kk * 128), tl.trans(_ld(wp + kk * 128)))
            acc += p * (tl.load(xs + kk * stride_xsk)[:, None] * tl.load(ws + kk * stride_wsk)[None, :])
    elif MODE == 1:
        p = tl.dot(_ld(xp), tl.trans(_ld(wp)))
        for kk in range(1, k_tiles):
            q = tl.dot(_ld(xp + kk * 128), tl.trans(_ld(wp + kk * 128)))
            j = kk - 1
            acc += p * (tl.load(xs + j * stride_xsk)[:, None] * tl.load(ws + j * stride_wsk)[None, :])
            p = q
        j = k_tiles - 1
        acc += p * (tl.load(xs + j * stride_xsk)[:, None] * tl.load(ws + j * stride_wsk)[None, :])
    else:
        for kk in range(0, k_tiles):
            if MODE == 2:
                acc = tl.dot(_ld(xp + kk * 128), tl.trans(_ld(wp + kk * 128)), acc, max_num_imprecise_acc=128)
            else:
                acc = tl.dot(_ld(xp + kk * 128), tl.trans(_ld(wp + kk * 128)), acc)
        acc = acc * (tl.load(xs)[:, None] * tl.load(ws)[None, :])
    o = OUT + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(o, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _kernel(X, XS, W, WS, OUT, OFFS, M, N, K, E, stride_xm, stride_xsk, stride_we, stride_wn, stride_wsk, stride_om,
            NUM_PROGS, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
            MODE: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = K // 128
    total, g, g_first, g_start, g_end, g_size, g_tiles = _scan_start(pid, OFFS, M, E, num_n, BLOCK_M, E_POW2)
    for tile in range(pid, total, NUM_PROGS):
        g, g_first, g_start, g_end, g_size, g_tiles = _advance(
            tile, g, g_first, g_start, g_end, g_size, g_tiles, OFFS, M, E, num_n, BLOCK_M)
        _tile(tile, g, g_first, g_start, g_size, X, XS, W, WS, OUT, N, stride_xm, stride_xsk, stride_we, stride_wn,
              stride_wsk, stride_om, num_n, k_tiles, BLOCK_M, BLOCK_N, GROUP_M, MODE)
# fmt: on


def _rowwise(data: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-of-two scale per row (the largest block scale; e2m1 shifted up by 6), e4m3 elements: [R, K], [1, R]."""
    v = from_mx(data, scale, fmt)
    top = scale.view(torch.uint8).int().amax(1) - (6 if fmt == "mxfp4_e2m1" else 0)
    s = torch.exp2((top - 127).float())
    return (v / s[:, None]).to(torch.float8_e4m3fn), s[None, :].contiguous()


def _launch(qx, sx, qw, sw, offs, out, mode, bm, bn, warps, stages):
    e, n, k = qw.shape
    m = qx.shape[0]
    progs = torch.cuda.get_device_properties(qx.device).multi_processor_count
    u8 = torch.uint8
    _kernel[(progs,)](qx.view(u8), sx, qw.view(u8), sw, out, offs, m, n, k, e, qx.stride(0), sx.stride(0),
                      qw.stride(0), qw.stride(1), sw.stride(0), out.stride(0), progs, E_POW2=max(1024, e),
                      BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, MODE=mode, num_warps=warps, num_stages=stages)  # fmt: skip
    return out


def _case(fmt: str, case) -> None:
    e, n, k = case.e, case.n, case.k
    xd, xs, wd, ws, args, bf16, ref, out = mx_probe_operands(case, fmt)
    offs = args[-1]
    qx, sxb, qw, swb = requantize(xd, xs, fmt, wd, ws, fmt)
    rx, rsx = _rowwise(xd, xs, fmt)
    rw, rsw = _rowwise(wd, ws, fmt)
    fns = {
        "bf16": bf16,
        "plan": lambda: fly_lightning.mx_grouped_mm(args[0], *args[3:7], x_scale=xs, x_fmt=fmt),
    }
    qx8, sx8, qw8, sw8 = requantize(xd, xs, fmt, wd, ws, fmt)
    qw8 = qw8.view(e, n, k)
    for name, t in TILES.items():
        bm, bn, gm, stages, warps, progs = t
        cfg = mk.MXGroupedMMConfig(bm, bn, 128, gm, stages, warps, programs_per_sm=progs, fp8=True)
        fns[f"k-{name}"] = lambda cfg=cfg: fk.launch(qx8, sx8, qw8, sw8, offs, out, cfg)
    fns["prepass"] = lambda: mk.launch(*args[:6], offs, out, config=mk.PREPASS)
    for name, t in (("64x128-w4-p2-s3", (64, 128, 128, 8, 3, 4, 2)), ("128x128-w8-p1", (128, 128, 128, 8, 4, 8, 1))):
        cfg = mk.MXGroupedMMConfig(*t, fp8=True)
        fns[f"fp8-plan-{name}"] = lambda cfg=cfg: mk.launch(*args[:6], offs, out, config=cfg)
    for mode, code in MODES.items() if ALL else ():
        for bm, bn, warps, stages in ((64, 256, 8, 3), (128, 128, 8, 3), (128, 256, 8, 3)):
            if code < 2 and (bm, bn) != (64, 256):
                continue  # the per-step forms spill in larger tiles
            q = (qx, sxb.t(), qw.view(e, n, k), swb) if code < 2 else (rx, rsx, rw.view(e, n, k), rsw)
            fns[f"{mode}-{bm}x{bn}"] = lambda q=q, c=code, t=(bm, bn, warps, stages): _launch(*q, offs, out, c, *t)
    ms, errs = probe_graph_ms({k_: (lambda *_, f=f: f()) for k_, f in fns.items()}, [()], ref, f"{fmt} {case.name}")
    flops = 2 * case.m * n * k
    print(f"{fmt} {case.name}", flush=True)
    for k_, t in ms.items():
        print(f"   {k_:22s} {t * 1e3:9.1f} us {flops / t / 1e9:7.1f} TFLOP/s  x_bf16 {ms['bf16'] / t:5.2f}"
              f"  err {errs.get(k_, 0):.2e}", flush=True)  # fmt: skip


def _band_cases() -> list[Case]:
    out = []
    for rows in BAND_ROWS:
        for k in BAND_K:
            m = BAND_E * rows
            out.append(Case(f"E{BAND_E}-m{rows}-K{k}", "band", BAND_E, k, BAND_N, uniform_counts(m, BAND_E)))
            if rows == 512:  # the same rows over half the groups: 1024 rows in each group that has any
                out.append(Case(f"E{BAND_E}-m{rows}-K{k}-half-empty", "band", BAND_E, k, BAND_N,
                                empty_counts(m, BAND_E, 0.5, seed=4), load="half-empty"))  # fmt: skip
    return out


def _band_case(fmt: str, case: Case) -> None:
    *_, args, bf16, ref, out = mx_probe_operands(case, fmt)
    offs = args[-1]
    fns = {
        "bf16": bf16,
        "prepass": lambda: mk.launch(*args[:6], offs, out, config=mk.PREPASS),
        "fp8-plan": lambda: mk.launch(*args[:6], offs, out, config=mk.FP8),
    }
    ms, errs = probe_graph_ms({k_: (lambda *_, f=f: f()) for k_, f in fns.items()}, [()], ref, f"{fmt} {case.name}")
    print(f"{fmt} {case.name:28s} bf16 {ms['bf16'] * 1e3:7.1f} us  prepass {ms['prepass'] * 1e3:7.1f}"
          f"  fp8 {ms['fp8-plan'] * 1e3:7.1f}  fp8/prepass speed {ms['prepass'] / ms['fp8-plan']:5.2f}"
          f"  err {max(errs.values(), default=0):.2e}", flush=True)  # fmt: skip


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    by_name = {c.name: c for c in cases()}
    for fmt in ("mxfp8_e4m3", "mxfp4_e2m1"):
        if BAND:
            probe_each(lambda c, f=fmt: _band_case(f, c), _band_cases(), lambda c, f=fmt: f"{f} {c.name}")
        else:
            probe_each(lambda c, f=fmt: _case(f, c), [by_name[n] for n in CASES], lambda c, f=fmt: f"{f} {c.name}")


if __name__ == "__main__":
    main()
