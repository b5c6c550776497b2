"""Fused MoE routing forward as a FlyDSL kernel for AMD gfx950 (MI350).

Per token row t of logits [T, E]:

    ids[t] = top-k of x.float(), descending              (the op's semantics: see fly_lightning.ops.moe_route)
    w[t]   = softmax(x.float())[ids] or sigmoid(x[ids])   (fp32)
    w[t] /= w[t].sum() + 1e-20                             (optional renormalise)
    counts[e] += #(t, j) with ids[t, j] == e                (optional, atomics)

Ranking is on the logits (softmax and sigmoid are increasing, and distinct logits whose fp32 scores round equal still
rank apart), NaN above every number, equal values (and NaNs) by lower expert id, -0.0 equal to +0.0: the reference's
order, so a row picks the same experts on every backend.

Mapping: a group of G lanes (G = next power of two >= E, at most 64) owns one
token, so a 256-thread workgroup routes 256 / G tokens. Lane j holds experts
j, j + G, j + 2G, ... (E <= 256 -> at most 4 "slots" per lane), so each slot
is one coalesced load across the group. Max / sum use xor-butterfly shuffles
inside the group. Top-k is k rounds of (lane-local best, then butterfly
arg-max), each slot ranked by a code, category * 1024 + expert id (category
0: NaN, 1: a number, 2: padding or already chosen, never chosen again), then
by value within category 1; the order is total, so the result is
deterministic and a row never picks an expert twice (even among -inf). Lane j < k writes the
j-th pair. Counts go to an LDS histogram first, then one global atomic per
expert and workgroup (keeps contention at E addresses low).

Only compiled here (no AMD GPU): ``compile_moe_route`` runs in a subprocess.
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

KERNEL_NAME = "fly_moe_route_fwd"
BLOCK_THREADS = 256
WAVE = 64
MAX_EXPERTS = 256
MAX_TOPK = 8
SCORE_FUNCS = ("softmax", "sigmoid")

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_BITS = {"bf16": 16, "f16": 16, "f32": 32}


def constraints() -> dict[str, Any]:
    """What the kernel accepts, as plain data for the dispatcher's messages."""
    return {
        "arch": compile_check.TARGET_ARCH,
        "logit_dtypes": [str(d) for d in _DTYPES],
        "E_min": 1,
        "E_max": MAX_EXPERTS,
        "k_min": 1,
        "k_max": f"min({MAX_TOPK}, E)",
        "score_funcs": list(SCORE_FUNCS),
        "logits_layout": "2-D [T, E] with stride(1) == 1; any row stride, no alignment needed",
        "tokens_max": 2**31 - 1,
        "outputs": "weights float32 [T, k], ids int32 [T, k], optional counts int32 [E]",
        "ranking": "the logits (softmax/sigmoid are increasing), in fp32",
        "ties": "equal logits: lower expert id first; -0.0 == +0.0",
        "nan": "NaN ranks above every number (lower id first among NaN) and propagates into the weights",
    }


def supports(E: int, k: int, dtype: torch.dtype, score: str = "softmax") -> tuple[bool, str]:
    """(ok, reason). ``reason`` names the first unmet constraint."""
    if dtype not in _DTYPES:
        return False, f"logits dtype {dtype} not in {list(_DTYPES)}"
    if not 1 <= E <= MAX_EXPERTS:
        return False, f"E={E} outside [1, {MAX_EXPERTS}]"
    if not 1 <= k <= min(MAX_TOPK, E):
        return False, f"k={k} outside [1, min({MAX_TOPK}, E={E})]"
    if score not in SCORE_FUNCS:
        return False, f"score function {score!r} not in {SCORE_FUNCS}"
    return True, "ok"


@dataclass(frozen=True)
class Plan:
    """Compile-time shape of one specialization."""

    E: int
    k: int
    dtype: str
    score: str
    renormalize: bool
    with_counts: bool
    lanes_per_token: int  # G
    tokens_per_block: int
    slots: int  # experts per lane


