"""MoE layer benchmark (GPU), run by ``bench_grouped_mm --moe``: ``FlyMoE`` end to end (router, routing, experts,
combine) on real model shapes, bf16, forward and forward+backward:

- ``fused``: ``moe_grouped_mm`` gathers token rows inside the gate/up GEMM and scatters the down GEMM's rows to
  their slots (no permuted copies);
- ``plain``: gather -> ``grouped_mm`` -> SwiGLU -> ``grouped_mm`` -> un-permute, with the Triton kernel;
- ``plain_aten``: the same with every op on ATen (``torch._grouped_mm``): permute + grouped_mm + unpermute.

The routing is the same for all three (a randomly initialised router: uneven, realistic loads). Outputs are first
compared with each other. About 1 minute on an H200.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from benchmarks.harness import Results, time_ms
from fly_lightning import FlyMoE, dispatch_config

# hidden H, expert intermediate I, experts E, top-k, tokens T, renormalised top-k weights
MOE_MODELS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, 8192, True),
    "olmoe-1b-7b": (2048, 1024, 64, 8, 8192, False),
    "mixtral-8x7b": (4096, 14336, 8, 2, 4096, True),
}
VARIANTS = ("fused", "plain", "plain_aten")


def _layer(h, i, e, k, norm, path, device, dtype):
    torch.manual_seed(0)
    return FlyMoE(h, i, e, k, norm_topk_prob=norm, path=path, device=device, dtype=dtype)


def run_moe(device: str = "cuda", models: dict | None = None, dtype: torch.dtype = torch.bfloat16,
            reps: tuple[int, int] = (20, 10)) -> Results:  # fmt: skip
    res = Results("moe_layer")
    models = models or MOE_MODELS
    for model, (h, i, e, k, t, norm) in models.items():
        x = torch.randn(t, h, device=device, dtype=dtype)
        grad = torch.randn_like(x)
        layers = {v: _layer(h, i, e, k, norm, "fused" if v == "fused" else "plain", device, dtype) for v in VARIANTS}
        flops = 6.0 * t * k * h * i  # gate/up (2 x 2I x H) + down (2 x H x I) per routed row
        outs = {}
        for v, layer in layers.items():
            with torch.no_grad(), dispatch_config(backends=("aten",)) if v == "plain_aten" else nullcontext():
                outs[v] = layer(x)
        base = outs["plain_aten"].float()
        for v, layer in layers.items():
            xg = x.clone().requires_grad_()

            def fwd(a, layer=layer):
                with torch.no_grad():
                    return layer(a)

            def fwd_bwd(a, layer=layer, g=grad):
                layer.zero_grad(set_to_none=True)
                a.grad = None
                layer(a).backward(g)

            row = dict(model=model, variant=v, T=t, H=h, I=i, E=e, top_k=k,
                       max_abs_diff_vs_plain_aten=(outs[v].float() - base).abs().max().item(),
                       rel_err_vs_plain_aten=((outs[v].float() - base).norm() / base.norm()).item())  # fmt: skip
            with dispatch_config(backends=("aten",)) if v == "plain_aten" else nullcontext():
                fwd_ms = time_ms(fwd, [(x,)], warmup=3, reps=reps[0])["median_ms"]
                fb_ms = time_ms(fwd_bwd, [(xg,)], warmup=3, reps=reps[1])["median_ms"]
            row.update(fwd_ms=round(fwd_ms, 4), fwd_tflops=round(flops / fwd_ms / 1e9, 1), fwd_bwd_ms=round(fb_ms, 4),
                       fwd_bwd_tflops=round(3 * flops / fb_ms / 1e9, 1))  # fmt: skip
            res.add(**row)
        del layers, outs, x, grad
        if device == "cuda":
            torch.cuda.empty_cache()
    for model in models:
        r = {row["variant"]: row for row in res.rows if row["model"] == model}
        res.summary[f"{model}_fused_over_plain_fwd"] = round(r["plain"]["fwd_ms"] / r["fused"]["fwd_ms"], 3)
        res.summary[f"{model}_fused_over_plain_fwd_bwd"] = round(r["plain"]["fwd_bwd_ms"] / r["fused"]["fwd_bwd_ms"], 3)
        res.summary[f"{model}_fused_over_aten_fwd"] = round(r["plain_aten"]["fwd_ms"] / r["fused"]["fwd_ms"], 3)
        res.summary[f"{model}_plain_over_aten_fwd"] = round(r["plain_aten"]["fwd_ms"] / r["plain"]["fwd_ms"], 3)
    res.notes += [
        "x_over_y = y time / x time (> 1: x faster). fwd_bwd TFLOP/s counts 3x the forward GEMM FLOPs.",
        "Set fly_lightning.modules.moe.AUTO_PATH to the faster of fused/plain (FlyMoE(path='auto') uses it).",
    ]
    return res
