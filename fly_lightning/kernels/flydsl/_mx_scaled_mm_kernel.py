"""MX scaled GEMM, dense and grouped, as a FlyDSL kernel for AMD gfx950 (MI350), on the scaled MFMA
``v_mfma_scale_f32_16x16x128_f8f6f4``.

    out[M, N] = dequant(a)[M, K] @ dequant(b)[N, K]^T      dequant(v)[r, k] = v[r, k] * 2**(scale[r, k // 32] - 127)
    grouped (E experts):  out[s_e:end_e] = dequant(a)[s_e:end_e] @ dequant(b[e])^T,   b [E, N, K], end_e = offs[e]

``a`` and ``b`` are MX operands laid out along K (``b`` as an ``nn.Linear`` weight ``[N, K]``): element bytes
``[rows, K]`` for ``mxfp8_e4m3`` / ``mxfp8_e5m2``, packed ``[rows, K / 2]`` for ``mxfp4_e2m1`` (element ``2i`` in the
low nibble), E8M0 scales ``[rows, K / 32]``; formats may differ between ``a`` and ``b`` (the instruction takes one
format per operand). fp32 accumulation, output bf16, fp16 or fp32. ``K % 128 == 0``: one MFMA K step is 128 values
(4 scale blocks), so a row's 4 scales per K step are one aligned dword.

The hardware applies the scales, so no dequantisation runs in the kernel. Register layout of one 16x16x128 step
(the f8f6f4 operand layout FlyDSL's own gfx950 MX kernels use; ``j = lane // 16``): lane ``l`` holds row ``l % 16``;
fp4: K-values ``32j .. 32j+31`` (16 bytes); fp8: K-values ``16j .. 16j+15`` and ``64+16j .. 64+16j+15`` (two 16-byte
runs, 32 bytes). The scale operand of lane ``l`` is the E8M0 byte of row ``l % 16``, block ``j`` of the step (the
low byte: ``opsel`` 0), whichever lanes hold that block's values.

Tile. ``BM x BN`` output per 256-thread workgroup (4 waves as ``WM x WN``). An LDS stage holds 128 bytes of each
row: one MFMA K step (128 values) for fp8, two for fp4 x fp4 when ``K % 256 == 0`` (else one, 64 bytes). As in the
grouped GEMM, the MFMA's A operand is the weight (16 output columns) and its B operand ``a`` (16 rows): each lane's
accumulator holds 4 consecutive columns of one row, one 8-byte (16-byte for fp32) store. Data moves as dwords:
16-byte ``buffer_load_dwordx4`` into VGPRs, ``ds_write_b128`` into K-contiguous LDS rows (16-byte padding), and
``ds_read_b128`` back (two per fp8 fragment, one per fp4 fragment). Scales: each thread loads the scale dword(s)
(4 blocks per K step) of ``a`` row ``tid % BM`` and ``b`` row ``tid % BN`` per stage (duplicates land in spare LDS
slots, which keeps the code free of predicates), writes them with ``ds_write_b32`` / ``_b64``, and each lane reads
its byte per fragment with ``ds_read_u8``. One LDS stage with register prefetch, two barriers per stage, a runtime
K loop (LLVM unrolls it when there are only a few stages).

Grouped (``Plan.E > 0``, the MoE experts' ``mx_grouped_mm``). The same tile and K loop; each workgroup's expert
and rows come from the int32 end offsets on the device (``_group_tiles``, as the bf16 grouped GEMM: grid rows
``(M + E * (BM - 1)) / BM``), its ``b`` rows start at ``expert * N``, rows of the tile past the group's end read the
next group's rows and are not stored, and workgroups past the last tile run no K step and store nothing. Rows at and
past ``offs[E - 1]`` are left unwritten, as ``torch._grouped_mm`` leaves them.

Bounds. Buffer descriptors sized to each tensor: rows past M or N read zeros (data and scales; grouped, the next
group's or expert's rows) and are not stored.
Offsets are 32-bit: each tensor under 2 GiB.

Only compiled here (no AMD GPU): ``compile_mx_scaled_mm`` runs in a subprocess.
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

KERNEL_NAME = "fly_mx_scaled_mm_fwd"
BLOCK_THREADS = 256
WAVE = 64
BK = 128  # K values per scaled MFMA step (16x16x128), 4 scale blocks: the unit of K
STAGE_BYTES = 128  # at most this many bytes of a row per LDS stage: one fp8 K step, or two fp4 K steps
LDS_PAD = 16  # bytes of padding per LDS row
MAX_BYTES = 2**31 - 1  # 32-bit buffer offsets
MAX_GROUPS = 1024  # the device tile search reads ceil(E / 64) <= 16 offsets per lane, unrolled

# format name -> (bits per element, the MFMA's cbsz/blgp format code: 0 fp8 e4m3, 1 bf8 e5m2, 4 fp4 e2m1)
FORMATS = {"mxfp8_e4m3": (8, 0), "mxfp8_e5m2": (8, 1), "mxfp4_e2m1": (4, 4)}
_OUT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
# (BM, BN, waves along M, waves along N)
TILES = {"128x128": (128, 128, 2, 2), "64x128": (64, 128, 1, 4)}
MFMA = "v_mfma_scale_f32_16x16x128_f8f6f4"


def constraints() -> dict[str, Any]:
    """What the kernel accepts, as plain data for the dispatcher's messages."""
    return {
        "arch": compile_check.TARGET_ARCH,
        "formats": sorted(FORMATS),
        "scales": "float8_e8m0fnu [rows, K / 32], contiguous",
        "a_layout": "[M, K * bits / 8] contiguous (fp4: two per byte along K, low nibble first)",
        "b_layout": "[N, K * bits / 8] contiguous (nn.Linear weight layout)",
        "K": f"multiple of {BK}",
        "N": "multiple of 4 (4-column stores)",
        "out_dtypes": [str(d) for d in _OUT_DTYPES],
        "bytes_max": f"every tensor under 2**31 bytes ({MAX_BYTES})",
        "tiles": {k: f"BM={v[0]} BN={v[1]}, waves {v[2]}x{v[3]}" for k, v in TILES.items()},
        "stage": f"{STAGE_BYTES} bytes of each row per LDS stage: K {BK} (any fp8 operand) or {2 * BK} (fp4 x fp4)",
        "mfma": f"{MFMA}, E8M0 scales applied by the instruction, fp32 accumulators",
    }


