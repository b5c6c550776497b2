"""MX expert memory suite (GPU): bytes per expert parameter of one MoE block (Qwen3-30B-A3B dims), stored and at
the peak of a forward+backward, for the expert storage modes a fine-tuning run can pick:

- ``bf16_trained``: bf16 experts with gradients (the stock fine-tune);
- ``bf16_frozen``: bf16 experts with ``requires_grad=False`` (the fair baseline for frozen experts);
- ``mxfp8_trained``: ``FlyMXConfig()`` (MX forward numerics, bf16 master and gradients kept);
- ``mxfp8_frozen`` / ``mxfp4_frozen``: ``FlyMXConfig(frozen=True)`` (weight-only MX storage, no master, no weight
  gradient; experts re-dequantised in backward by saved-tensor hooks).

Per variant, in fresh blocks: ``stored_B_per_param`` (parameters and buffers of the experts after conversion),
``peak_B_per_param`` (``torch.cuda.max_memory_allocated`` over a forward+backward of 4 blocks, counted from before
the blocks existed: weights, gradients, activations and transients, per expert parameter), ``per_block_B_per_param``
(the peak's growth from 1 to 4 blocks: the cost that scales with depth) and the step's median time.

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


def build(variant: str, dims: tuple[int, ...], layers: int, device: str) -> nn.ModuleList:
    """``layers`` blocks in ``variant``'s storage mode (weights from one seed), as a model holds them."""
    from torchao.quantization import quantize_

    from fly_lightning import FlyMXConfig

    h, i, e, k, _ = dims
    torch.manual_seed(0)
    blocks = nn.ModuleList(FlyMoE(h, i, e, k, norm_topk_prob=True, device=device, dtype=torch.bfloat16)
                           for _ in range(layers))  # fmt: skip
    for p in blocks.parameters():
        nn.init.normal_(p, std=0.02)
    experts = lambda m, fqn: isinstance(m, FlyMoE)  # noqa: E731 (the experts only: the router stays bf16)
    if variant == "bf16_frozen":
        for b in blocks:
            b.experts.requires_grad_(False)
    elif variant == "mxfp8_trained":
        quantize_(blocks, FlyMXConfig(), filter_fn=experts)
    elif variant == "mxfp8_frozen":
        quantize_(blocks, FlyMXConfig(activation=None, frozen=True), filter_fn=experts)
    elif variant == "mxfp4_frozen":
        quantize_(blocks, FlyMXConfig("mxfp4_e2m1", activation=None, frozen=True), filter_fn=experts)
    return blocks


def _bytes(modules: list[nn.Module]) -> int:
    return sum(t.numel() * t.element_size() for m in modules for t in [*m.parameters(), *m.buffers()])


def measure(variant: str, dims: tuple[int, ...], layers: int, device: str, reps: int) -> dict:
    """Stored expert bytes, expert gradient bytes, the peak allocation of a forward+backward over ``layers`` blocks
    (residual stream, gradients already allocated) counted from before the blocks existed, and the step time."""
    cuda = device == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
    blocks = build(variant, dims, layers, device)
    x = torch.randn(dims[4], dims[0], device=device, dtype=torch.bfloat16, requires_grad=True)

    def step(a: torch.Tensor, blocks: nn.ModuleList = blocks) -> None:
        blocks.zero_grad(set_to_none=False)  # gradients persist between steps, as in training
        for b in blocks:
            a = a + b(a)
        a.float().pow(2).mean().backward()

    step(x)  # allocates the gradients (kept: a training step holds them until the optimizer runs)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # after conversion: its transient copies are not the step's
        step(x)
        peak = torch.cuda.max_memory_allocated() - base
    ms = time_ms(step, [(x,)], warmup=1, reps=reps)["median_ms"] if cuda else float("nan")
    experts = [b.experts for b in blocks]
    out = dict(stored=_bytes(experts), peak=peak if cuda else 0, ms=ms,
               grads=sum(p.grad.numel() * p.grad.element_size() for m in experts for p in m.parameters()
                         if p.grad is not None))  # fmt: skip
    del blocks, x
    return out


def run(device: str = "cuda", dims: tuple[int, ...] = DIMS, layers: tuple[int, int] = (1, 4), reps: int = 6) -> Results:
    res = Results("mx_memory")
    h, i, e, k, t = dims
    n_params = e * 3 * h * i  # gate, up and down of every expert, per block
    lo, hi = layers
    for variant in VARIANTS:
        one, many = (measure(variant, dims, n, device, reps) for n in (lo, hi))
        res.add(variant=variant, expert_params_per_block=n_params,
                stored_B_per_param=round(many["stored"] / (hi * n_params), 4),
                grad_B_per_param=round(many["grads"] / (hi * n_params), 4),
                peak_B_per_param=round(many["peak"] / (hi * n_params), 4),
                per_block_B_per_param=round((many["peak"] - one["peak"]) / ((hi - lo) * n_params), 4),
                peak_GiB=round(many["peak"] / 2**30, 3), step_ms=round(many["ms"], 3))  # fmt: skip
        if device == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
    r = {row["variant"]: row for row in res.rows}
    for v in VARIANTS[2:] if device == "cuda" else ():
        for base in ("bf16_trained", "bf16_frozen"):
            for col in ("peak", "per_block"):
                key = f"{col}_B_per_param"
                res.summary[f"{v}_{col}_over_{base}"] = round(r[v][key] / r[base][key], 3)
    res.notes += [
        f"{hi} FlyMoE blocks (and {lo}, for the per-block cost) on a residual stream, H={h} I={i} E={e} top-{k}, "
        f"{t} tokens, bf16; the routers stay bf16 in every variant.",
        "stored_B_per_param: the experts' parameters and buffers after conversion; grad_B_per_param: their gradients.",
        f"peak_B_per_param: max_memory_allocated over a forward+backward of {hi} blocks (gradients already "
        "allocated), counted from before the blocks existed, per expert parameter: stored weights, gradients, saved "
        "activations, dequantised operands and workspace together.",
        f"per_block_B_per_param: (peak with {hi} blocks - peak with {lo}) / ({hi - lo} blocks' expert parameters): "
        "what each further block costs at the peak, i.e. what scales with the model's depth.",
        "frozen variants are weight-only (bf16 activations x MX weights); mxfp8_trained casts activations too.",
        "step_ms: forward+backward of the blocks alone (no optimizer), median.",
    ]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny dims on the CPU: checks that every variant runs")
    args = p.parse_args()
    logging.getLogger("torchao").setLevel(logging.ERROR)
    start = time.perf_counter()
    if args.smoke:
        res = run("cpu", (64, 64, 4, 2, 32), layers=(1, 2), reps=1)
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    res = run()
    res.summary["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"{res.summary}\nwrote {res.save()}", flush=True)


if __name__ == "__main__":
    main()
