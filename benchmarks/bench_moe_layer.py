"""MoE layer suite (GPU): one MoE block end to end (router, routing, experts,
combine) on real model shapes, bf16, forward and forward+backward, all variants on the same weights:

- ``hf_grouped_mm``: transformers' own block (v5) with its ``grouped_mm`` experts implementation: sort, permute,
  ``torch._grouped_mm``, SwiGLU, ``torch._grouped_mm``, weight, un-permute, sum. The layer users run today, and the
  baseline of the issue's "permute + grouped_mm + unpermute" (absent where transformers is not installed);
- ``plain_aten``: ``FlyMoE``'s plain path with every op on ATen (the same dataflow, our ATen composition);
- ``plain``: ``FlyMoE``'s plain path on the kernels (token rows copied into expert order);
- ``fused``: ``FlyMoE``'s fused path (token rows gathered inside the gate/up GEMM, no copy).

The ``FlyMoE`` variants wrap the transformers block (``FlyMoE.from_module``: shared parameters). Outputs are first
compared with ``hf_grouped_mm`` (else ``plain_aten``), then timed side by side: the variants take turns in rounds
(``harness.interleaved_ms``).

    python -m benchmarks.bench_moe_layer    # about 1 minute on an H200 (writes moe_layer.*)
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

import torch

from benchmarks.harness import Results, interleaved_ms
from fly_lightning import FlyMoE, dispatch_config

# transformers model type, hidden H, expert intermediate I, experts E, top-k, tokens T, renormalised top-k weights
MOE_MODELS = {
    "qwen3-30b-a3b": ("qwen3_moe", 2048, 768, 128, 8, 8192, True),
    "olmoe-1b-7b": ("olmoe", 2048, 1024, 64, 8, 8192, False),
    "mixtral-8x7b": ("mixtral", 4096, 14336, 8, 2, 4096, True),
}
FLY_VARIANTS = ("fused", "plain", "plain_aten")
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


def _layers(family, h, i, e, k, norm, device, dtype) -> dict[str, torch.nn.Module]:
    block = hf_block(family, h, i, e, k, norm, device, dtype)
    if block is None:
        torch.manual_seed(0)
        make = lambda path: FlyMoE(h, i, e, k, norm_topk_prob=norm, path=path, device=device, dtype=dtype)  # noqa: E731
        return {v: make("fused" if v == "fused" else "plain") for v in FLY_VARIANTS}
    layers = {"hf_grouped_mm": block}
    layers.update({v: FlyMoE.from_module(block, path="fused" if v == "fused" else "plain") for v in FLY_VARIANTS})
    return layers


def _call(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out  # some transformers blocks also return router logits


def run_moe(device: str = "cuda", models: dict | None = None, dtype: torch.dtype = torch.bfloat16,
            reps: tuple[int, int] = (24, 12)) -> Results:  # fmt: skip
    res = Results("moe_layer")
    models = models or MOE_MODELS
    for model, (family, h, i, e, k, t, norm) in models.items():
        x = torch.randn(1, t, h, device=device, dtype=dtype)  # transformers blocks take [B, S, H]
        grad = torch.randn_like(x)
        layers = _layers(family, h, i, e, k, norm, device, dtype)
        flops = 6.0 * t * k * h * i  # gate/up (2 x 2I x H) + down (2 x H x I) per routed row
        outs = {}
        for v, layer in layers.items():
            with torch.no_grad(), dispatch_config(backends=("aten",)) if v == "plain_aten" else nullcontext():
                outs[v] = _call(layer, x)
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
                       fwd_bwd_ms=round(fb_ms[v], 4), fwd_bwd_tflops=round(3 * flops / fb_ms[v] / 1e9, 1))  # fmt: skip
            res.add(**row)
        del layers, outs, x, grad
        if device == "cuda":
            torch.cuda.empty_cache()
    for model in models:
        r = {row["variant"]: row for row in res.rows if row["model"] == model}
        for other in ("hf_grouped_mm", "plain_aten", "plain"):
            for mode in ("fwd", "fwd_bwd"):
                if other in r:
                    res.summary[f"{model}_fused_over_{other}_{mode}"] = round(
                        r[other][f"{mode}_ms"] / r["fused"][f"{mode}_ms"], 3
                    )
    res.notes += [
        "x_over_y = y time / x time (> 1: x faster). fwd_bwd TFLOP/s counts 3x the forward GEMM FLOPs.",
        f"timing: the variants take turns in rounds (at least {ROUNDS}, a multiple of their number; order rotated each "
        "round), each reporting the median of its round medians (harness.interleaved_ms); forward first, then "
        "forward+backward.",
        "hf_grouped_mm: transformers' block with config._experts_implementation='grouped_mm' (the stock layer).",
        "Set fly_lightning.modules.moe.AUTO_PATH to the faster of fused/plain (FlyMoE(path='auto') uses it).",
    ]
    return res


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    start = time.perf_counter()
    res = run_moe()
    res.summary["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"{res.summary}\nwrote {res.save()}", flush=True)


if __name__ == "__main__":
    main()
