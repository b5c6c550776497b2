"""GPU correctness checks of the grouped GEMM and the MoE layer, run by ``bench_grouped_mm --check`` (about 1 min).

What the CPU tests (Triton interpreter) cannot show: the compiled kernel on sm_90 in each launch variant (TMA
descriptors, TMA store, pointer path, persistent or not, gather/scatter), both weight layouts, unaligned shapes,
rows past the last offset left unwritten, clamped invalid offsets, gradients equal to ATen's, CUDA-graph replay
with new offsets (the tile schedule is built on the device), torch.compile, and FlyMoE against transformers' block.
Each check is one row (ok, detail); a failure does not stop the others. Invalid-offset checks run last.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

import fly_lightning
from benchmarks.bench_grouped_mm import backend_of
from benchmarks.harness import Results
from fly_lightning.kernels.triton import _grouped_mm_kernel as gk
from fly_lightning.kernels.triton._grouped_mm_config import CONFIG_TABLE, GroupedMMConfig, tune_candidates
from fly_lightning.ops.grouped_mm import grouped_mm_reference
from fly_lightning.ops.moe_grouped_mm import moe_grouped_mm

DEV = "cuda"
COUNTS = [0, 130, 7, 0, 1000, 64, 1, 333]  # empty groups, a tiny one, one spanning many tiles, sizes off 16


def _problem(counts, k, n, dtype=torch.bfloat16, k_major=True, tail=0, seed=0):
    if DEV != "cuda":  # CPU smoke run through the interpreter: the same structure, small
        counts = [max(1, c // 16) if c else 0 for c in counts]
        k, n = min(k, 64 + k % 8), min(n, 48 + n % 8)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    offs = torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32)
    m = sum(counts) + tail
    x = torch.randn(m, k, device=DEV, dtype=dtype, generator=gen)
    shape = (len(counts), n, k) if k_major else (len(counts), k, n)
    w = torch.randn(shape, device=DEV, dtype=dtype, generator=gen) * k**-0.5
    return x, (w.transpose(1, 2) if k_major else w), offs


def _err(y, x, w, offs):
    end = int(offs[-1])
    ref = grouped_mm_reference(x.float(), w.float(), offs)[:end]
    return ((y[:end].float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _variants() -> dict[str, GroupedMMConfig]:
    """The table, what tuning may choose, and the other launch forms (COUNTS has a group spanning many row tiles:
    warp specialisation with the pointer store went wrong exactly there, so it must now run unspecialised)."""
    out = {f"table:{c.label()}": c for c in dict.fromkeys(CONFIG_TABLE.values())}
    out |= {f"tune:{c.label()}": c for c in dict.fromkeys(tune_candidates("small") + tune_candidates("large"))}
    wide = GroupedMMConfig(128, 256, 64, 8, 3, 8)
    ws = replace(wide, num_warps=4, schedule="table", warp_specialize="tiles")
    out |= {
        "pointer": replace(wide, tma=False),
        "tma_store": replace(wide, tma_store=True),
        "not_persistent": replace(wide, programs_per_sm=0),
        "two_per_sm": replace(GroupedMMConfig(128, 128, 64, 8, 4, 8), programs_per_sm=2),
        "ws_tiles_pointer_store": ws,
        "ws_k_tma_store": replace(ws, warp_specialize="k", tma_store=True),
    }
    return out


def run_checks(device: str = "cuda") -> Results:
    global DEV
    DEV = device
    res = Results("grouped_mm_check")

    def check(name: str, fn: Callable[[], tuple[bool, str]]) -> None:
        try:
            ok, detail = fn()
        except Exception as exc:
            ok, detail = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        res.add(check=name, ok=bool(ok), detail=detail)

    for k_major in (True, False):
        for dtype in (torch.bfloat16, torch.float16):

            def dispatched(k_major=k_major, dtype=dtype):
                x, w, offs = _problem(COUNTS, 512, 384, dtype, k_major, tail=9)
                y = fly_lightning.grouped_mm(x, w, offs)
                backend = backend_of("grouped_mm", x, w, offs, None)
                err = _err(y, x, w, offs)
                return backend == "triton" and err < 1e-2, f"backend={backend} err={err:.2e}"

            check(f"dispatch {dtype} {'K' if k_major else 'N'}-major", dispatched)
        for vname, cfg in _variants().items():

            def variant(cfg=cfg, k_major=k_major):
                x, w, offs = _problem(COUNTS, 768, 640, k_major=k_major, tail=5)
                out = torch.full((x.shape[0], w.shape[2]), float("nan"), device=DEV, dtype=x.dtype)
                gk.launch(x, w, offs, out, config=cfg)
                err, tail_nan = _err(out, x, w, offs), bool(out[int(offs[-1]) :].isnan().all())
                return err < 1e-2 and tail_nan, f"err={err:.2e} rows past the end unwritten={tail_nan}"

            check(f"variant {vname} {'K' if k_major else 'N'}-major", variant)

    def unaligned():
        x, w, offs = _problem([5, 300, 0, 77], 1003, 77, k_major=False)
        y = fly_lightning.grouped_mm(x, w, offs)
        backend = backend_of("grouped_mm", x, w, offs, None)
        err = _err(y, x, w, offs)
        return backend == "triton" and err < 1e-2, f"K=1003 N=77 backend={backend} err={err:.2e}"

    check("unaligned K/N (pointer path)", unaligned)

    def fp32_out():
        x, w, offs = _problem(COUNTS, 256, 256)
        y = fly_lightning.grouped_mm(x, w, offs, out_dtype=torch.float32)
        err = _err(y, x, w, offs)
        return y.dtype == torch.float32 and err < 1e-4, f"err={err:.2e}"

    check("float32 output", fp32_out)

    def large_model_shape():
        x, w, offs = _problem([512] * 128, 2048, 1536)  # Qwen3-30B-A3B gate/up
        y = fly_lightning.grouped_mm(x, w, offs)
        ref = torch._grouped_mm(x, w, offs=offs)
        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        return err < 1e-2, f"vs torch._grouped_mm err={err:.2e}"

    check("qwen3 gate/up shape vs torch._grouped_mm", large_model_shape)

    for gather, scatter in ((True, False), (False, True), (True, True)):

        def moe_op(gather=gather, scatter=scatter):
            t, topk, e, k, n = (1000, 4, 16, 512, 384) if DEV == "cuda" else (40, 4, 16, 32, 48)
            ids = torch.rand(t, e, device=DEV).topk(topk, dim=-1).indices.reshape(-1)
            offs = torch.bincount(ids, minlength=e).cumsum(0).to(torch.int32)
            perm = torch.argsort(ids, stable=True).to(torch.int32)
            x_tok = torch.randn(t, k, device=DEV, dtype=torch.bfloat16)
            x = x_tok if gather else x_tok[perm.long() // topk]
            w = (torch.randn(e, n, k, device=DEV, dtype=torch.bfloat16) * k**-0.5).transpose(1, 2)
            y = moe_grouped_mm(x, w, offs, perm, topk=topk, gather=gather, scatter=scatter)
            ref = grouped_mm_reference(x_tok.float()[perm.long() // topk], w.float(), offs)
            if scatter:
                ref = ref[torch.argsort(perm.long())]
            err = ((y.float() - ref).norm() / ref.norm()).item()
            backend = backend_of("moe_grouped_mm", x, w, offs, perm, topk, gather, scatter, None)
            return backend == "triton" and err < 1e-2, f"backend={backend} err={err:.2e}"

        check(f"moe_grouped_mm gather={gather} scatter={scatter}", moe_op)

    def gradients():
        x0, w0, offs = _problem(COUNTS, 256, 384)
        g = torch.randn(x0.shape[0], w0.shape[2], device=DEV, dtype=x0.dtype)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        (fly_lightning.grouped_mm(x, w, offs) * g).sum().backward()
        x2, w2 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        (torch._grouped_mm(x2, w2, offs=offs) * g).sum().backward()
        end = int(offs[-1])  # dX rows past the last offset are unspecified (as in torch)
        ex, ew = _rel(x.grad[:end], x2.grad[:end]), _rel(w.grad, w2.grad)
        empty_zero = bool((w.grad[0] == 0).all() and (w.grad[3] == 0).all())
        ok = ex < 1e-2 and ew < 1e-2 and empty_zero
        return ok, f"dX err={ex:.1e} dW err={ew:.1e} (vs ATen autograd) empty-group dW zero={empty_zero}"

    check("gradients equal torch._grouped_mm's", gradients)

    def cuda_graph():
        if DEV != "cuda":
            return True, "skipped (not CUDA)"
        x, w, offs = _problem(COUNTS, 256, 256)
        static_offs = offs.clone()
        fly_lightning.grouped_mm(x, w, static_offs)  # compile and dispatch before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = fly_lightning.grouped_mm(x, w, static_offs)
        new_counts = [300, 0, 0, 1200, 0, 1, 34, 0]  # same total rows, different groups
        static_offs.copy_(torch.tensor(new_counts, device=DEV).cumsum(0).to(torch.int32))
        graph.replay()
        err = _err(y, x, w, static_offs)
        return err < 1e-2, f"replay with new offsets err={err:.2e}"

    check("CUDA graph replay with new offsets", cuda_graph)

    def compiled():
        x0, w0, offs = _problem(COUNTS, 256, 256)
        f = lambda x, w: (fly_lightning.grouped_mm(x, w, offs).float() ** 2).sum()  # noqa: E731
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        eager = f(x, w)
        ge = torch.autograd.grad(eager, (x, w))
        comp = torch.compile(f, fullgraph=True)(x, w)
        gc = torch.autograd.grad(comp, (x, w))
        ok = torch.allclose(eager, comp, rtol=1e-3) and all(_rel(a, b) < 1e-2 for a, b in zip(ge, gc, strict=True))
        return ok, f"eager={eager.item():.4f} compiled={comp.item():.4f}"

    check("torch.compile fullgraph fwd+bwd", compiled)

    def moe_layer():
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        torch.manual_seed(0)
        h, i, t = (512, 256, 300) if DEV == "cuda" else (32, 32, 10)
        cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=16, num_experts_per_tok=4,
                             norm_topk_prob=True)  # fmt: skip
        block = Qwen3MoeSparseMoeBlock(cfg).to(DEV, torch.bfloat16)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.05)
        x = torch.randn(4, t, h, device=DEV, dtype=torch.bfloat16)
        ref = block(x).float()
        outs, grads = {}, {}
        for path in ("plain", "fused"):
            moe = fly_lightning.FlyMoE.from_module(block, path=path)
            xg = x.clone().requires_grad_()
            y = moe(xg)
            y.float().pow(2).sum().backward()
            outs[path], grads[path] = y.float(), xg.grad
            block.zero_grad(set_to_none=True)
        err = _rel(outs["fused"], ref)
        paths = max(_rel(outs["plain"], outs["fused"]), _rel(grads["plain"], grads["fused"]))
        same = torch.equal(outs["plain"], outs["fused"]) and torch.equal(grads["plain"], grads["fused"])
        comp = torch.compile(fly_lightning.FlyMoE.from_module(block, path="fused"), fullgraph=True)(x).float()
        cerr = _rel(comp, outs["fused"])
        ok = err < 2e-2 and paths < 1e-3 and cerr < 1e-2
        return ok, f"vs HF err={err:.2e} plain vs fused err={paths:.1e} (bitwise={same}) compiled err={cerr:.2e}"

    check("FlyMoE vs transformers Qwen3-MoE block", moe_layer)

    def warp_specialized():  # informational: whether triton's Hopper warp specialisation takes this loop
        x, w, offs = _problem(COUNTS, 512, 512)
        out = torch.empty(x.shape[0], w.shape[2], device=DEV, dtype=x.dtype)
        cfg = GroupedMMConfig(128, 128, 64, 8, 3, 4, tma_store=True, warp_specialize="k")  # on the scan schedule
        gk.launch(x, w, offs, out, config=cfg)
        err = _err(out, x, w, offs)
        return err < 1e-2, f"err={err:.2e}"

    check("warp_specialize='k' compiles and is correct (informational)", warp_specialized)

    for mode in ("plain", "gather", "scatter"):

        def tuned(mode=mode):
            x, w, offs = _problem(COUNTS, 768, 640)
            m = x.shape[0]
            index = {}
            if mode != "plain":  # routed slots: a permutation of the rows, read (gather) or written (scatter) by it
                index = dict(idx=torch.randperm(m, device=DEV).to(torch.int32), topk=1, **{mode: True})
            gk.MEASURED.clear()
            gk.REJECTED.clear()
            try:
                best = gk.tune(x, w, offs, reps=10 if DEV == "cuda" else 1, **index)
                rejected = {label: why for r in gk.REJECTED.values() for label, why in r.items()}
            finally:
                gk.MEASURED.clear()
                gk.REJECTED.clear()
            out = torch.zeros(m, w.shape[2], device=DEV, dtype=x.dtype)
            gk.launch(x, w, offs, out, config=best, **index)
            rows = x[index["idx"].long()] if mode == "gather" else x
            ref = grouped_mm_reference(rows.float(), w.float(), offs)
            if mode == "scatter":
                ref = torch.zeros_like(ref).index_copy_(0, index["idx"].long(), ref)
            err = _rel(out, ref)
            return err < 1e-2 and not rejected, f"chose {best.label()} err={err:.2e} rejected={rejected}"

        check(f"tune ({mode}): every candidate agrees with the table, the choice is correct", tuned)

    for offsets in ([400, 200, 900], [100, 5000, 6000], [-50, 400, 900]):  # last: a fault would end the process

        def invalid(offsets=offsets):
            x, w, _ = _problem([300, 300, 300], 256, 256)
            m, n = x.shape[0], w.shape[2]
            guard = torch.full((m + 256, n), 7.0, device=DEV, dtype=x.dtype)
            out = guard[128 : 128 + m]
            gk.launch(x, w, torch.tensor(offsets, device=DEV, dtype=torch.int32), out)
            if DEV == "cuda":
                torch.cuda.synchronize()
            untouched = bool((guard[:128] == 7).all() and (guard[128 + m :] == 7).all())
            return untouched, f"offsets={offsets} memory outside the output untouched={untouched}"

        check(f"invalid offsets {offsets} are clamped", invalid)

    res.summary["passed"] = sum(r["ok"] for r in res.rows)
    res.summary["failed"] = [r["check"] for r in res.rows if not r["ok"]]
    return res
