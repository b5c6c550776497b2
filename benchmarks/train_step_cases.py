"""The whole-step benchmark's cases and its worker (``bench_train_step``, ``bench_cold_start``): transformers MoE
models at real layer dimensions, the variants users run them as, and one variant's training steps in a process of
its own (``python -m benchmarks.train_step_cases MODEL VARIANT PRECISION`` prints its JSON)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

REST_VARIANTS = ("compile_rest", "liger_rest")
"""Measurement-only variants for the step's bound (``goal_bounds``): the baseline with every MoE block's forward and
backward taken out (a zero output, zero gradients handed to the optimizer for the block's parameters), i.e. what the
step costs outside the blocks our operators replace. Never a baseline, never a result."""

VARIANTS = ("stock", "compile", "liger", "fly", "fly_compile", "liger_fly", "fly_compile_opaque", *REST_VARIANTS)
BASELINES = ("stock", "compile", "liger")  # what users already run; every ratio is against the fastest of these
PRECISIONS = ("bf16-true", "bf16-mixed")
STEPS, WARMUP = 16, 4
VOCAB = 32000


@dataclass(frozen=True)
class ModelCase:
    """A transformers model at one real model's layer dimensions, with fewer layers."""

    arch: str  # transformers model_type, and Liger's apply_liger_kernel_to_<arch>
    config: dict[str, Any]
    batch: int
    seq: int


MODELS: dict[str, ModelCase] = {
    "qwen3_moe": ModelCase(  # Qwen3-30B-A3B layer dims, 2 layers, 8192 tokens/step
        "qwen3_moe",
        dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
             num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=32,
             num_key_value_heads=4, head_dim=128),
        4, 2048,
    ),
    "olmoe": ModelCase(  # OLMoE-1B-7B layer dims, 2 layers, 8192 tokens/step
        "olmoe",
        dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
             num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16),
        4, 2048,
    ),
    "mixtral": ModelCase(  # Mixtral-8x7B layer dims, 1 layer, 4096 tokens/step
        "mixtral",
        dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
             num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8),
        2, 2048,
    ),
    "tiny_qwen3_moe": ModelCase(  # CPU smoke test of the harness only
        "qwen3_moe",
        dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
             norm_topk_prob=True, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        2, 32,
    ),
}  # fmt: skip


def liger_entry(arch: str):
    """Liger-Kernel's ``apply_liger_kernel_to_<arch>``, or None (not installed, or no entry for the architecture)."""
    try:
        import liger_kernel.transformers as lk
    except ImportError:
        return None
    return getattr(lk, f"apply_liger_kernel_to_{arch}", None)


def _build(case: ModelCase, variant: str, precision: str, device: torch.device) -> tuple[torch.nn.Module, dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    info: dict[str, Any] = {}
    if variant.startswith("liger"):
        apply = liger_entry(case.arch)
        if apply is None:
            raise LookupError(f"no Liger-Kernel entry for {case.arch}")
        apply()  # patches transformers' classes before the model is built, as Liger's README shows
    cfg = AutoConfig.for_model(case.arch, vocab_size=VOCAB, max_position_embeddings=case.seq, **case.config)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.train()
    if "fly" in variant:
        import fly_lightning

        summary = fly_lightning.transform(model)
        info["swapped"] = sorted({f"{cls} -> {how}" for _, cls, how in summary.swapped})
        info["left"] = sorted({f"{cls}: {why}" for _, cls, why in summary.left})
    if variant in REST_VARIANTS:
        info["moe_params"] = _stand_in_moe_blocks(model)
    if variant == "fly_compile_opaque":
        fly_lightning.set_dispatch_config(inductor_ops=())
    if "compile" in variant:
        model = torch.compile(model)
    return model, info


def _stand_in_moe_blocks(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Make every transformers MoE block (``*SparseMoeBlock``) return zeros without computing; returns its
    parameters, to which the step hands zero gradients so the optimizer's work stays that of the full model."""
    blocks = [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
    if not blocks:
        raise LookupError("no *SparseMoeBlock module to stand in for")
    for block in blocks:
        block.forward = lambda hidden_states: torch.zeros_like(hidden_states)
    return [p for block in blocks for p in block.parameters()]


def _batches(case: ModelCase, device: torch.device, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (case.batch, case.seq), generator=g).to(device) for _ in range(n)]


def _profile_step(model, opt, autocast, ids: torch.Tensor, top: int = 30) -> list[dict[str, Any]]:
    """Device time per kernel over one more step (torch.profiler), the ``top`` largest: where the step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    rows = [
        {"kernel": e.key[:240], "ms": e.self_device_time_total / 1e3, "calls": e.count}
        for e in prof.key_averages()
        if e.self_device_time_total > 0
    ]
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    return [{"total_ms": total}, *rows[:top]]


def worker(model_name: str, variant: str, precision: str, profile: bool = False) -> dict[str, Any]:
    """Run one variant in this process: per-step times, losses, peak memory, dispatch coverage; with ``profile``, the
    largest kernels of one more step."""
    case = MODELS[model_name]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t_build = time.perf_counter()
    model, info = _build(case, variant, precision, device)
    build_s = time.perf_counter() - t_build
    moe_params = info.pop("moe_params", [])
    zero_grads = [torch.zeros_like(p) for p in moe_params]  # allocated once: handing them over costs nothing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    times_ms, losses = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for ids in _batches(case, device, STEPS):
        sync()
        t0 = time.perf_counter()
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for p, g in zip(moe_params, zero_grads, strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times_ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(loss.detach().float()))
    if profile and device.type == "cuda":
        info["profile_top"] = _profile_step(model, opt, autocast, ids)
    out = dict(
        model=model_name,
        variant=variant,
        precision=precision,
        step_ms=statistics.median(times_ms[WARMUP:]),
        first_step_s=times_ms[0] / 1e3,
        build_s=build_s,
        times_ms=[round(t, 3) for t in times_ms],
        losses=losses,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        **info,
    )
    if "fly" in variant:
        import fly_lightning

        out["dispatch"] = {op: s["by_backend"] for op, s in fly_lightning.DISPATCH_LOG.summary().items()}
        out["tuning_spent_s"] = fly_lightning.tuning.spent_s()  # measuring candidates and configurations
    return out


def run_worker(
    model_name: str, variant: str, precision: str, timeout_s: int, profile: bool = False, env: dict | None = None
) -> dict[str, Any]:
    """``worker`` in a process of its own (``env``: its environment, default this one's); its JSON, or an error."""
    cmd = [sys.executable, "-m", "benchmarks.train_step_cases", model_name, variant, precision]
    cmd += ["--profile"] if profile else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env or os.environ.copy())
    except subprocess.TimeoutExpired:
        return dict(model=model_name, variant=variant, precision=precision, error=f"timed out after {timeout_s} s")
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return dict(model=model_name, variant=variant, precision=precision, error=tail[:300])
    return json.loads(line)


if __name__ == "__main__":
    _args = sys.argv[1:]
    _profile = "--profile" in _args
    _model, _variant, _precision = [a for a in _args if a != "--profile"]
    print(json.dumps(worker(_model, _variant, _precision, profile=_profile)), flush=True)
