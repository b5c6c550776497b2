"""MoE layer suite (GPU): one MoE block end to end (router, routing, experts,
combine) on real model shapes, bf16, forward and forward+backward, all variants on the same weights:

- ``hf_grouped_mm``: transformers' own block (v5) with its ``grouped_mm`` experts implementation: sort, permute,
  ``torch._grouped_mm``, SwiGLU, ``torch._grouped_mm``, weight, un-permute, sum. The layer users run today, and the
  baseline of the issue's "permute + grouped_mm + unpermute" (absent where transformers is not installed);
- ``plain_aten``: ``FlyMoE``'s plain path with every op on ATen (the same dataflow, our ATen composition);
- ``plain``: ``FlyMoE``'s plain path on the kernels (token rows copied into expert order);
- ``fused``: ``FlyMoE``'s fused path (token rows gathered inside the gate/up GEMM, no copy);
- ``hf_compile`` / ``fused_compile``: those two under ``torch.compile`` (default policy: Inductor keeps the ops in
  ``DispatchConfig.inductor_ops``);
- ``liger``: transformers' block with Liger-Kernel's ``LigerExperts`` (its fused MoE kernels, forward and backward)
  in place of the experts, as ``apply_liger_kernel_to_qwen3_moe`` installs them (``--liger`` models only: its
  autotuning takes minutes per shape).

The ``FlyMoE`` variants wrap the transformers block (``FlyMoE.from_module``: shared parameters). Outputs are first
compared with ``hf_grouped_mm`` (else ``plain_aten``), then timed side by side: the variants take turns in rounds
(``harness.interleaved_ms``).

    python -m benchmarks.bench_moe_layer    # about 1 minute on an H200 (writes moe_layer.*)
"""

from __future__ import annotations

import argparse
import copy
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from benchmarks.harness import Results, first_call_s, interleaved_ms
from fly_lightning import FlyMoE, dispatch_config

# transformers model type, hidden H, expert intermediate I, experts E, top-k, tokens T, renormalised top-k weights
MOE_MODELS = {
    "qwen3-30b-a3b": ("qwen3_moe", 2048, 768, 128, 8, 8192, True),
    "olmoe-1b-7b": ("olmoe", 2048, 1024, 64, 8, 8192, False),
    "mixtral-8x7b": ("mixtral", 4096, 14336, 8, 2, 4096, True),
}
FLY_VARIANTS = ("fused", "plain", "plain_aten")
BASELINES = ("hf_grouped_mm", "hf_compile", "liger")  # what users run without us
ROUNDS = 4  # side-by-side timing: a drift of the GPU's clocks falls on every variant alike


def hf_block(family: str, h: int, i: int, e: int, k: int, norm: bool, device, dtype) -> torch.nn.Module | None:
    """transformers' MoE block of ``family`` with the ``grouped_mm`` experts, random weights; None if unavailable."""
    try:
        import transformers
    except ImportError:
        return None
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e,
                                          num_experts_per_tok=k, norm_topk_prob=norm)  # fmt: skip
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(hidden_size=h, intermediate_size=i, num_experts=e, num_experts_per_tok=k,
                                       norm_topk_prob=norm)  # fmt: skip
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock as Block
    else:
        cfg = transformers.MixtralConfig(hidden_size=h, intermediate_size=i, num_local_experts=e,
                                         num_experts_per_tok=k)  # fmt: skip
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = Block(cfg).to(device=device, dtype=dtype)
    if not isinstance(getattr(block.experts, "gate_up_proj", None), torch.Tensor):
        return None  # transformers v4: per-expert loops, not the grouped_mm layer
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def liger_block(block: torch.nn.Module) -> torch.nn.Module | None:
    """``block`` with Liger-Kernel's ``LigerExperts`` sharing its expert weights, or None (Liger not installed)."""
    try:
        from liger_kernel.transformers.swiglu import LigerExperts
    except ImportError:
        return None
    experts = LigerExperts(block.config if hasattr(block, "config") else block.experts.config)
    experts.gate_up_proj, experts.down_proj = block.experts.gate_up_proj, block.experts.down_proj
    new = copy.copy(block)
    new._modules = dict(block._modules)
    new.experts = experts
    return new


