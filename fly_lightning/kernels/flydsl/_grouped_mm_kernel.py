"""Grouped GEMM forward (MoE experts) as a FlyDSL kernel for AMD gfx950 (MI350).

    out[s_e:end_e] = x[s_e:end_e] @ w[e]        end_e = offs[e], s_e = end_{e-1} (s_0 = 0)

``x`` is ``[M, K]`` (contiguous), ``w`` is ``[E, K, N]`` either N-contiguous (``w.stride(2) == 1``) or K-contiguous
(the transposed view of a contiguous ``[E, N, K]``, the nn.Linear / transformers layout), ``offs`` int32 ``[E]`` group
end offsets (empty groups allowed), bf16 or fp16 inputs, fp32 accumulation with the gfx950 16-bit MFMA
``v_mfma_f32_16x16x32_{bf16,f16}``, output in the input dtype or fp32. Rows at and past ``offs[E - 1]`` are left
unwritten, as ``torch._grouped_mm`` leaves them. Offsets are read as the Triton kernel reads them: clamped to
``[0, M]`` and made non-decreasing, so invalid device offsets cannot reach memory outside the tensors.

Schedule. Grid ``(N / BN, (M + E * (BM - 1)) / BM)``: an upper bound on the row tiles of all groups; every wave
finds its workgroup's (expert, rows) from the offsets on its own (``_group_tiles``). Workgroups past the last tile
exit.

Tile. ``BM x BN`` output per 256-thread workgroup, 4 waves as ``WM x WN``, each wave ``(BM/WM) x (BN/WN)`` as
16x16 MFMA tiles; ``BK = 64`` per LDS stage (two K=32 MFMA steps). The MFMA's A operand is the weight tile (16 output
columns n), its B operand the x tile (16 rows m): the accumulator then holds, per lane, 4 consecutive columns of one
row, stored as one 8-byte (16-bit out) or 16-byte (fp32 out) buffer store. Both operands sit in LDS K-contiguous,
``[rows][BK + 8]`` (16-byte row padding against bank conflicts), and reach the MFMA by one ``ds_read_b128`` per
16x32 fragment. Global loads are 16-byte ``buffer_load_dwordx4``: x and K-contiguous w rows go to LDS as
``ds_write_b128``; N-contiguous w is transposed on the way (each thread loads 4 K-rows x 8 columns and writes 8
``ds_write_b64`` of 4 K-values each). One LDS stage with a register prefetch: the next K tile's global loads are
issued before the MFMAs on the current one. The K loop is a runtime loop; accumulators and prefetch registers live
in register arrays (promoted to VGPRs: the compile tests check for no scratch).

Bounds. Buffer descriptors sized to each tensor zero-fill out-of-range loads and drop out-of-range stores. Rows of a
tile past its group's end read the next group's rows (or zeros) and are not stored; columns past N likewise. A K
tail (``K % 64 != 0``) is zeroed explicitly on both operands. Offsets are 32-bit: each of x, w and out must be
under 2**31 bytes.

Only compiled here (no AMD GPU): ``compile_grouped_mm`` runs in a subprocess.
"""

from dataclasses import dataclass
from typing import Any

import torch

try:  # inside the package
    from .. import outputs
    from . import _batch, _group_tiles
    from . import _toolchain as compile_check
except ImportError:  # loaded by file path in the compile child (keeps the child free of fly_lightning imports)
    import _batch
    import _group_tiles
    import _toolchain as compile_check

    outputs = compile_check.outputs_module()

KERNEL_NAME = "fly_grouped_mm_fwd"
BLOCK_THREADS = 256
WAVE = 64
BK = 64  # K per LDS stage: two 16x16x32 MFMA steps
MFMA_K = 32
LDS_PAD = 8  # elements of padding per LDS row (16 bytes)
VEC = 8  # 16-bit elements per 16-byte global load
MAX_GROUPS = 1024  # S = ceil(E / 64) <= 16 offsets per lane, unrolled
MAX_BYTES = 2**31 - 1  # 32-bit buffer offsets

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
_OUT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
# (BM, BN, waves along M, waves along N)
TILES = {"128x128": (128, 128, 2, 2), "64x128": (64, 128, 1, 4)}


