"""RMSNorm forward as a FlyDSL kernel for AMD gfx950 (MI350).

    rstd[r] = 1 / sqrt(mean_j(x[r, j]^2) + eps)            (fp32 accumulation)
    y[r, j] = (x[r, j] * rstd[r] * (w[j] + offset)).to(x.dtype)

``offset`` is Gemma's "1 + w" (0.0 by default). Without a weight,
``y = x * rstd`` and ``offset`` is not used (same as ``F.rms_norm(x, shape)``).

Mapping: a *row group* of P lanes owns one row; the 256-thread workgroup holds
256 / P rows. P is a power of two up to 64 for short rows (reduction by wave
shuffles only) or 256 for long rows (4 waves, partial sums through 16 B of
LDS). Each lane handles chunks ``lane + i*P`` of VEC elements: VEC = 16 bytes
(one buffer_load_dwordx4) on the vector path, 1 on the generic path that
serves any H / stride / alignment. Every row gets its own buffer descriptor
sized to H elements, so the hardware bounds check zero-fills loads past the
row end and drops such stores: ragged chunks need no masking code, and row
offsets stay 64-bit (no 4 GiB limit on the whole tensor).

Short rows keep x in registers between the two passes; long rows (more than
64 elements per lane) re-read x in pass 2 (mostly L2 hits) using a runtime
loop so compile time stays flat.

Only compiled here (no AMD GPU): ``compile_rms_norm`` runs in a subprocess.
"""

from dataclasses import asdict, dataclass
from typing import Any

import torch

try:  # inside the package
    from .. import outputs
    from . import _toolchain as compile_check
except ImportError:  # loaded by file path in the compile child (keeps the child free of fly_lightning imports)
    import _toolchain as compile_check

    outputs = compile_check.outputs_module()

KERNEL_NAME = "fly_rms_norm_fwd"
BLOCK_THREADS = 256
WAVE = 64  # gfx950 runs wave64
MAX_H = 1 << 20  # a stated gate: tested up to here; buffer offsets allow ~2**30 bytes/row
# Up to this many elements per lane, loops are unrolled and x stays in VGPRs
# between the passes; above it, runtime loops and pass 2 re-reads x.
CACHE_ELEMS_PER_LANE = 64

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_BITS = {"bf16": 16, "f16": 16, "f32": 32}


def constraints() -> dict[str, Any]:
    """What the kernel accepts, as plain data for the dispatcher's messages."""
    return {
        "arch": compile_check.TARGET_ARCH,
        "x_dtypes": [str(d) for d in _DTYPES],
        "weight_dtypes": "same as x, or torch.float32",
        "weight": "optional, 1-D [H], contiguous",
        "H_min": 1,
        "H_max": MAX_H,
        "x_layout": "2-D [rows, H] with stride(1) == 1; any row stride",
        "rows_max": 2**31 - 1,
        "vector_path": "H % (16 // itemsize) == 0, row stride likewise, x/w/y 16-byte aligned",
        "generic_path": "anything else within the limits above (scalar, still coalesced)",
        "outputs": "y like x (contiguous), rstd float32 [rows]",
    }


def supports(
    H: int,
    dtype: torch.dtype,
    has_weight: bool = True,
    weight_dtype: torch.dtype | None = None,
    x_stride: tuple[int, ...] | None = None,
) -> tuple[bool, str]:
    """(ok, reason). ``reason`` names the first unmet constraint."""
    if dtype not in _DTYPES:
        return False, f"x dtype {dtype} not in {list(_DTYPES)}"
    if not 1 <= H <= MAX_H:
        return False, f"H={H} outside [1, {MAX_H}]"
    if has_weight and weight_dtype is not None and weight_dtype not in (dtype, torch.float32):
        return False, f"weight dtype {weight_dtype} must equal x dtype {dtype} or be float32"
    if x_stride is not None and (len(x_stride) != 2 or x_stride[1] != 1):
        return False, f"x must be 2-D with unit last stride, got stride {x_stride}"
    return True, "ok"