def _layers(family, h, i, e, k, norm, device, dtype, liger: bool, compiled: bool) -> dict[str, torch.nn.Module]:
    block = hf_block(family, h, i, e, k, norm, device, dtype)
    if block is None:
        torch.manual_seed(0)
        make = lambda path: FlyMoE(h, i, e, k, norm_topk_prob=norm, path=path, device=device, dtype=dtype)  # noqa: E731
        return {v: make("fused" if v == "fused" else "plain") for v in FLY_VARIANTS}
    layers = {"hf_grouped_mm": block}
    if liger and (lb := liger_block(block)) is not None:
        layers["liger"] = lb
    layers.update({v: FlyMoE.from_module(block, path="fused" if v == "fused" else "plain") for v in FLY_VARIANTS})
    if compiled:
        layers["hf_compile"] = torch.compile(block)
        layers["fused_compile"] = torch.compile(FlyMoE.from_module(block, path="fused"))
    return layers


def profile_fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, top: int = 25) -> list[dict]:
    """Device time per kernel over one forward+backward (torch.profiler), the ``top`` largest."""
    from torch.profiler import ProfilerActivity, profile

    xg = x.clone().requires_grad_()
    _call(layer, xg).backward(grad)
    torch.cuda.synchronize()
    layer.zero_grad(set_to_none=True)  # as in the timed step: no accumulation into existing .grad in the profile
    xg.grad = None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _call(layer, xg).backward(grad)
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:160], "ms": round(e.self_device_time_total / 1e3, 4), "calls": e.count}
            for e in prof.key_averages() if e.self_device_time_total > 0]  # fmt: skip
    rows.sort(key=lambda r: -r["ms"])
    return [{"total_ms": round(sum(r["ms"] for r in rows), 4)}, *rows[:top]]


