"""MX expert memory suite (GPU): bytes per expert parameter of one MoE block (Qwen3-30B-A3B dims), stored and at
the peak of a forward+backward, for the expert storage modes a fine-tuning run can pick:

- ``bf16_trained``: bf16 experts with gradients (the stock fine-tune);
- ``bf16_frozen``: bf16 experts with ``requires_grad=False`` (the fair baseline for frozen experts);
- ``mxfp8_trained``: ``FlyMXConfig()`` (MX forward numerics, bf16 master and gradients kept);
- ``mxfp8_frozen`` / ``mxfp4_frozen``: ``FlyMXConfig(frozen=True)`` (weight-only MX storage, no master, no weight
  gradient; experts re-dequantised in backward by saved-tensor hooks).

Per variant, in a fresh block: ``stored_B_per_param`` (parameters and buffers of the experts after conversion),
``peak_B_per_param`` (``torch.cuda.max_memory_allocated`` over one forward+backward, minus what was allocated
before the input existed, i.e. weights, gradients and activations, per expert parameter) and the step's median time.
Inputs and their gradients are counted in the peak alike for every variant.

    python -m benchmarks.bench_mx_memory           # about 1 minute on an H200 (writes mx_memory.*)
"""

from __future__ import annotations

import argparse
import gc
import logging
import time

import torch
from torch import nn

from benchmarks.harness import Results, time_ms
from fly_lightning import FlyMoE

# hidden, expert intermediate, experts, top-k, tokens (Qwen3-30B-A3B layer dims, one block)
DIMS = (2048, 768, 128, 8, 8192)
VARIANTS = ("bf16_trained", "bf16_frozen", "mxfp8_trained", "mxfp8_frozen", "mxfp4_frozen")


def build(variant: str, dims: tuple[int, ...], device: str) -> nn.Module:
    """One block in ``variant``'s storage mode (weights from one seed), inside a container as a model holds it."""
    from torchao.quantization import quantize_

    from fly_lightning import FlyMXConfig

    h, i, e, k, _ = dims
    torch.manual_seed(0)
    moe = FlyMoE(h, i, e, k, norm_topk_prob=True, device=device, dtype=torch.bfloat16)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.02)
    model = nn.ModuleDict({"mlp": moe})
    experts = lambda m, fqn: isinstance(m, FlyMoE)  # noqa: E731 (the experts only: the router stays bf16)
    if variant == "bf16_frozen":
        moe.experts.requires_grad_(False)
    elif variant == "mxfp8_trained":
        quantize_(model, FlyMXConfig(), filter_fn=experts)
    elif variant == "mxfp8_frozen":
        quantize_(model, FlyMXConfig(activation=None, frozen=True), filter_fn=experts)
    elif variant == "mxfp4_frozen":
        quantize_(model, FlyMXConfig("mxfp4_e2m1", activation=None, frozen=True), filter_fn=experts)
    return model


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def run(device: str = "cuda", dims: tuple[int, ...] = DIMS, reps: int = 10) -> Results:
    res = Results("mx_memory")
    h, i, e, k, t = dims
    n_params = e * 3 * h * i  # gate, up and down of every expert
    cuda = device == "cuda"
    for variant in VARIANTS:
        model = build(variant, dims, device)
        moe = model["mlp"]
        stored = _bytes(moe.experts)
        if cuda:
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16, requires_grad=True)

        def step(a: torch.Tensor, model: nn.Module = model) -> None:
            model.zero_grad(set_to_none=False)  # gradients persist between steps, as in training
            model["mlp"](a).float().pow(2).mean().backward()

        step(x)  # allocates the gradients (kept: a training step holds them until the optimizer runs)
        peak = (torch.cuda.max_memory_allocated() - before) if cuda else 0
        ms = time_ms(step, [(x,)], warmup=2, reps=reps)["median_ms"] if cuda else float("nan")
        grads = sum(p.grad.numel() * p.grad.element_size() for p in moe.experts.parameters() if p.grad is not None)
        res.add(variant=variant, experts_params=n_params, stored_B_per_param=round(stored / n_params, 4),
                grad_B_per_param=round(grads / n_params, 4), peak_B_per_param=round(peak / n_params, 4),
                peak_GiB=round(peak / 2**30, 3), step_ms=round(ms, 3))  # fmt: skip
        del model, moe, x
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    r = {row["variant"]: row for row in res.rows}
    for v in VARIANTS[2:] if cuda else ():
        for base in ("bf16_trained", "bf16_frozen"):
            res.summary[f"{v}_peak_over_{base}"] = round(r[v]["peak_B_per_param"] / r[base]["peak_B_per_param"], 3)
    res.notes += [
        f"one FlyMoE block, H={h} I={i} E={e} top-{k}, {t} tokens, bf16; the router stays bf16 in every variant.",
        "stored_B_per_param: the experts' parameters and buffers after conversion; grad_B_per_param: their gradients.",
        "peak_B_per_param: max_memory_allocated over a forward+backward (gradients already allocated) minus the "
        "allocation before the input, per expert parameter: stored weights, gradients, saved activations, "
        "dequantised operands and workspace together.",
        "frozen variants are weight-only (bf16 activations x MX weights); mxfp8_trained casts activations too.",
    ]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny dims on the CPU: checks that every variant runs")
    args = p.parse_args()
    logging.getLogger("torchao").setLevel(logging.ERROR)
    start = time.perf_counter()
    if args.smoke:
        res = run("cpu", (64, 64, 4, 2, 32), reps=1)
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    res = run()
    res.summary["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"{res.summary}\nwrote {res.save()}", flush=True)


if __name__ == "__main__":
    main()