def make_plan(E: int, k: int, dtype: torch.dtype, score: str, renormalize: bool, with_counts: bool) -> Plan:
    lanes = min(WAVE, 1 << (E - 1).bit_length())
    return Plan(
        E=E,
        k=k,
        dtype=_DTYPES[dtype],
        score=score,
        renormalize=renormalize,
        with_counts=with_counts,
        lanes_per_token=lanes,
        tokens_per_block=BLOCK_THREADS // lanes,
        slots=-(-E // lanes),
    )


def build_moe_route(plan: Plan):
    """Return the ``@flyc.jit`` launcher for ``plan`` (imports FlyDSL lazily)."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl.expr import const_expr, gpu, range_constexpr
    from flydsl.expr import math as fmath

    x_ty = {"bf16": fx.BFloat16, "f16": fx.Float16, "f32": fx.Float32}[plan.dtype]
    x_bits = _BITS[plan.dtype]
    E, K, G, TPB, S = plan.E, plan.k, plan.lanes_per_token, plan.tokens_per_block, plan.slots
    NEG_INF = float("-inf")
    RENORM_EPS = 1e-20  # as the op's reference (DeepSeek-V3 / torchtitan): an all-zero row stays 0, not NaN

    def butterfly(v, combine):
        # xor offsets < G keep the exchange inside this token's lane group.
        for s in range_constexpr(6):
            if const_expr((1 << s) < G):
                v = combine(v, v.shuffle_xor(1 << s, WAVE))
        return v

    def better(v, c, ov, oc):
        # Whether (ov, oc) ranks before (v, c): lower category first (code = category * 1024 + expert); within
        # numbers the higher value, then the lower expert; NaNs (unequal to everything) by the lower expert.
        cat, ocat = c // 1024, oc // 1024
        tie = (ov == v) | (ocat == 0)
        return (ocat < cat) | ((ocat == cat) & ((ov > v) | (tie & (oc < c))))

    def scalar_store(view, idx, value, ty, bits):
        r = fx.make_rmem_tensor(1, ty)
        fx.memref_store_vec(fx.Vector.filled(1, value, ty), r)
        fx.copy(fx.make_copy_atom(fx.rocdl.BufferCopy(bits), bits), r, fx.slice(view, (None, idx)))

    @fx.struct
    class Histogram:
        counts: fx.Array[fx.Int32, E, 16]

    @flyc.kernel(known_block_size=[BLOCK_THREADS, 1, 1])
    def fly_moe_route_fwd(
        Logits: fx.Tensor,
        Weights: fx.Tensor,
        Ids: fx.Tensor,
        Counts: fx.Tensor,
        n_tokens: fx.Int32,
    ):
        tid = fx.thread_idx.x
        j = tid % G
        tok = fx.block_idx.x * TPB + tid // G
        tok_ok = tok < n_tokens
        tok_c = tok_ok.select(tok, 0)  # tail groups route token 0 but never store

        row = fx.rocdl.make_buffer_tensor(fx.slice(Logits, (tok_c, None)), max_size=False)
        row_v = fx.logical_divide(row, fx.make_layout(1, 1))
        x_atom = fx.make_copy_atom(fx.rocdl.BufferCopy(x_bits), x_bits)

        # Load this lane's slots; experts past E are masked to -inf.
        xs = []
        for s in range_constexpr(S):
            r = fx.make_rmem_tensor(1, x_ty)
            fx.copy(x_atom, fx.slice(row_v, (None, j + s * G)), r)
            x = fx.memref_load_vec(r).to(fx.Float32)[0]
            if const_expr(G * (s + 1) > E):
                x = (j + s * G < E).select(x, NEG_INF)
            xs.append(x)

        # Ranking codes: category * 1024 + expert (0: NaN, 1: a number, 2: padding; chosen experts become 2 too).
        codes = []
        for s in range_constexpr(S):
            e = j + s * G
            c = (xs[s] != xs[s]).select(fx.Int32(0), fx.Int32(1024)) + e
            if const_expr(G * (s + 1) > E):
                c = (e < E).select(c, 2048 + e)
            codes.append(c)

        # Top-k: k rounds of arg-max over the codes; the winner's slot moves to category 2.
        sel_x = []
        sel_i = []
        for _r in range_constexpr(K):
            bv = xs[0]
            bc = codes[0]
            for s in range_constexpr(1, S):
                take = better(bv, bc, xs[s], codes[s])
                bv = take.select(xs[s], bv)
                bc = take.select(codes[s], bc)
            for sh in range_constexpr(6):
                if const_expr((1 << sh) < G):
                    ov = bv.shuffle_xor(1 << sh, WAVE)
                    oc = bc.shuffle_xor(1 << sh, WAVE)
                    take = better(bv, bc, ov, oc)
                    bv = take.select(ov, bv)
                    bc = take.select(oc, bc)
            bi = bc % 1024
            sel_x.append(bv)
            sel_i.append(bi)
            for s in range_constexpr(S):
                codes[s] = (j + s * G == bi).select(2048 + j + s * G, codes[s])

        # Gate weights of the chosen, in fp32 (padding slots hold -inf: exp(-inf) = 0 adds nothing to the sum).
        if const_expr(plan.score == "softmax"):
            m = xs[0]
            for s in range_constexpr(1, S):
                m = fx.max(m, xs[s])
            m = butterfly(m, fx.max)
            total = fmath.exp(xs[0] - m)
            for s in range_constexpr(1, S):
                total = total + fmath.exp(xs[s] - m)
            total = butterfly(total, lambda a, b: a + b)
            sel_v = [fmath.exp(v - m) / total for v in sel_x]
        else:
            sel_v = [1.0 / (1.0 + fmath.exp(-v)) for v in sel_x]

        if const_expr(plan.renormalize):
            denom = sel_v[0]
            for r_i in range_constexpr(1, K):
                denom = denom + sel_v[r_i]
            denom = denom + RENORM_EPS
            sel_v = [v / denom for v in sel_v]

        # Lane j < k writes pair j (select chain: the pairs are replicated in the group).
        my_v = sel_v[0]
        my_i = sel_i[0]
        for r_i in range_constexpr(1, K):
            my_v = (j == r_i).select(sel_v[r_i], my_v)
            my_i = (j == r_i).select(sel_i[r_i], my_i)
        if tok_ok & (j < K):
            w_row = fx.rocdl.make_buffer_tensor(fx.slice(Weights, (tok, None)), max_size=False)
            i_row = fx.rocdl.make_buffer_tensor(fx.slice(Ids, (tok, None)), max_size=False)
            scalar_store(fx.logical_divide(w_row, fx.make_layout(1, 1)), j, my_v, fx.Float32, 32)
            scalar_store(fx.logical_divide(i_row, fx.make_layout(1, 1)), j, my_i, fx.Int32, 32)

        if const_expr(plan.with_counts):
            hist = fx.SharedAllocator().allocate(Histogram).peek().counts
            if tid < E:
                fx.memref_store(fx.Int32(0), hist.view(fx.make_layout(E, 1)), tid)
            gpu.barrier()
            if tok_ok & (j == 0):
                for r_i in range_constexpr(K):
                    fx.atomic_add(hist.ptr + sel_i[r_i], fx.Int32(1), syncscope=fx.rocdl.SyncScope.Workgroup)
            gpu.barrier()
            if tid < E:
                c = fx.memref_load(hist.view(fx.make_layout(E, 1)), tid)
                if c > 0:
                    fx.atomic_add(fx.get_iter(Counts) + tid, c, syncscope=fx.rocdl.SyncScope.Agent)

    @flyc.jit
    def launch(
        Logits: fx.Tensor,
        Weights: fx.Tensor,
        Ids: fx.Tensor,
        Counts: fx.Tensor,
        n_tokens: fx.Int32,
        stream: fx.Stream = fx.Stream(None),  # noqa: B008 - FlyDSL reads the default from the signature
    ):
        fly_moe_route_fwd(Logits, Weights, Ids, Counts, n_tokens).launch(
            grid=((n_tokens + TPB - 1) // TPB, 1, 1), block=(BLOCK_THREADS, 1, 1), stream=stream
        )

    return launch


def _example_args(plan: Plan, device: str = "cpu", tokens: int = 5) -> tuple:
    """Placeholder arguments with the types/ranks of a real call (CPU = no launch)."""
    dt = {v: k for k, v in _DTYPES.items()}
    logits = torch.empty(tokens, plan.E, dtype=dt[plan.dtype], device=device)
    weights = torch.empty(tokens, plan.k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, plan.k, dtype=torch.int32, device=device)
    counts = torch.zeros(plan.E, dtype=torch.int32, device=device)
    return (logits, weights, ids, counts, tokens)


def _compile_here(plan: dict, export: bool) -> dict[str, Any]:
    """Runs inside compile_check's child process."""
    p = Plan(**plan)
    facts = compile_check.compile_and_collect(
        build_moe_route(p), _example_args(p), export_name=KERNEL_NAME if export else None
    )
    facts["plan"] = asdict(p)
    return facts


def compile_moe_route(
    E: int,
    k: int,
    dtype: torch.dtype,
    score: str = "softmax",
    renormalize: bool = True,
    with_counts: bool = False,
    out_dir: str | None = None,
    *,
    export: bool = True,
    all_stages: bool = False,
) -> dict[str, Any]:
    """Compile (never launch) one specialization for gfx950; return facts.

    Same facts as ``rms_norm.compile_rms_norm``. Unsupported inputs return
    ``{"ok": False, "supported": False, "reason": ...}`` without compiling.
    """
    ok, reason = supports(E, k, dtype, score)
    if not ok:
        return {"ok": False, "supported": False, "reason": reason}
    plan = make_plan(E, k, dtype, score, renormalize, with_counts)
    facts = compile_check.run_compile_in_subprocess(
        __file__, "_compile_here", {"plan": asdict(plan), "export": export}, out_dir=out_dir, all_stages=all_stages
    )
    facts["supported"] = True
    return facts


_LAUNCHERS: dict[tuple, Any] = {}


def launch_moe_route(
    logits: torch.Tensor,
    k: int,
    score: str = "softmax",
    renormalize: bool = True,
    with_counts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run on a ROCm gfx950 device: (weights f32 [T,k], ids i32 [T,k], counts i32 [E] or None)."""
    import flydsl.compiler as flyc

    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be 2-D [T, E] with unit last stride")
    T, E = logits.shape
    ok, reason = supports(E, k, logits.dtype, score)
    if not ok:
        raise ValueError(reason)
    dev = logits.device
    weights = outputs.empty(T, k, dtype=torch.float32, device=dev)
    ids = outputs.empty(T, k, dtype=torch.int32, device=dev)
    counts = torch.zeros(E, dtype=torch.int32, device=dev)  # atomics accumulate into zeros
    if T > 0:
        # FlyDSL bakes which axes have stride 1 into the compiled layout (only E == 1 can differ).
        unit_strides = tuple(st == 1 for st in logits.stride())
        key = (E, k, logits.dtype, score, renormalize, with_counts, unit_strides, dev)
        args = (logits, weights, ids, counts, T, torch.cuda.current_stream(dev))
        compiled = _LAUNCHERS.get(key)
        if compiled is None:
            plan = make_plan(E, k, logits.dtype, score, renormalize, with_counts)
            # With live device tensors flyc.compile launches once and returns the
            # reusable CompiledFunction (layouts are dynamic: any T / row stride).
            _LAUNCHERS[key] = flyc.compile(build_moe_route(plan), *args)
        else:
            compiled(*args)
    return weights, ids, (counts if with_counts else None)