def _call(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out  # some transformers blocks also return router logits


def run_moe(device: str = "cuda", models: dict | None = None, dtype: torch.dtype = torch.bfloat16,
            reps: tuple[int, int] = (24, 12), liger: tuple[str, ...] = (), compiled: bool = True,
            profile: tuple[str, ...] = ()) -> Results:  # fmt: skip
    res = Results("moe_layer")
    models = models or MOE_MODELS
    for model, (family, h, i, e, k, t, norm) in models.items():
        x = torch.randn(1, t, h, device=device, dtype=dtype)  # transformers blocks take [B, S, H]
        grad = torch.randn_like(x)
        layers = _layers(family, h, i, e, k, norm, device, dtype, model in liger, compiled and device == "cuda")
        flops = 6.0 * t * k * h * i  # gate/up (2 x 2I x H) + down (2 x H x I) per routed row
        outs, cold = {}, {}
        for v, layer in layers.items():
            with torch.no_grad(), dispatch_config(backends=("aten",)) if v == "plain_aten" else nullcontext():
                cold[v], outs[v] = first_call_s(_call, layer, x)
            with dispatch_config(backends=("aten",)) if v == "plain_aten" else nullcontext():
                step = lambda a, layer=layer, g=grad: _call(layer, a).backward(g)  # noqa: E731
                cold[v] += first_call_s(step, x.clone().requires_grad_())[0]
        base_name = "hf_grouped_mm" if "hf_grouped_mm" in outs else "plain_aten"
        base = outs[base_name].float()
        xg = x.clone().requires_grad_()
        fwd, fwd_bwd = {}, {}
        for v, layer in layers.items():
            ctx = (lambda: dispatch_config(backends=("aten",))) if v == "plain_aten" else nullcontext

            def f(a, layer=layer, ctx=ctx):
                with torch.no_grad(), ctx():
                    return _call(layer, a)

            def fb(a, layer=layer, ctx=ctx, g=grad):
                layer.zero_grad(set_to_none=True)
                a.grad = None
                with ctx():
                    _call(layer, a).backward(g)

            fwd[v], fwd_bwd[v] = f, fb
        # the variants take turns (harness.interleaved_ms), forward first, then forward+backward
        fwd_ms = interleaved_ms(fwd, [(x,)], reps[0], rounds=ROUNDS)
        fb_ms = interleaved_ms(fwd_bwd, [(xg,)], reps[1], rounds=ROUNDS)
        for v in layers:
            diff = outs[v].float() - base
            row = dict(model=model, variant=v, T=t, H=h, I=i, E=e, top_k=k, baseline=base_name,
                       max_abs_diff_vs_baseline=diff.abs().max().item(),
                       rel_err_vs_baseline=(diff.norm() / base.norm()).item())  # fmt: skip
            row.update(fwd_ms=round(fwd_ms[v], 4), fwd_tflops=round(flops / fwd_ms[v] / 1e9, 1),
                       fwd_bwd_ms=round(fb_ms[v], 4), fwd_bwd_tflops=round(3 * flops / fb_ms[v] / 1e9, 1),
                       first_fwd_bwd_s=round(cold[v], 2))  # fmt: skip
            res.add(**row)
        for v in profile:
            if v in layers and device == "cuda":
                res.details[f"{model}/{v}/profile_fwd_bwd"] = profile_fwd_bwd(layers[v], x, grad)
        del layers, outs, x, grad
        if device == "cuda":
            torch.cuda.empty_cache()
    summarise(res)
    res.notes += [
        "x_over_y = y time / x time (> 1: x faster). fwd_bwd TFLOP/s counts 3x the forward GEMM FLOPs.",
        f"timing: the variants take turns in rounds (at least {ROUNDS}, a multiple of their number; order rotated each "
        "round), each reporting the median of its round medians (harness.interleaved_ms); forward first, then "
        "forward+backward.",
        "hf_grouped_mm: transformers' block with config._experts_implementation='grouped_mm' (the stock layer).",
        "first_fwd_bwd_s: host time of the first forward and the first forward+backward (compilation, autotuning).",
        "Set fly_lightning.modules.moe.AUTO_PATH to the faster of fused/plain (FlyMoE(path='auto') uses it).",
    ]
    return res


def summarise(res: Results) -> None:
    """Per model: ``fused`` against each other variant, and our fastest block against the fastest block users run
    without us (forward+backward), from the rows."""
    for model in dict.fromkeys(row["model"] for row in res.rows):
        r = {row["variant"]: row for row in res.rows if row["model"] == model}
        for other in ("hf_grouped_mm", "hf_compile", "liger", "plain_aten", "plain"):
            for mode in ("fwd", "fwd_bwd"):
                if other in r:
                    res.summary[f"{model}_fused_over_{other}_{mode}"] = round(
                        r[other][f"{mode}_ms"] / r["fused"][f"{mode}_ms"], 3
                    )
        # the headline: our fastest block against the fastest block users run without us, forward+backward
        ours = [v for v in ("fused", "plain", "fused_compile") if v in r]
        theirs = [v for v in BASELINES if v in r]
        if ours and theirs:
            best = min(ours, key=lambda v: r[v]["fwd_bwd_ms"])
            base = min(theirs, key=lambda v: r[v]["fwd_bwd_ms"])
            res.summary[f"{model}_best_over_best_baseline_fwd_bwd"] = {
                "ours": best, "baseline": base, "speedup": round(r[base]["fwd_bwd_ms"] / r[best]["fwd_bwd_ms"], 3)
            }  # fmt: skip
        if "liger" in r:  # the block goal: our fastest block against Liger-Kernel's fused MoE
            best = min(ours, key=lambda v: r[v]["fwd_bwd_ms"])
            res.summary[f"{model}_best_over_liger_fwd_bwd"] = {
                "ours": best, "speedup": round(r["liger"]["fwd_bwd_ms"] / r[best]["fwd_bwd_ms"], 3), "goal": 1.3
            }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MOE_MODELS), help="comma-separated, from: " + ", ".join(MOE_MODELS))
    p.add_argument("--liger", default="qwen3-30b-a3b", help="models that also time Liger's experts ('' for none)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    p.add_argument("--profile", default="", help="variants whose forward+backward kernels are profiled (JSON only)")
    p.add_argument("--summarise", metavar="JSON", help="recompute the summary of a saved result (no GPU) and save it")
    args = p.parse_args()
    if args.summarise:
        res, env = Results.load(args.summarise)
        wall = res.summary.get("wall_s")
        res.summary = {}
        summarise(res)
        res.summary["wall_s"] = wall
        note = "summary recomputed from these rows by --summarise (no new timing)"
        res.notes += [note] if note not in res.notes else []
        print(f"{res.summary}\nwrote {res.save(Path(args.summarise).parent, env=env)}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    split = lambda s: tuple(v for v in s.split(",") if v)  # noqa: E731
    models = {m: MOE_MODELS[m] for m in split(args.models)}
    start = time.perf_counter()
    res = run_moe(models=models, liger=split(args.liger), compiled=not args.no_compile, profile=split(args.profile))
    res.summary["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"{res.summary}\nwrote {res.save()}", flush=True)


if __name__ == "__main__":
    main()
