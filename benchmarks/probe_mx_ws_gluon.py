"""Probe (GPU, Hopper): a warp-specialised MX grouped GEMM written in Gluon (Triton's explicit-layout dialect), against
our bf16 grouped GEMM and the MX plan, on grouped suite cases.

Why: Hopper has no MX tensor cores, so every MX grouped plan converts weights to bf16 on the MMA warps' critical path
(in registers) or through memory (the prepass). Here the partitions share each K step through shared memory: TMA
loads (x bf16 tile, raw MX weight bytes), converter warps turning the raw bytes into a bf16 tile (scales applied),
and the MMA warps (the default partition) running wgmma on x and the converted tile. While the converters work on
step k + 1, the MMAs run step k: the conversion leaves the critical path when it costs less than the MMA. x is
dequantised to bf16 first (``dequantize``: M x K, small beside the weights' conversion). One tile per program (grid:
an upper bound on the tiles; extra programs exit), the group found by a scan of the int32 end offsets on the device:
no host sync. Prints; not a suite.

What it showed (H100, Triton 3.6, x bf16 given; x our bf16 grouped GEMM by device time, d44f875 + this probe):
- 256x128 tiles (rows x weights), 8 MMA warps and 4 converter warps that also issue the loads (``CONFIGS[1]``, PTX
  conversion): 0.64-0.71x MXFP8, 0.63-0.72x MXFP4 on the four cases below, where the plan ran 0.63-0.82x; with the
  conversion through fp32 (``CONFIGS[0]``) 0.65-0.71x / 0.55-0.61x.
- With no conversion at all (``CONFIGS[2]``, wrong values: the pipeline's own ceiling) 0.72-0.87x. So this
  structure (one tile per program, its epilogue not overlapped, one converted tile handed over per K step) is
  slower than our Triton bf16 grouped GEMM before any conversion, and the conversion still costs it 10-23%.
- 128x128 tiles with 4 MMA and 8 converter warps: 0.46-0.54x (0.56-0.68x unconverted). An earlier run (fp32
  conversion; 128x128 tiles with a separate loader warp, 256x128, 128x256) ran 0.34-0.74x on seven cases, below the
  plan on all.
Reaching 0.9x this way needs a Gluon grouped GEMM at our bf16 kernel's rate first (persistent tiles, epilogue
overlapped with the next tile's loads, two consumer warpgroups), then the conversion hidden inside it.

    python -m benchmarks.probe_mx_ws_gluon [--compile [--dump]]   # --compile: sm90 compile check only (no GPU)
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from benchmarks.grouped_mm_cases import cases, mx_probe_operands
from benchmarks.harness import print_probe_rows, probe_each, probe_graph_ms
from fly_lightning.kernels.triton import _mx_grouped_mm_kernel as mk
from fly_lightning.kernels.triton._mx_dequant import FP4_WORDS_LUT_ASM, dequantize


class WSConfig(NamedTuple):
    """One launch: tile (x rows ``bm``, weights ``bn``, ``bk``), pipeline ``stages``, the converter partition's
    warps and registers, the wgmma warps (``num_warps``), the registers every thread starts with (``maxnreg``: warps
    x 32 x maxnreg must fit the 64K register file) and ``cvt`` (0: through fp32, 1: inline PTX, 2: none, wrong
    values). The converter warps issue the loads too: a loader warp of its own would make 16 warps in all, capped at
    128 registers each (too few for the accumulators; that form is in git history, 03f4c03)."""

    bm: int
    bn: int
    bk: int
    stages: int
    cvt_regs: int
    num_warps: int
    maxnreg: int
    cvt: int
    cvt_warps: int


CONFIGS = [
    WSConfig(256, 128, 64, 3, 128, 8, 168, 0, 4),
    WSConfig(256, 128, 64, 3, 128, 8, 168, 1, 4),
    WSConfig(256, 128, 64, 3, 128, 8, 168, 2, 4),  # no conversion: the pipeline's ceiling
    WSConfig(128, 128, 64, 4, 168, 4, 168, 1, 8),
    WSConfig(128, 128, 64, 4, 168, 4, 168, 2, 8),
]


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _issue(x_desc, w_desc, x_bufs, raw_bufs, loaded, s, row0, wrow0, k, BK: gl.constexpr, WBK: gl.constexpr):
    mbarrier.expect(loaded.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [row0, k * BK], loaded.index(s), x_bufs.index(s))
    tma.async_copy_global_to_shared(w_desc, [wrow0, k * WBK], loaded.index(s), raw_bufs.index(s))


# e4m3 bytes (four per register, pack=4) to bf16 pairs: magnitude bits under bf16's exponent field (bias 7 kept),
# the sign at bit 15, then two exact bf16x2 multiplies (-0 addend): by 2^120 (the bias) and by the block scale.
# The NaN code 0x7F reads as 480 here (to_mx emits it only in NaN blocks, whose scale still makes them NaN); a kernel
# kept for the operator would have to honour it as the oracle does.
_E4M3_ASM = gl.constexpr(
    "{ .reg .b32 a, b, t, c, z; mov.b32 c, 0x7B807B80; mov.b32 z, 0x80008000;"
    " prmt.b32 a, $2, 0, 0x4140; prmt.b32 b, $2, 0, 0x4342;"
    " shl.b32 t, a, 8; shl.b32 a, a, 4; and.b32 t, t, 0x80008000; and.b32 a, a, 0x07F007F0; or.b32 a, a, t;"
    " shl.b32 t, b, 8; shl.b32 b, b, 4; and.b32 t, t, 0x80008000; and.b32 b, b, 0x07F007F0; or.b32 b, b, t;"
    " fma.rn.bf16x2 a, a, c, z; fma.rn.bf16x2 $0, a, $3, z; fma.rn.bf16x2 b, b, c, z; fma.rn.bf16x2 $1, b, $3, z; }"
)
# four bytes of e2m1 pairs to four words of two bf16 (byte j -> word j), by byte tables (prmt), scaled (fma)
_E2M1_ASM = FP4_WORDS_LUT_ASM


@gluon.jit
def _convert(raw3, sc, BN: gl.constexpr, BK: gl.constexpr, FP4: gl.constexpr, CVT: gl.constexpr):
    """Raw bytes ``[BN, C, V]`` (V per thread) and their E8M0 scales ``[BN, C]`` to bf16 ``[BN, BK]``. ``CVT`` 0:
    through fp32 (hardware fp8 conversion); 1: inline PTX on packed registers; 2: none (zeros: the pipeline's
    ceiling, wrong values)."""
    if CVT == 1:
        b = (sc.to(gl.uint32) << 7) | gl.where((sc == 0) | (sc == 255), 0x40, 0).to(gl.uint32)
        pair = gl.broadcast(gl.expand_dims(b | (b << 16), 2), raw3)[0]
        if FP4:
            words = gl.inline_asm_elementwise(
                _E2M1_ASM, "=r,=r,=r,=r,r,r,r,r,r", [raw3, pair], dtype=gl.uint32, is_pure=True, pack=4
            )
            lo = (words & 0xFFFF).to(gl.uint16).to(gl.bfloat16, bitcast=True)
            hi = (words >> 16).to(gl.uint16).to(gl.bfloat16, bitcast=True)
            w = gl.reshape(gl.join(lo, hi), [BN, BK])
        else:
            w = gl.reshape(
                gl.inline_asm_elementwise(
                    _E4M3_ASM, "=r,=r,r,r,r,r,r", [raw3, pair], dtype=gl.bfloat16, is_pure=True, pack=4
                ),
                [BN, BK],
            )
    elif CVT == 2:
        z = (raw3.to(gl.uint16) * 0).to(gl.bfloat16, bitcast=True)
        w = gl.reshape(gl.join(z, z) if FP4 else z, [BN, BK])
    else:
        s32 = ((sc.to(gl.int32) << 23) | gl.where((sc == 0) | (sc == 255), 0x400000, 0)).to(gl.float32, bitcast=True)
        if FP4:
            p = raw3.to(gl.int32)
            codes = gl.join(p & 0xF, p >> 4)  # [BN, C, V, 2]: low nibble first
            bits = ((codes & 8) << 12) | ((codes & 7) << 6)
            v = bits.to(gl.int16).to(gl.bfloat16, bitcast=True).to(gl.float32) * 2.0**126
            s4 = gl.broadcast(gl.expand_dims(s32, 2), raw3)[0]
            w = gl.reshape(v * gl.join(s4, s4), [BN, BK]).to(gl.bfloat16)
        else:
            v = raw3.to(gl.float8e4nv, bitcast=True).to(gl.float32)
            w = gl.reshape(v * gl.expand_dims(s32, 2), [BN, BK]).to(gl.bfloat16)
    return w


@gluon.jit
def _converter(x_desc, w_desc, x_bufs, raw_bufs, wb_bufs, loaded, empty, wb_ready, wb_empty, WS, row0, wrow0,
               n_valid, stride_ws, k_tiles, BN: gl.constexpr, BK: gl.constexpr, WBK: gl.constexpr,
               FP4: gl.constexpr, CVT: gl.constexpr, CW: gl.constexpr):  # fmt: skip
    """Issues the TMA loads too, S - 1 steps ahead (no loader warp). ``CW``: this partition's warps."""
    S: gl.constexpr = raw_bufs.shape[0]
    for j in gl.static_range(S - 1):
        if j < k_tiles:
            _issue(x_desc, w_desc, x_bufs, raw_bufs, loaded, j, row0, wrow0, j, BK, WBK)
    # each thread: V consecutive bytes of one row (16 elements: one 16-byte shared load for fp8, 8 bytes for fp4)
    V: gl.constexpr = 8 if FP4 else 16
    C: gl.constexpr = WBK // V
    L2: gl.constexpr = gl.BlockedLayout([1, V], [32 // C, C], [CW, 1], [1, 0])
    L3: gl.constexpr = gl.BlockedLayout([1, 1, V], [32 // C, C, 1], [CW, 1, 1], [2, 1, 0])
    LS: gl.constexpr = gl.SliceLayout(2, L3)
    n = gl.arange(0, BN, layout=gl.SliceLayout(1, LS))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, LS))
    s_ptrs = WS + (wrow0.to(gl.int64) + n)[:, None] * stride_ws + (c // 2)[None, :]  # 16 elements per chunk
    s_mask = (n < n_valid)[:, None] & (c < C)[None, :]
    sc = gl.load(s_ptrs, mask=s_mask, other=127)
    for k in range(k_tiles):
        s = k % S
        ph = (k // S) & 1
        # next step's scales in flight while this step converts
        sc_next = gl.load(s_ptrs + (k + 1) * (BK // 32), mask=s_mask & (k + 1 < k_tiles), other=127)
        mbarrier.wait(loaded.index(s), ph)
        raw3 = gl.convert_layout(gl.reshape(raw_bufs.index(s).load(L2), [BN, C, V]), L3)
        fence_async_shared()
        w = _convert(raw3, sc, BN, BK, FP4, CVT)
        mbarrier.wait(wb_empty.index(s), ph ^ 1)
        wb_bufs.index(s).store(w)
        fence_async_shared()
        mbarrier.arrive(wb_ready.index(s), count=1)
        sc = sc_next
        kn = k + S - 1  # into the stage of step k - 1, once the MMAs are done with it
        if kn < k_tiles:
            sn = kn % S
            mbarrier.wait(empty.index(sn), ((kn // S) & 1) ^ 1)
            _issue(x_desc, w_desc, x_bufs, raw_bufs, loaded, sn, row0, wrow0, kn, BK, WBK)


@gluon.jit
def _mma(x_bufs, wb_bufs, loaded, empty, wb_ready, wb_empty, k_tiles, OUT, stride_om, row0, row_end, n0, N,
         BM: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    S: gl.constexpr = x_bufs.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN, 16])  # fmt: skip
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    for k in range(k_tiles):
        s = k % S
        ph = (k // S) & 1
        mbarrier.wait(loaded.index(s), ph)
        mbarrier.wait(wb_ready.index(s), ph)
        acc = warpgroup_mma(x_bufs.index(s), wb_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if k > 0:  # step k - 1's MMA is done: its buffers go back
            sp = (k - 1) % S
            mbarrier.arrive(empty.index(sp), count=1)
            mbarrier.arrive(wb_empty.index(sp), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    ptrs = OUT + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
    gl.store(ptrs, acc.to(gl.bfloat16), mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@gluon.jit
def _mx_ws_grouped_kernel(x_desc, w_desc, WS, OUT, OFFS, M, N, E, stride_ws, stride_om, k_tiles,
                          BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, S: gl.constexpr,
                          E_POW2: gl.constexpr, FP4: gl.constexpr, CVT_REGS: gl.constexpr,
                          CVT: gl.constexpr, CW: gl.constexpr,
                          num_warps: gl.constexpr):  # fmt: skip
    pid = gl.program_id(0)
    num_n = (N + BN - 1) // BN
    le: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    gi = gl.arange(0, E_POW2, layout=le)
    ends = gl.minimum(gl.maximum(gl.load(OFFS + gi, mask=gi < E, other=0), 0), M)
    starts = gl.minimum(gl.maximum(gl.load(OFFS + gi - 1, mask=(gi > 0) & (gi < E), other=0), 0), M)
    sizes = gl.where(gi < E, gl.maximum(ends - starts, 0), 0)
    tiles = (sizes + BM - 1) // BM * num_n
    cum = gl.associative_scan(tiles, 0, _add)
    total = gl.sum(tiles, 0)
    if pid >= total:
        return
    g = gl.sum(gl.where(cum <= pid, 1, 0), 0)
    first = gl.sum(gl.where(gi == g, cum - tiles, 0), 0)
    g_start = gl.sum(gl.where(gi == g, starts, 0), 0)
    g_size = gl.sum(gl.where(gi == g, sizes, 0), 0)
    m_tiles = (g_size + BM - 1) // BM
    r = pid - first
    row0 = g_start + (r % m_tiles) * BM
    n0 = (r // m_tiles) * BN
    wrow0 = g * N + n0

    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [S, BM, BK], x_desc.layout)
    raw_bufs = gl.allocate_shared_memory(gl.uint8, [S] + w_desc.block_type.shape, w_desc.layout)
    wb_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    wb_bufs = gl.allocate_shared_memory(gl.bfloat16, [S, BN, BK], wb_layout)
    loaded = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    wb_ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    wb_empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(loaded.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)  # the MMAs are done with the stage (x and the converted tile)
        mbarrier.init(wb_ready.index(i), count=1)
        mbarrier.init(wb_empty.index(i), count=1)
    WBK: gl.constexpr = BK // 2 if FP4 else BK
    gl.warp_specialize(
        [(_mma, (x_bufs, wb_bufs, loaded, empty, wb_ready, wb_empty, k_tiles, OUT, stride_om, row0,
                 g_start + g_size, n0, N, BM, BN, num_warps)),
         (_converter, (x_desc, w_desc, x_bufs, raw_bufs, wb_bufs, loaded, empty, wb_ready, wb_empty, WS, row0,
                       wrow0, N - n0, stride_ws, k_tiles, BN, BK, WBK, FP4, CVT, CW))],
        [CW],
        [CVT_REGS],
    )  # fmt: skip


def launch(xb, w_data, w_scale, offs, out, fp4: bool, config: WSConfig = CONFIGS[1]):
    """``xb`` bf16 [M, K]; ``w_data`` uint8 [E, N, K / per_byte]; ``w_scale`` uint8 [E, N, K / 32]; int32 ``offs``."""
    bm, bn, bk, stages, cvt_regs, warps, maxnreg, cvt, cw = config
    m, k = xb.shape
    e, n, _ = w_data.shape
    wbk = bk // 2 if fp4 else bk
    x_desc = TensorDescriptor.from_tensor(xb, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16))
    w2 = w_data.view(torch.uint8).reshape(e * n, -1)
    w_desc = TensorDescriptor.from_tensor(w2, [bn, wbk], gl.NVMMASharedLayout.get_default_for([bn, wbk], gl.uint8))
    ws2 = w_scale.view(torch.uint8).reshape(e * n, -1)
    grid = ((triton.cdiv(m, bm) + e) * triton.cdiv(n, bn),)
    _mx_ws_grouped_kernel[grid](
        x_desc, w_desc, ws2, out, offs, m, n, e, ws2.stride(0), out.stride(0), k // bk,
        BM=bm, BN=bn, BK=bk, S=stages, E_POW2=triton.next_power_of_2(e), FP4=fp4, CVT_REGS=cvt_regs,
        CVT=cvt, CW=cw,
        num_warps=warps, maxnreg=maxnreg,
    )  # fmt: skip
    return out


def _compile_check() -> None:
    """Compile for sm90 without a GPU (ptxas from Triton's wheel): layouts, partitions and registers."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    for fp4, (bm, bn, bk, stages, cvt_regs, warps, maxnreg, cvt, cw) in [
        (f, c) for f in (False, True) for c in CONFIGS
    ]:
        wbk = bk // 2 if fp4 else bk
        xd = TensorDescriptor.from_tensor(
            torch.zeros(256, 256, dtype=torch.bfloat16), [bm, bk],
            gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16),
        )  # fmt: skip
        wd = TensorDescriptor.from_tensor(
            torch.zeros(256, 256, dtype=torch.uint8),
            [bn, wbk],
            gl.NVMMASharedLayout.get_default_for([bn, wbk], gl.uint8),
        )
        sig = {
            "x_desc": mangle_type(xd), "w_desc": mangle_type(wd), "WS": "*u8", "OUT": "*bf16", "OFFS": "*i32",
            "M": "i32", "N": "i32", "E": "i32", "stride_ws": "i32", "stride_om": "i32", "k_tiles": "i32",
            "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "S": "constexpr", "E_POW2": "constexpr",
            "FP4": "constexpr", "CVT_REGS": "constexpr", "CVT": "constexpr", "CW": "constexpr",
            "num_warps": "constexpr",
        }  # fmt: skip
        consts = {"BM": bm, "BN": bn, "BK": bk, "S": stages, "E_POW2": 128, "FP4": fp4, "CVT_REGS": cvt_regs,
                  "CVT": cvt, "CW": cw, "num_warps": warps}  # fmt: skip
        names = list(sig)
        src = GluonASTSource(_mx_ws_grouped_kernel, sig, {(names.index(k),): v for k, v in consts.items()})
        target = GPUTarget("cuda", 90, 32)
        ck = triton.compile(src, target=target, options={"num_warps": warps, "maxnreg": maxnreg})
        md = ck.metadata
        tag = f"{'fp4' if fp4 else 'fp8'}-{bm}x{bn}x{bk}-s{stages}-r{cvt_regs}-w{warps}-c{cvt}-cw{cw}"
        print(f"{tag}: compiled, shared {md.shared} bytes", flush=True)
        if "--dump" in sys.argv:
            for ext in ("ttgir", "ptx"):
                with open(f"/tmp/mx_ws_{tag}.{ext}", "w") as f:
                    f.write(ck.asm[ext])


CASES = (
    "uniform-E32-m512-K2048-N4096",
    "qwen3-30b-a3b-gate_up",
    "olmoe-1b-7b-gate_up",
    "mixtral-8x7b-down",
)


def _case(fmt: str, case) -> None:
    xd, xs, wd, ws, args, bf16, ref, out = mx_probe_operands(case, fmt)
    offs = args[-1]
    w, w_scale = args[3], args[4]
    xb = dequantize(xd, xs, fmt)
    fp4 = fmt == "mxfp4_e2m1"
    fns = {"bf16": bf16, "plan": lambda: mk.launch(*args[:6], offs, out)}
    fns["ws1+x"] = lambda: launch(dequantize(xd, xs, fmt), w, w_scale, offs, out, fp4, CONFIGS[1])
    for i, cfg in enumerate(CONFIGS):
        fns[f"ws{i}"] = lambda cfg=cfg: launch(xb, w, w_scale, offs, out, fp4, cfg)
    ms, errs = probe_graph_ms({k: (lambda *_, f=f: f()) for k, f in fns.items()}, [()], ref, f"{fmt} {case.name}")
    flops = 2 * case.m * case.n * case.k
    print(f"{fmt} {case.name}")
    print_probe_rows(ms, errs, flops)


def main() -> None:
    if "--compile" in sys.argv:
        _compile_check()
        return
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    by_name = {c.name: c for c in cases()}
    names = CASES[:1] if "--quick" in sys.argv else CASES
    items = [(fmt, by_name[n]) for n in names for fmt in ("mxfp8_e4m3", "mxfp4_e2m1")]
    probe_each(lambda it: _case(*it), items, lambda it: f"{it[0]} {it[1].name}")


if __name__ == "__main__":
    main()