def constraints() -> dict[str, Any]:
    """What the kernel accepts, as plain data for the dispatcher's messages."""
    return {
        "arch": compile_check.TARGET_ARCH,
        "dtypes": [str(d) for d in _DTYPES],
        "out_dtypes": "input dtype or torch.float32",
        "x_layout": "[M, K] contiguous",
        "w_layouts": "[E, K, N] N-contiguous (stride (K*N, N, 1)) or K-contiguous (stride (K*N, 1, K))",
        "offs": "int32 [E], contiguous; clamped to [0, M] and made non-decreasing",
        "K": "multiple of 8 (16-byte rows); any K % 64 tail is zeroed",
        "N": "multiple of 8 (16-byte rows)",
        "E_max": MAX_GROUPS,
        "bytes_max": f"x, w and out each under 2**31 bytes ({MAX_BYTES})",
        "tiles": {k: f"BM={v[0]} BN={v[1]} BK={BK}, waves {v[2]}x{v[3]}" for k, v in TILES.items()},
        "mfma": "v_mfma_f32_16x16x32_bf16 / _f16, fp32 accumulators",
    }


def supports(
    K: int,
    N: int,
    E: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype | None = None,
    k_major: bool = True,
    M: int = 0,
) -> tuple[bool, str]:
    """(ok, reason). ``reason`` names the first unmet constraint."""
    if dtype not in _DTYPES:
        return False, f"dtype {dtype} (kernel takes bfloat16/float16)"
    if out_dtype is not None and out_dtype not in (dtype, torch.float32):
        return False, f"out_dtype {out_dtype} must be {dtype} or torch.float32"
    if not 1 <= E <= MAX_GROUPS:
        return False, f"E={E} outside [1, {MAX_GROUPS}]"
    if K < 1 or K % VEC:
        return False, f"K={K} not a positive multiple of {VEC} (16-byte rows)"
    if N < 1 or N % VEC:
        return False, f"N={N} not a positive multiple of {VEC} (16-byte rows)"
    out_bytes = 4 if out_dtype == torch.float32 else 2
    for name, nbytes in (("x", M * K * 2), ("w", E * K * N * 2), ("out", M * N * out_bytes)):
        if nbytes > MAX_BYTES:
            return False, f"{name} is {nbytes} bytes (32-bit buffer offsets: at most {MAX_BYTES})"
    return True, "ok"


@dataclass(frozen=True)
class Plan:
    """Compile-time shape of one specialization (M and the offsets are runtime)."""

    K: int
    N: int
    E: int
    dtype: str
    out_dtype: str
    k_major: bool  # w K-contiguous (transposed view of a contiguous [E, N, K])
    tile: str  # key of TILES
    bm: int
    bn: int
    waves_m: int
    waves_n: int
    k_tiles: int
    k_tail: bool
    lds_bytes: int