@dataclass(frozen=True)
class Plan:
    """Compile-time shape of one specialization."""

    H: int
    dtype: str
    weight_dtype: str | None  # None: no weight
    vec: int  # elements per chunk
    lanes_per_row: int  # P
    rows_per_block: int
    chunks_per_lane: int
    unrolled: bool  # also: x is kept in registers for pass 2


def make_plan(H: int, dtype: torch.dtype, weight_dtype: torch.dtype | None, vectorized: bool) -> Plan:
    dt = _DTYPES[dtype]
    vec = 128 // _BITS[dt] if vectorized else 1
    if vectorized and H % vec:
        raise ValueError(f"vector path needs H % {vec} == 0, got H={H}")
    chunks = -(-H // vec)
    if chunks <= 4 * WAVE:  # short row: one (sub-)wave, no LDS, several rows per block
        lanes = min(WAVE, 1 << (chunks - 1).bit_length())
    else:
        lanes = BLOCK_THREADS
    cpl = -(-chunks // lanes)
    return Plan(
        H=H,
        dtype=dt,
        weight_dtype=None if weight_dtype is None else _DTYPES[weight_dtype],
        vec=vec,
        lanes_per_row=lanes,
        rows_per_block=BLOCK_THREADS // lanes,
        chunks_per_lane=cpl,
        unrolled=cpl * vec <= CACHE_ELEMS_PER_LANE,
    )


def build_rms_norm(plan: Plan):
    """Return the ``@flyc.jit`` launcher for ``plan`` (imports FlyDSL lazily)."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl.expr import const_expr, gpu, range_constexpr
    from flydsl.expr import math as fmath

    elem = {"bf16": fx.BFloat16, "f16": fx.Float16, "f32": fx.Float32}
    x_ty = elem[plan.dtype]
    w_ty = elem[plan.weight_dtype] if plan.weight_dtype else None
    H, VEC, P, R = plan.H, plan.vec, plan.lanes_per_row, plan.rows_per_block
    CPL, WAVES = plan.chunks_per_lane, max(1, P // WAVE)
    x_bits = _BITS[plan.dtype]

    def chunk_view(tensor_1d, nelem):
        # [nelem, n_chunks] view: column c is elements c*nelem .. c*nelem+nelem-1
        return fx.logical_divide(tensor_1d, fx.make_layout(nelem, 1))

    def load_chunk(view, idx, ty, bits):
        # One buffer load of VEC elements (two if wider than 128 bits: fp32 weight, bf16 x).
        if const_expr(VEC * bits <= 128):
            r = fx.make_rmem_tensor(VEC, ty)
            fx.copy(fx.make_copy_atom(fx.rocdl.BufferCopy(VEC * bits), bits), fx.slice(view, (None, idx)), r)
            return fx.memref_load_vec(r)
        half = VEC // 2
        atom = fx.make_copy_atom(fx.rocdl.BufferCopy(128), bits)
        lo = fx.make_rmem_tensor(half, ty)
        hi = fx.make_rmem_tensor(half, ty)
        fx.copy(atom, fx.slice(view, (None, idx * 2)), lo)
        fx.copy(atom, fx.slice(view, (None, idx * 2 + 1)), hi)
        return fx.memref_load_vec(lo).shuffle(fx.memref_load_vec(hi), list(range(VEC)))

    @fx.struct
    class Partials:
        s: fx.Array[fx.Float32, WAVES, 16]

    @flyc.kernel(known_block_size=[BLOCK_THREADS, 1, 1])
    def fly_rms_norm_fwd(
        X: fx.Tensor,
        W: fx.Tensor,
        Y: fx.Tensor,
        Rstd: fx.Tensor,
        n_rows: fx.Int32,
        eps: fx.Float32,
        offset: fx.Float32,
    ):
        tid = fx.thread_idx.x
        lane = tid % P
        row = fx.block_idx.x * R + tid // P
        row_ok = row < n_rows
        row_c = row_ok.select(row, 0)  # tail rows compute on row 0 but never store

        # Per-row descriptors sized to H: OOB loads read 0, OOB stores vanish.
        x_row = fx.rocdl.make_buffer_tensor(fx.slice(X, (row_c, None)), max_size=False)
        y_row = fx.rocdl.make_buffer_tensor(fx.slice(Y, (row_c, None)), max_size=False)
        xv = chunk_view(x_row, VEC)
        yv = chunk_view(y_row, VEC)
        x_atom = fx.make_copy_atom(fx.rocdl.BufferCopy(VEC * x_bits), x_bits)
        if const_expr(w_ty is not None):
            w_bits = _BITS[plan.weight_dtype]
            w_buf = fx.rocdl.make_buffer_tensor(W, max_size=False)
            wv = chunk_view(w_buf, VEC if VEC * w_bits <= 128 else VEC // 2)

        # Pass 1: sum of squares in fp32.
        cached = []
        acc = fx.Float32(0.0)
        if const_expr(plan.unrolled):
            for i in range_constexpr(CPL):
                v = load_chunk(xv, lane + i * P, x_ty, x_bits)
                cached.append(v)
                f = v.to(fx.Float32)
                acc = acc + (f * f).reduce(fx.ReductionOp.ADD)
        else:
            for i in range(CPL):
                f = load_chunk(xv, lane + i * P, x_ty, x_bits).to(fx.Float32)
                acc = acc + (f * f).reduce(fx.ReductionOp.ADD)

        # Row-group reduction: butterfly inside the wave (xor < P stays in the group) ...
        for s in range_constexpr(6):
            if const_expr((1 << s) < min(P, WAVE)):
                acc = acc + acc.shuffle_xor(1 << s, WAVE)
        # ... then across the waves of a 256-lane row through LDS.
        if const_expr(WAVES > 1):
            part = fx.SharedAllocator().allocate(Partials).peek().s.view(fx.make_layout(WAVES, 1))
            if tid % WAVE == 0:
                fx.memref_store(acc, part, tid // WAVE)
            gpu.barrier()
            acc = fx.memref_load(part, 0)
            for wv_i in range_constexpr(1, WAVES):
                acc = acc + fx.memref_load(part, wv_i)

        rstd = fmath.rsqrt(acc / float(H) + eps)

        # Pass 2: scale, convert, store.
        def finish(i, xval):
            y = xval.to(fx.Float32) * rstd
            if const_expr(w_ty is not None):
                y = y * (load_chunk(wv, lane + i * P, w_ty, w_bits).to(fx.Float32) + offset)
            out = fx.make_rmem_tensor(VEC, x_ty)
            fx.memref_store_vec(y.to(x_ty), out)
            if row_ok:
                fx.copy(x_atom, out, fx.slice(yv, (None, lane + i * P)))

        if const_expr(plan.unrolled):
            for i in range_constexpr(CPL):
                finish(i, cached[i])
        else:
            for i in range(CPL):
                finish(i, load_chunk(xv, lane + i * P, x_ty, x_bits))

        if row_ok & (lane == 0):
            r_buf = fx.rocdl.make_buffer_tensor(Rstd, max_size=False)
            r_out = fx.make_rmem_tensor(1, fx.Float32)
            fx.memref_store_vec(fx.Vector.filled(1, rstd, fx.Float32), r_out)
            fx.copy(fx.make_copy_atom(fx.rocdl.BufferCopy32b(), 32), r_out, fx.slice(chunk_view(r_buf, 1), (None, row)))

    @flyc.jit
    def launch(
        X: fx.Tensor,
        W: fx.Tensor,
        Y: fx.Tensor,
        Rstd: fx.Tensor,
        n_rows: fx.Int32,
        eps: fx.Float32,
        offset: fx.Float32,
        stream: fx.Stream = fx.Stream(None),  # noqa: B008 - FlyDSL reads the default from the signature
    ):
        fly_rms_norm_fwd(X, W, Y, Rstd, n_rows, eps, offset).launch(
            grid=((n_rows + R - 1) // R, 1, 1), block=(BLOCK_THREADS, 1, 1), stream=stream
        )

    return launch


def _example_args(plan: Plan, device: str = "cpu", rows: int = 3) -> tuple:
    """Placeholder arguments with the types/ranks of a real call (CPU = no launch)."""
    dt = {v: k for k, v in _DTYPES.items()}
    x = torch.empty(rows, plan.H, dtype=dt[plan.dtype], device=device)
    rstd = torch.empty(rows, dtype=torch.float32, device=device)
    w = torch.empty(plan.H, dtype=dt[plan.weight_dtype], device=device) if plan.weight_dtype else rstd
    return (x, w, torch.empty_like(x), rstd, rows, 1e-6, 0.0)


def _compile_here(plan: dict, export: bool) -> dict[str, Any]:
    """Runs inside compile_check's child process."""
    p = Plan(**plan)
    facts = compile_check.compile_and_collect(
        build_rms_norm(p), _example_args(p), export_name=KERNEL_NAME if export else None
    )
    facts["plan"] = asdict(p)
    return facts


def compile_rms_norm(
    H: int,
    dtype: torch.dtype,
    has_weight: bool,
    out_dir: str | None = None,
    *,
    weight_dtype: torch.dtype | None = None,
    vectorized: bool | None = None,
    export: bool = True,
    all_stages: bool = False,
) -> dict[str, Any]:
    """Compile (never launch) one specialization for gfx950; return facts.

    ``vectorized=None`` picks what ``launch_rms_norm`` would for a contiguous
    x. Facts: ok, reason, supported, arch, kernel_name, asm_path, object_path,
    header_path, amdgcn_target, vgpr/sgpr/lds/scratch/spill counts, compile_s,
    plan. Unsupported inputs return ``{"ok": False, "supported": False, ...}``
    without starting a compile.
    """
    ok, reason = supports(H, dtype, has_weight, weight_dtype)
    if not ok:
        return {"ok": False, "supported": False, "reason": reason}
    w_dt = (weight_dtype or dtype) if has_weight else None
    if vectorized is None:
        vectorized = H % (128 // _BITS[_DTYPES[dtype]]) == 0
    plan = make_plan(H, dtype, w_dt, vectorized)
    facts = compile_check.run_compile_in_subprocess(
        __file__, "_compile_here", {"plan": asdict(plan), "export": export}, out_dir=out_dir, all_stages=all_stages
    )
    facts["supported"] = True
    return facts


_LAUNCHERS: dict[tuple, Any] = {}


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def launch_rms_norm(
    x: torch.Tensor, w: torch.Tensor | None, eps: float = 1e-6, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run on a ROCm gfx950 device: returns (y, rstd). Never called on this host."""
    import flydsl.compiler as flyc

    if x.dim() != 2:
        raise ValueError("x must be 2-D [rows, H]; reshape first")
    rows, H = x.shape
    ok, reason = supports(H, x.dtype, w is not None, None if w is None else w.dtype, tuple(x.stride()))
    if not ok:
        raise ValueError(reason)
    if w is not None:
        if w.shape != (H,) or w.device != x.device:
            raise ValueError(f"weight must be [{H}] on {x.device}")
        w = w.contiguous()
    y = outputs.empty((rows, H), dtype=x.dtype, device=x.device)
    rstd = outputs.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return y, rstd
    vec = 16 // x.element_size()
    vectorized = H % vec == 0 and x.stride(0) % vec == 0 and _aligned(x) and _aligned(y) and (w is None or _aligned(w))
    # FlyDSL bakes which axes have stride 1 into the compiled layout (only H == 1 can differ).
    unit_strides = tuple(st == 1 for st in x.stride())
    key = (H, x.dtype, None if w is None else w.dtype, vectorized, unit_strides, x.device)
    args = (x, rstd if w is None else w, y, rstd, rows, float(eps), float(offset), torch.cuda.current_stream(x.device))
    compiled = _LAUNCHERS.get(key)
    if compiled is None:
        plan = make_plan(H, x.dtype, None if w is None else w.dtype, vectorized)
        # With live device tensors flyc.compile launches once and returns the
        # reusable CompiledFunction (layouts are dynamic: any rows / row stride).
        _LAUNCHERS[key] = flyc.compile(build_rms_norm(plan), *args)
    else:
        compiled(*args)
    return y, rstd