def supports(
    M: int, N: int, K: int, a_fmt: str | None, b_fmt: str, out_dtype: torch.dtype, E: int = 0
) -> tuple[bool, str]:
    """(ok, reason). ``reason`` names the first unmet constraint; ``E``: experts of a grouped call (0: dense)."""
    if E and not 1 <= E <= MAX_GROUPS:
        return False, f"E={E} outside [1, {MAX_GROUPS}] (the device tile search)"
    if a_fmt is None:
        return False, "a is high precision (weight-only MX): the scaled MFMA needs both operands in MX formats"
    for name, fmt in (("a", a_fmt), ("b", b_fmt)):
        if fmt not in FORMATS:
            return False, f"{name} format {fmt} (kernel takes {', '.join(sorted(FORMATS))})"
    if out_dtype not in _OUT_DTYPES:
        return False, f"out_dtype {out_dtype} (kernel writes bfloat16/float16/float32)"
    if K < BK or K % BK:
        return False, f"K={K} not a positive multiple of {BK} (one 16x16x128 scaled MFMA step)"
    if N < 1 or N % 4:
        return False, f"N={N} not a positive multiple of 4 (4-column stores)"
    out_bytes = 4 if out_dtype == torch.float32 else 2
    a_bits, b_bits = FORMATS[a_fmt][0], FORMATS[b_fmt][0]
    b_bytes = max(E, 1) * N * K * b_bits // 8
    for name, nbytes in (("a", M * K * a_bits // 8), ("b", b_bytes), ("out", M * N * out_bytes)):
        if nbytes > MAX_BYTES:
            return False, f"{name} is {nbytes} bytes (32-bit buffer offsets: at most {MAX_BYTES})"
    return True, "ok"


@dataclass(frozen=True)
class Plan:
    """Compile-time shape of one specialization (M is runtime)."""

    N: int
    K: int
    a_fmt: str
    b_fmt: str
    out_dtype: str
    tile: str  # key of TILES
    bm: int
    bn: int
    waves_m: int
    waves_n: int
    k_steps: int  # 16x16x128 MFMA steps per LDS stage: 2 when both operands are fp4 and K % 256 == 0, else 1
    k_tiles: int  # LDS stages along K
    a_row_bytes: int  # bytes of one row per LDS stage: 128 (fp8, or fp4 with 2 steps) or 64
    b_row_bytes: int
    lds_bytes: int
    E: int = 0  # experts of the grouped form (b [E, N, K], offsets); 0: dense


def make_plan(
    N: int, K: int, a_fmt: str, b_fmt: str, out_dtype: torch.dtype, tile: str = "128x128", E: int = 0
) -> Plan:
    bm, bn, wm, wn = TILES[tile]
    step_bytes = max(BK * FORMATS[f][0] // 8 for f in (a_fmt, b_fmt))
    ks = STAGE_BYTES // step_bytes if K % (BK * STAGE_BYTES // step_bytes) == 0 else 1
    arb, brb = ks * BK * FORMATS[a_fmt][0] // 8, ks * BK * FORMATS[b_fmt][0] // 8
    return Plan(
        N=N,
        K=K,
        a_fmt=a_fmt,
        b_fmt=b_fmt,
        out_dtype=_OUT_DTYPES[out_dtype],
        tile=tile,
        bm=bm,
        bn=bn,
        waves_m=wm,
        waves_n=wn,
        k_steps=ks,
        k_tiles=K // (BK * ks),
        a_row_bytes=arb,
        b_row_bytes=brb,
        # data tiles plus one scale dword per K step and thread for each operand
        lds_bytes=bm * (arb + LDS_PAD) + bn * (brb + LDS_PAD) + 2 * 4 * ks * BLOCK_THREADS,
        E=E,
    )


def pick_tile(M: int, E: int = 0) -> str:
    """64-row tiles for short inputs (decode, small batches; grouped: groups averaging under 128 rows), else 128."""
    return "64x128" if (M < 128 * E if E else M <= 64) else "128x128"


def build_mx_scaled_mm(plan: Plan):
    """Return the ``@flyc.jit`` launcher for ``plan`` (imports FlyDSL lazily)."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl._mlir.dialects import llvm
    from flydsl.expr import gpu, range_constexpr, rocdl
    from flydsl.expr.typing import T

    out_ty = {"bf16": fx.BFloat16, "f16": fx.Float16, "f32": fx.Float32}[plan.out_dtype]
    out_bits = 32 if plan.out_dtype == "f32" else 16
    a_code, b_code = FORMATS[plan.a_fmt][1], FORMATS[plan.b_fmt][1]
    N, K, E = plan.N, plan.K, plan.E
    BM, BN, WM, WN = plan.bm, plan.bn, plan.waves_m, plan.waves_n
    MI = BM // WM // 16  # 16-row MFMA tiles per wave (a side)
    NI = BN // WN // 16  # 16-column MFMA tiles per wave (b side)
    KT, KS = plan.k_tiles, plan.k_steps
    ARB, BRB = plan.a_row_bytes, plan.b_row_bytes
    A_STEP, B_STEP = ARB // KS, BRB // KS  # bytes of one row per MFMA K step: 128 (fp8) or 64 (fp4)
    A_LD, B_LD = ARB + LDS_PAD, BRB + LDS_PAD  # LDS row pitch in bytes
    A_CPR, B_CPR = ARB // 16, BRB // 16  # 16-byte chunks per row and stage
    A_LOADS, B_LOADS = BM * A_CPR // BLOCK_THREADS, BN * B_CPR // BLOCK_THREADS
    A_FRAG, B_FRAG = A_STEP // 64, B_STEP // 64  # 16-byte LDS reads per lane and fragment: 32 values of 8 or 4 bits
    A_ROW_DW, B_ROW_DW = K * A_STEP // BK // 4, K * B_STEP // BK // 4  # dwords per row of a / b
    SC_ROW_DW = K // BK  # scale dwords per row: 4 E8M0 bytes per K step
    assert A_LOADS >= 1 and B_LOADS >= 1 and BLOCK_THREADS % A_CPR == 0 and BLOCK_THREADS % B_CPR == 0

    @fx.struct
    class Tiles:
        b: fx.Array[fx.Int32, BN * B_LD // 4, 16]
        a: fx.Array[fx.Int32, BM * A_LD // 4, 16]
        b_scale: fx.Array[fx.Int32, BLOCK_THREADS * KS, 16]
        a_scale: fx.Array[fx.Int32, BLOCK_THREADS * KS, 16]

    def lds_store(base, byte_off, value, nbytes):
        ptr = (fx.recast_iter(fx.Uint8, base) + fx.Int32(byte_off)).llvm_ptr
        llvm.StoreOp(value.ir_value() if hasattr(value, "ir_value") else value, ptr, alignment=nbytes)

    def lds_load(base, byte_off, n_dwords):
        vec = fx.Vector.make_type(n_dwords, fx.Int32)  # made here: MLIR types need the kernel's context
        return fx.ptr_load(fx.recast_iter(fx.Uint8, base) + fx.Int32(byte_off), result_type=vec)

    def lds_load_byte(base, byte_off):
        # zero-extended (``ds_read_u8``): the MFMA reads only the low byte, but the value stays the E8M0 byte
        return fx.ptr_load(fx.recast_iter(fx.Uint8, base) + fx.Int32(byte_off), result_type=fx.Uint8).to(fx.Int32)

    def fragment(base, byte_off, n16):
        """The 32 values (8 or 4 dwords) of one MFMA operand lane, read as ``n16`` 16-byte LDS loads: fp4 one run of
        16 bytes, fp8 two runs of 16 bytes 64 K-values apart (the f8f6f4 register layout)."""
        parts = [lds_load(base, byte_off + 64 * i, 4) for i in range_constexpr(n16)]
        if n16 == 1:
            return parts[0]
        return parts[0].shuffle(parts[1], list(range(8)))

    def tile_origin(offs, M, lane):
        """(first row of a, end of its rows, first row of b, K stages to run) of this workgroup's tile."""
        n0 = fx.block_idx.x * BN
        if E == 0:
            return fx.block_idx.y * BM, M, n0, KT
        g_e, g_row, g_end = _group_tiles.find_group_tile(offs, M, E, BM, lane, fx.block_idx.y)
        return g_row, g_end, g_e * N + n0, (g_row >= 0).select(fx.Int32(KT), fx.Int32(0))

    @flyc.kernel(known_block_size=[BLOCK_THREADS, 1, 1])
    def fly_mx_scaled_mm_fwd(
        A: fx.Tensor,
        A_scale: fx.Tensor,
        B: fx.Tensor,
        B_scale: fx.Tensor,
        Offs: fx.Tensor,
        Out: fx.Tensor,
        M: fx.Int32,
    ):
        tid = fx.thread_idx.x
        lane = tid % WAVE
        wave = tid // WAVE
        n0 = fx.block_idx.x * BN
        m0, m_end, b0, k_tiles = tile_origin(Offs, M, lane)

        smem = fx.SharedAllocator().allocate(Tiles).peek()
        b_lds, a_lds = smem.b.ptr, smem.a.ptr
        bs_lds, as_lds = smem.b_scale.ptr, smem.a_scale.ptr

        def dwords(t):
            return fx.logical_divide(fx.rocdl.make_buffer_tensor(t, max_size=False), fx.make_layout(1, 1))

        a_v, as_v, b_v, bs_v, o_v = dwords(A), dwords(A_scale), dwords(B), dwords(B_scale), dwords(Out)
        g_atom = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), 32)
        s_atom = fx.make_copy_atom(fx.rocdl.BufferCopy(32 * KS), 32)

        # Per-thread load slots (loop invariant): (global dword offset at K step 0, LDS byte offset).
        a_slots = []
        for i in range_constexpr(A_LOADS):
            v = tid + i * BLOCK_THREADS
            row, c = v // A_CPR, v % A_CPR
            a_slots.append(((m0 + row) * A_ROW_DW + c * 4, row * A_LD + c * 16))
        b_slots = []
        for i in range_constexpr(B_LOADS):
            v = tid + i * BLOCK_THREADS
            row, c = v // B_CPR, v % B_CPR
            b_slots.append(((b0 + row) * B_ROW_DW + c * 4, row * B_LD + c * 16))
        # Scales: KS dwords (4 blocks per K step) of row tid % BM / tid % BN; LDS slot tid.
        as_off = (m0 + tid % BM) * SC_ROW_DW
        bs_off = (b0 + tid % BN) * SC_ROW_DW

        a_regs = [fx.make_rmem_tensor(4, fx.Int32) for _ in range_constexpr(A_LOADS)]
        b_regs = [fx.make_rmem_tensor(4, fx.Int32) for _ in range_constexpr(B_LOADS)]
        as_reg = fx.make_rmem_tensor(KS, fx.Int32)
        bs_reg = fx.make_rmem_tensor(KS, fx.Int32)

        def load_tile(kt):
            for i in range_constexpr(A_LOADS):
                fx.copy(g_atom, fx.slice(a_v, (None, a_slots[i][0] + kt * (ARB // 4))), a_regs[i])
            for i in range_constexpr(B_LOADS):
                fx.copy(g_atom, fx.slice(b_v, (None, b_slots[i][0] + kt * (BRB // 4))), b_regs[i])
            fx.copy(s_atom, fx.slice(as_v, (None, as_off + kt * KS)), as_reg)
            fx.copy(s_atom, fx.slice(bs_v, (None, bs_off + kt * KS)), bs_reg)

        def store_tile():
            for i in range_constexpr(A_LOADS):
                lds_store(a_lds, a_slots[i][1], fx.memref_load_vec(a_regs[i]), 16)
            for i in range_constexpr(B_LOADS):
                lds_store(b_lds, b_slots[i][1], fx.memref_load_vec(b_regs[i]), 16)
            for reg, base in ((as_reg, as_lds), (bs_reg, bs_lds)):
                v = fx.memref_load_vec(reg)
                lds_store(base, tid * (4 * KS), v[0] if KS == 1 else v, 4 * KS)

        acc = [fx.make_rmem_tensor(4, fx.Float32) for _ in range_constexpr(NI * MI)]
        zero4 = fx.Vector.filled(4, 0.0, fx.Float32)
        for c in acc:
            fx.memref_store_vec(zero4, c)

        wave_m, wave_n = wave // WN, wave % WN
        blk = lane // 16  # the lane's MX block within the K step: its K-values 32*blk .. +31
        b_row = wave_n * (BN // WN) + lane % 16
        a_row = wave_m * (BM // WM) + lane % 16

        def compute():
            for s in range_constexpr(KS):
                b_off, a_off = s * B_STEP + blk * 16, s * A_STEP + blk * 16
                bf = [fragment(b_lds, (b_row + ni * 16) * B_LD + b_off, B_FRAG) for ni in range_constexpr(NI)]
                af = [fragment(a_lds, (a_row + mi * 16) * A_LD + a_off, A_FRAG) for mi in range_constexpr(MI)]
                bsc = [lds_load_byte(bs_lds, (b_row + ni * 16) * 4 * KS + s * 4 + blk) for ni in range_constexpr(NI)]
                asc = [lds_load_byte(as_lds, (a_row + mi * 16) * 4 * KS + s * 4 + blk) for mi in range_constexpr(MI)]
                for ni in range_constexpr(NI):
                    for mi in range_constexpr(MI):
                        c = acc[ni * MI + mi]
                        d = rocdl.mfma_scale_f32_16x16x128_f8f6f4(
                            T.vec(4, T.f32),
                            [bf[ni], af[mi], fx.memref_load_vec(c), b_code, a_code, 0, bsc[ni], 0, asc[mi]],
                        )
                        fx.memref_store_vec(fx.Vector(d), c)

        load_tile(0)
        for kt in range(k_tiles):
            gpu.barrier()  # everyone is done reading the previous K step
            store_tile()
            gpu.barrier()
            load_tile((kt + 1 < k_tiles).select(kt + 1, kt))  # prefetch (the last one re-reads, harmlessly)
            compute()

        # ---- epilogue: lane holds out[m, n .. n + 3] per MFMA tile ----
        o_atom = fx.make_copy_atom(fx.rocdl.BufferCopy(4 * out_bits), out_bits)
        o_reg = fx.make_rmem_tensor(4, out_ty)
        for mi in range_constexpr(MI):
            m = m0 + a_row + mi * 16
            for ni in range_constexpr(NI):
                n = n0 + wave_n * (BN // WN) + ni * 16 + blk * 4
                fx.memref_store_vec(fx.memref_load_vec(acc[ni * MI + mi]).to(out_ty), o_reg)
                if (m < m_end) & (n < N):
                    fx.copy(o_atom, o_reg, fx.slice(o_v, (None, m * N + n)))

    ROW_PAD = E * (BM - 1) if E else BM - 1  # grid rows (M + ROW_PAD) // BM: every group's tiles (an upper bound)

    @flyc.jit
    def launch(
        A: fx.Tensor,
        A_scale: fx.Tensor,
        B: fx.Tensor,
        B_scale: fx.Tensor,
        Offs: fx.Tensor,
        Out: fx.Tensor,
        M: fx.Int32,
        stream: fx.Stream = fx.Stream(None),  # noqa: B008 - FlyDSL reads the default from the signature
    ):
        fly_mx_scaled_mm_fwd(A, A_scale, B, B_scale, Offs, Out, M).launch(
            grid=((N + BN - 1) // BN, (M + ROW_PAD) // BM, 1), block=(BLOCK_THREADS, 1, 1), stream=stream
        )

    return launch


def _example_args(plan: Plan, device: str = "cpu", rows: int = 300) -> tuple:
    """Placeholder arguments with the types/ranks of a real call (CPU = no launch): small flat int32 tensors.

    Every tensor argument is a flat dword view with a dynamic layout, so the compiled kernel does not depend on their
    lengths (M is an argument, N and K are in the plan): small zero-filled placeholders compile the same code.
    """
    dt = {v: k for k, v in _OUT_DTYPES.items()}
    z = torch.zeros
    return (
        z(rows * 4, dtype=torch.int32, device=device),
        z(rows, dtype=torch.int32, device=device),
        z(rows * 4, dtype=torch.int32, device=device),
        z(rows, dtype=torch.int32, device=device),
        z(max(plan.E, 1), dtype=torch.int32, device=device),
        z(rows * 4, dtype=dt[plan.out_dtype], device=device),
        rows,
    )


def _compile_here(plan: dict, export: bool) -> dict[str, Any]:
    """Runs inside compile_check's child process."""
    return _batch.compile_plan_here(
        build_mx_scaled_mm, _example_args, Plan(**plan), export_name=KERNEL_NAME if export else None
    )


def _spec_plan(spec: dict[str, Any]) -> Plan:
    s = {"out_dtype": torch.bfloat16, "M": 0, "E": 0, **spec}
    ok, reason = supports(s["M"], s["N"], s["K"], s["a_fmt"], s["b_fmt"], s["out_dtype"], s["E"])
    if not ok:
        raise ValueError(reason)
    tile = s.get("tile") or pick_tile(s["M"] or 128 * max(s["E"], 1), s["E"])
    if tile not in TILES:
        raise ValueError(f"tile {tile!r} not in {sorted(TILES)}")
    return make_plan(s["N"], s["K"], s["a_fmt"], s["b_fmt"], s["out_dtype"], tile, s["E"])


def compile_mx_scaled_mm_many(specs: list[dict[str, Any]], out_dir: str | None = None) -> dict[str, Any]:
    """Compile several specializations in one child process; ``specs`` hold ``N``, ``K``, ``a_fmt``, ``b_fmt`` and
    optionally ``out_dtype``, ``M``, ``tile`` and ``E`` (experts: the grouped form). Returns ``{"ok", "results"}``,
    one facts dict per spec, in order; an unsupported spec raises ``ValueError``."""
    return _batch.compile_many(__file__, _spec_plan, specs, out_dir)


def compile_mx_scaled_mm(
    N: int,
    K: int,
    a_fmt: str | None,
    b_fmt: str,
    out_dtype: torch.dtype = torch.bfloat16,
    out_dir: str | None = None,
    *,
    tile: str = "128x128",
    export: bool = False,
    all_stages: bool = False,
) -> dict[str, Any]:
    """Compile (never launch) one specialization for gfx950; return facts (as ``compile_grouped_mm``).

    Unsupported inputs return ``{"ok": False, "supported": False, "reason": ...}`` without compiling.
    """
    try:
        plan = _spec_plan({"N": N, "K": K, "a_fmt": a_fmt, "b_fmt": b_fmt, "out_dtype": out_dtype, "tile": tile})
    except ValueError as exc:
        return {"ok": False, "supported": False, "reason": str(exc)}
    return _batch.compile_one(__file__, plan, out_dir=out_dir, export=export, all_stages=all_stages)


def _dwords(t: torch.Tensor) -> torch.Tensor:
    """The flat int32 view of a contiguous byte tensor (fp8 data, packed fp4, E8M0 scales)."""
    return t.view(torch.uint8).reshape(-1).view(torch.int32)


_LAUNCHERS: dict[tuple, Any] = {}


def launch_mx_scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_fmt: str,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_fmt: str,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Run on a ROCm gfx950 device: returns ``[M, N]``. Never called on this host (only traced with CPU tensors)."""
    M, N = a.shape[0], b.shape[0]
    K = b.shape[1] * 8 // FORMATS[b_fmt][0] if b_fmt in FORMATS else 0
    ok, reason = supports(M, N, K, a_fmt, b_fmt, out_dtype)
    if not ok:
        raise ValueError(reason)
    for name, t in (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    out = outputs.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0:
        return out
    a_s = _dwords(a_scale)  # also the offsets argument, which the dense kernel never reads
    _launch(M, N, K, a_fmt, b_fmt, out, 0, (_dwords(a), a_s, _dwords(b), _dwords(b_scale)), a_s)
    return out


def _launch(M, N, K, a_fmt, b_fmt, out, E, operands, offs) -> None:
    import flydsl.compiler as flyc

    tile = pick_tile(M, E)
    key = (N, K, a_fmt, b_fmt, out.dtype, tile, E, out.device)
    args = (*operands, offs, out.view(-1), M, torch.cuda.current_stream(out.device))
    compiled = _LAUNCHERS.get(key)
    if compiled is None:
        plan = make_plan(N, K, a_fmt, b_fmt, out.dtype, tile, E)
        # With live device tensors flyc.compile launches once and returns the reusable CompiledFunction.
        _LAUNCHERS[key] = flyc.compile(build_mx_scaled_mm(plan), *args)
    else:
        compiled(*args)


def launch_mx_grouped_mm(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    x_fmt: str,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    w_fmt: str,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Run on a ROCm gfx950 device: ``[M, N]``, rows past ``offs[-1]`` unwritten (``x`` ``[M, K]`` MX, ``w``
    ``[E, N, K]`` MX, int32 end offsets ``[E]``). Never called on this host (only traced with CPU tensors)."""
    M, (E, N) = x.shape[0], w.shape[:2]
    K = w.shape[2] * 8 // FORMATS[w_fmt][0] if w_fmt in FORMATS else 0
    ok, reason = supports(M, N, K, x_fmt, w_fmt, out_dtype, E)
    if not ok:
        raise ValueError(reason)
    for name, t in (("x", x), ("x_scale", x_scale), ("w", w), ("w_scale", w_scale), ("offs", offs)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    out = outputs.empty(M, N, dtype=out_dtype, device=x.device, written_in_full=False)
    if M == 0:
        return out
    _launch(M, N, K, x_fmt, w_fmt, out, E, (_dwords(x), _dwords(x_scale), _dwords(w), _dwords(w_scale)), offs)
    return out