def make_plan(
    K: int, N: int, E: int, dtype: torch.dtype, out_dtype: torch.dtype | None, k_major: bool, tile: str = "128x128"
) -> Plan:
    bm, bn, wm, wn = TILES[tile]
    return Plan(
        K=K,
        N=N,
        E=E,
        dtype=_DTYPES[dtype],
        out_dtype=_OUT_DTYPES[out_dtype or dtype],
        k_major=k_major,
        tile=tile,
        bm=bm,
        bn=bn,
        waves_m=wm,
        waves_n=wn,
        k_tiles=-(-K // BK),
        k_tail=K % BK != 0,
        lds_bytes=(bm + bn) * (BK + LDS_PAD) * 2,
    )


def pick_tile(M: int, E: int) -> str:
    """64-row tiles when groups average under 128 rows (less padding per group), else 128."""
    return "64x128" if M < 128 * E else "128x128"


def build_grouped_mm(plan: Plan):
    """Return the ``@flyc.jit`` launcher for ``plan`` (imports FlyDSL lazily)."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl._mlir.dialects import llvm
    from flydsl.expr import const_expr, gpu, range_constexpr, rocdl
    from flydsl.expr.typing import T

    elem = {"bf16": fx.BFloat16, "f16": fx.Float16}[plan.dtype]
    out_ty = {"bf16": fx.BFloat16, "f16": fx.Float16, "f32": fx.Float32}[plan.out_dtype]
    out_bits = 32 if plan.out_dtype == "f32" else 16
    mfma = rocdl.mfma_f32_16x16x32_bf16 if plan.dtype == "bf16" else rocdl.mfma_f32_16x16x32_f16
    K, N, E = plan.K, plan.N, plan.E
    BM, BN, WM, WN = plan.bm, plan.bn, plan.waves_m, plan.waves_n
    MI = BM // WM // 16  # 16-row MFMA tiles per wave (x side)
    NI = BN // WN // 16  # 16-column MFMA tiles per wave (w side)
    LDK = BK + LDS_PAD  # LDS row length in elements
    KT = plan.k_tiles
    X_LOADS = BM * BK // (VEC * BLOCK_THREADS)  # 16-byte loads per thread per K tile
    W_LOADS = BN * BK // (VEC * BLOCK_THREADS)
    CPR = BK // VEC  # 16-byte chunks per K-contiguous tile row
    N_CHUNKS = BN // VEC  # N-contiguous w: 8-column chunks per K row
    assert X_LOADS >= 1 and W_LOADS >= 1 and BLOCK_THREADS % CPR == 0
    if not plan.k_major:
        assert W_LOADS == 4 and BLOCK_THREADS == N_CHUNKS * (BK // 4)

    @fx.struct
    class Tiles:
        w: fx.Array[elem, BN * LDK, 16]
        x: fx.Array[elem, BM * LDK, 16]

    def lds_store(base, elem_off, value, nbytes):
        ptr = (fx.recast_iter(fx.Uint8, base) + fx.Int32(elem_off * 2)).llvm_ptr
        llvm.StoreOp(value.ir_value() if hasattr(value, "ir_value") else value, ptr, alignment=nbytes)

    def lds_load8(base, elem_off):
        vec8 = fx.Vector.make_type(8, elem)  # made here: MLIR types need the kernel's context
        return fx.ptr_load(fx.recast_iter(fx.Uint8, base) + fx.Int32(elem_off * 2), result_type=vec8)

    @flyc.kernel(known_block_size=[BLOCK_THREADS, 1, 1])
    def fly_grouped_mm_fwd(
        X: fx.Tensor,
        W: fx.Tensor,
        Offs: fx.Tensor,
        Out: fx.Tensor,
        M: fx.Int32,
    ):
        tid = fx.thread_idx.x
        lane = tid % WAVE
        wave = tid // WAVE
        tile_n = fx.block_idx.x
        tile_t = fx.block_idx.y

        # ---- which group and rows this workgroup owns (per wave, no LDS) ----
        g_e, g_row, g_end = _group_tiles.find_group_tile(Offs, M, E, BM, lane, tile_t)

        if g_row >= 0:
            smem = fx.SharedAllocator().allocate(Tiles).peek()
            w_lds = smem.w.ptr
            x_lds = smem.x.ptr
            x_v = fx.logical_divide(fx.rocdl.make_buffer_tensor(X, max_size=False), fx.make_layout(1, 1))
            w_v = fx.logical_divide(fx.rocdl.make_buffer_tensor(W, max_size=False), fx.make_layout(1, 1))
            o_v = fx.logical_divide(fx.rocdl.make_buffer_tensor(Out, max_size=False), fx.make_layout(1, 1))
            g_atom = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), 16)
            n0 = tile_n * BN
            w_base = g_e * (K * N)
            zero8 = fx.Vector.filled(8, 0.0, elem)

            # Per-thread load slots (loop invariant): K-contiguous tiles are [rows][BK] in 16-byte chunks.
            x_slots = []
            for i in range_constexpr(X_LOADS):
                v = tid + i * BLOCK_THREADS
                row, kc = v // CPR, v % CPR * VEC
                x_slots.append(((g_row + row) * K + kc, row * LDK + kc, kc))
            w_slots = []
            if const_expr(plan.k_major):
                for i in range_constexpr(W_LOADS):
                    v = tid + i * BLOCK_THREADS
                    row, kc = v // CPR, v % CPR * VEC
                    w_slots.append((w_base + (n0 + row) * K + kc, row * LDK + kc, kc))
            else:
                nc, kq = tid % N_CHUNKS * VEC, tid // N_CHUNKS * 4  # 8 columns x 4 K-rows per thread
                for i in range_constexpr(4):
                    w_slots.append((w_base + (kq + i) * N + n0 + nc, nc * LDK + kq, kq + i))

            x_regs = [fx.make_rmem_tensor(8, elem) for _ in range_constexpr(X_LOADS)]
            w_regs = [fx.make_rmem_tensor(8, elem) for _ in range_constexpr(W_LOADS)]

            def load_tile(kt):
                for i in range_constexpr(X_LOADS):
                    fx.copy(g_atom, fx.slice(x_v, (None, x_slots[i][0] + kt * BK)), x_regs[i])
                for i in range_constexpr(W_LOADS):
                    step = BK if const_expr(plan.k_major) else BK * N
                    fx.copy(g_atom, fx.slice(w_v, (None, w_slots[i][0] + kt * step)), w_regs[i])

            def tail_masked(reg, k_local, kt):
                v = fx.memref_load_vec(reg)
                if const_expr(plan.k_tail):
                    v = (kt * BK + k_local < K).select(v, zero8)
                return v

            def store_tile(kt):
                for i in range_constexpr(X_LOADS):
                    lds_store(x_lds, x_slots[i][1], tail_masked(x_regs[i], x_slots[i][2], kt), 16)
                if const_expr(plan.k_major):
                    for i in range_constexpr(W_LOADS):
                        lds_store(w_lds, w_slots[i][1], tail_masked(w_regs[i], w_slots[i][2], kt), 16)
                else:
                    rows = [tail_masked(w_regs[i], w_slots[i][2], kt) for i in range_constexpr(4)]
                    for c in range_constexpr(VEC):  # column nc + c: its 4 K-values, one 8-byte store
                        quad = fx.Vector.from_elements([rows[i][c] for i in range_constexpr(4)], elem)
                        lds_store(w_lds, w_slots[0][1] + c * LDK, quad, 8)

            acc = [fx.make_rmem_tensor(4, fx.Float32) for _ in range_constexpr(NI * MI)]
            zero4 = fx.Vector.filled(4, 0.0, fx.Float32)
            for a in acc:
                fx.memref_store_vec(zero4, a)

            wave_m, wave_n = wave // WN, wave % WN
            frag_k = lane // 16 * 8  # MFMA 16x16x32: lane holds K-values 8*(lane/16) .. +7 of row lane % 16
            w_frag_base = (wave_n * (BN // WN) + lane % 16) * LDK + frag_k
            x_frag_base = (wave_m * (BM // WM) + lane % 16) * LDK + frag_k

            def compute():
                for ks in range_constexpr(BK // MFMA_K):
                    wf = [lds_load8(w_lds, w_frag_base + (ni * 16 * LDK + ks * MFMA_K)) for ni in range_constexpr(NI)]
                    xf = [lds_load8(x_lds, x_frag_base + (mi * 16 * LDK + ks * MFMA_K)) for mi in range_constexpr(MI)]
                    for ni in range_constexpr(NI):
                        for mi in range_constexpr(MI):
                            a = acc[ni * MI + mi]
                            d = mfma(T.vec(4, T.f32), [wf[ni], xf[mi], fx.memref_load_vec(a), 0, 0, 0])
                            fx.memref_store_vec(fx.Vector(d), a)

            load_tile(0)
            for kt in range(KT):
                gpu.barrier()  # everyone is done reading the previous tile
                store_tile(kt)
                gpu.barrier()
                load_tile((kt + 1 < KT).select(kt + 1, kt))  # prefetch (the last one re-reads, harmlessly)
                compute()

            # ---- epilogue: lane holds out[m, n .. n + 3] per MFMA tile ----
            o_atom = fx.make_copy_atom(fx.rocdl.BufferCopy(4 * out_bits), out_bits)
            o_reg = fx.make_rmem_tensor(4, out_ty)
            for mi in range_constexpr(MI):
                m = g_row + wave_m * (BM // WM) + mi * 16 + lane % 16
                for ni in range_constexpr(NI):
                    n = n0 + wave_n * (BN // WN) + ni * 16 + lane // 16 * 4
                    fx.memref_store_vec(fx.memref_load_vec(acc[ni * MI + mi]).to(out_ty), o_reg)
                    if (m < g_end) & (n < N):
                        fx.copy(o_atom, o_reg, fx.slice(o_v, (None, m * N + n)))

    @flyc.jit
    def launch(
        X: fx.Tensor,
        W: fx.Tensor,
        Offs: fx.Tensor,
        Out: fx.Tensor,
        M: fx.Int32,
        stream: fx.Stream = fx.Stream(None),  # noqa: B008 - FlyDSL reads the default from the signature
    ):
        fly_grouped_mm_fwd(X, W, Offs, Out, M).launch(
            grid=((N + BN - 1) // BN, (M + E * (BM - 1)) // BM, 1), block=(BLOCK_THREADS, 1, 1), stream=stream
        )

    return launch


def _example_args(plan: Plan, device: str = "cpu", rows: int = 300) -> tuple:
    """Placeholder arguments with the types/ranks of a real call (CPU = no launch): small flat 1-D tensors.

    Every tensor argument has a dynamic 1-D layout, so the compiled kernel does not depend on their lengths (M is an
    argument; K, N and E are in the plan): small zero-filled placeholders compile the same code as real sizes.
    """
    dt = {v: k for k, v in _OUT_DTYPES.items()}
    x = torch.zeros(rows * VEC, dtype=dt[plan.dtype], device=device)
    w = torch.zeros(plan.E * VEC, dtype=dt[plan.dtype], device=device)
    offs = torch.zeros(plan.E, dtype=torch.int32, device=device)
    out = torch.zeros(rows * VEC, dtype=dt[plan.out_dtype], device=device)
    return (x, w, offs, out, rows)


def _compile_here(plan: dict, export: bool) -> dict[str, Any]:
    """Runs inside compile_check's child process."""
    return _batch.compile_plan_here(
        build_grouped_mm, _example_args, Plan(**plan), export_name=KERNEL_NAME if export else None
    )


def _spec_plan(spec: dict[str, Any]) -> Plan:
    s = {"out_dtype": None, "k_major": True, "tile": "128x128", **spec}
    ok, reason = supports(s["K"], s["N"], s["E"], s["dtype"], s["out_dtype"], s["k_major"])
    if not ok:
        raise ValueError(reason)
    return make_plan(s["K"], s["N"], s["E"], s["dtype"], s["out_dtype"], s["k_major"], s["tile"])


def compile_grouped_mm_many(specs: list[dict[str, Any]], out_dir: str | None = None) -> dict[str, Any]:
    """Compile several specializations in one child process; ``specs`` hold ``compile_grouped_mm``'s arguments
    (``K``, ``N``, ``E``, ``dtype``, optional ``out_dtype``, ``k_major``, ``tile``). Returns ``{"ok", "results"}``,
    one facts dict per spec, in order; an unsupported spec raises ``ValueError``."""
    return _batch.compile_many(__file__, _spec_plan, specs, out_dir)


def compile_grouped_mm(
    K: int,
    N: int,
    E: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype | None = None,
    k_major: bool = True,
    out_dir: str | None = None,
    *,
    tile: str = "128x128",
    export: bool = False,
    all_stages: bool = False,
) -> dict[str, Any]:
    """Compile (never launch) one specialization for gfx950; return facts (as ``compile_rms_norm``).

    Unsupported inputs return ``{"ok": False, "supported": False, "reason": ...}`` without compiling.
    """
    ok, reason = supports(K, N, E, dtype, out_dtype, k_major)
    if not ok:
        return {"ok": False, "supported": False, "reason": reason}
    if tile not in TILES:
        return {"ok": False, "supported": False, "reason": f"tile {tile!r} not in {sorted(TILES)}"}
    plan = make_plan(K, N, E, dtype, out_dtype, k_major, tile)
    return _batch.compile_one(__file__, plan, out_dir=out_dir, export=export, all_stages=all_stages)


def weight_layout(w: torch.Tensor) -> bool | None:
    """True: K-contiguous ``[E, K, N]`` (strides ``(K*N, 1, K)``, the transpose of a contiguous ``[E, N, K]``);
    False: N-contiguous (``(K*N, N, 1)``); None: neither (the kernel reads each expert as one dense block)."""
    e, k, n = w.shape

    def dense(*want: int) -> bool:  # strides of size-1 dims do not matter
        return all(size == 1 or st == ws for size, st, ws in zip(w.shape, w.stride(), want, strict=True))

    if dense(k * n, 1, k):
        return True
    if dense(k * n, n, 1):
        return False
    return None


_LAUNCHERS: dict[tuple, Any] = {}


def launch_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Run on a ROCm gfx950 device: returns ``[M, N]`` (rows past ``offs[-1]`` unwritten). Never called on this host."""
    import flydsl.compiler as flyc

    M, K = x.shape
    E, _, N = w.shape
    k_major = weight_layout(w)
    if k_major is None:
        raise ValueError(f"w strides {tuple(w.stride())}: neither N- nor K-contiguous per expert")
    ok, reason = supports(K, N, E, x.dtype, out_dtype, k_major, M)
    if not ok:
        raise ValueError(reason)
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    out = outputs.empty(M, N, dtype=out_dtype or x.dtype, device=x.device, written_in_full=False)
    if M == 0:
        return out
    offs = offs.contiguous()
    # Flat views of the dense storage: K-contiguous w is the transpose of a contiguous [E, N, K].
    w_flat = (w.transpose(1, 2) if k_major else w).reshape(-1)
    tile = pick_tile(M, E)
    key = (K, N, E, x.dtype, out.dtype, k_major, tile, x.device)
    args = (x.view(-1), w_flat, offs, out.view(-1), M, torch.cuda.current_stream(x.device))
    compiled = _LAUNCHERS.get(key)
    if compiled is None:
        plan = make_plan(K, N, E, x.dtype, out.dtype, k_major, tile)
        # With live device tensors flyc.compile launches once and returns the reusable CompiledFunction.
        _LAUNCHERS[key] = flyc.compile(build_grouped_mm(plan), *args)
    else:
        compiled(*args)
    return out
