"""Whole training step against what users already run: stock transformers, ``torch.compile``, Liger-Kernel (GPU).

One training step (forward with labels, backward, fused AdamW step, zero grad) of a transformers MoE model built from
its config at real layer dimensions (few layers, vocab 32000, random tokens), per variant and precision:

- ``stock``: eager transformers; ``compile``: ``torch.compile(model)``; ``liger``: ``apply_liger_kernel_to_<arch>``
  (where Liger has an entry for the architecture);
- ``fly``: ``fly_lightning.transform(model)``; ``fly_compile``: transform, then ``torch.compile``; ``liger_fly``: Liger,
  then the transform (composition); ``fly_compile_opaque``: ``fly_compile`` with every op opaque to Inductor (policy
  ``inductor_ops`` empty): the alternative that ``fly_compile``'s default policy is measured against.

Precisions: ``bf16-true`` (bf16 weights, no autocast) and ``bf16-mixed`` (fp32 weights, bf16 autocast; there stock
transformers runs its expert GEMMs in fp32, see the README). Each variant runs in its own process (Liger patches
classes), the variants in rotated order per round, ``stock`` twice per round as the noise floor. Reported per variant:
median step time over the steady-state steps, first-step (cold: compilation, autotuning) time apart, peak memory,
and the largest loss difference against ``stock`` over the same steps (same seed, data and initial weights).

    python -m benchmarks.bench_train_step --models qwen3_moe --precisions bf16-true --rounds 2
    python -m benchmarks.bench_train_step --worker qwen3_moe fly bf16-true   # one process (used by the driver)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.harness import Results, results_dir

VARIANTS = ("stock", "compile", "liger", "fly", "fly_compile", "liger_fly", "fly_compile_opaque")
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
    if variant == "fly_compile_opaque":
        fly_lightning.set_dispatch_config(inductor_ops=())
    if "compile" in variant:
        model = torch.compile(model)
    return model, info


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
    model, info = _build(case, variant, precision, device)
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
        times_ms=[round(t, 3) for t in times_ms],
        losses=losses,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        **info,
    )
    if "fly" in variant:
        import fly_lightning

        out["dispatch"] = {op: s["by_backend"] for op, s in fly_lightning.DISPATCH_LOG.summary().items()}
    return out


def _run_worker(model_name: str, variant: str, precision: str, timeout_s: int, profile: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_train_step", "--worker", model_name, variant, precision]
    cmd += ["--profile"] if profile else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return dict(model=model_name, variant=variant, precision=precision, error=f"timed out after {timeout_s} s")
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return dict(model=model_name, variant=variant, precision=precision, error=tail[:300])
    return json.loads(line)


def rotated(variants: list[str], rounds: int) -> list[list[str]]:
    """Each round's order: ``stock`` twice (its two runs give the noise floor), the rest rotated by one per round."""
    names = ["stock", "stock", *variants]
    return [names[r % len(names) :] + names[: r % len(names)] for r in range(rounds)]


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: median over runs of the steady-state median, first step, peak memory, loss difference to stock."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    ok = {v: [r for r in rs if "error" not in r] for v, rs in by.items()}
    stock = ok.get("stock", [])
    row: dict[str, Any] = {}
    for v, rs in by.items():
        good = ok[v]
        if not good:
            row[v] = {"error": rs[0]["error"]}
            continue
        entry = {
            "step_ms": statistics.median(r["step_ms"] for r in good),
            "runs_ms": [round(r["step_ms"], 2) for r in good],
            "first_step_s": max(r["first_step_s"] for r in good),
            "peak_gib": max((r["peak_gib"] or 0.0) for r in good),
        }
        if stock:
            ref = stock[0]["losses"]
            entry["max_loss_diff"] = max(abs(a - b) for a, b in zip(good[-1]["losses"], ref, strict=True))
        for key in ("swapped", "left", "dispatch", "profile_top"):
            if key in good[-1]:
                entry[key] = good[-1][key]
        row[v] = entry
    if len(stock) >= 2:
        a, b = stock[0]["step_ms"], stock[1]["step_ms"]
        row["noise"] = {"stock_vs_stock": abs(a - b) / min(a, b)}
        row["noise"]["stock_loss_diff"] = max(
            abs(x - y) for x, y in zip(stock[0]["losses"], stock[1]["losses"], strict=True)
        )
    timed = {v: e["step_ms"] for v, e in row.items() if v in VARIANTS and "step_ms" in e}
    base = {v: t for v, t in timed.items() if v in BASELINES}
    ours = {v: t for v, t in timed.items() if "fly" in v}
    if base and ours:
        best_base, best_ours = min(base, key=base.get), min(ours, key=ours.get)
        row["headline"] = {
            "best_baseline": best_base,
            "best_with_fly": best_ours,
            "speedup": base[best_base] / ours[best_ours],
        }
        for fly_v, alone in (("fly_compile", "compile"), ("liger_fly", "liger")):
            if fly_v in timed and alone in timed:
                row["headline"][f"{fly_v}_over_{alone}"] = timed[alone] / timed[fly_v]
    return row


def record(res: Results, model_name: str, precision: str, runs: list[dict[str, Any]]) -> None:
    """One row per variant (step time, its ratio against the fastest baseline, cold start, memory, losses); the
    headline and the noise floor in the summary; per-process details (swaps, dispatch, profiles) in the JSON only."""
    row = summarise(runs)
    head = row.get("headline") or {}
    best_base = row.get(head.get("best_baseline"), {}).get("step_ms")
    for v, e in row.items():
        if v not in VARIANTS:
            continue
        res.add(
            model=model_name,
            precision=precision,
            variant=v,
            step_ms=e.get("step_ms"),
            vs_best_baseline=best_base / e["step_ms"] if best_base and "step_ms" in e else None,
            runs_ms=e.get("runs_ms"),
            first_step_s=e.get("first_step_s"),
            peak_gib=e.get("peak_gib"),
            max_loss_diff=e.get("max_loss_diff"),
            error=e.get("error", ""),
        )
        res.details[f"{model_name}/{precision}/{v}"] = {
            k: e[k] for k in ("swapped", "left", "dispatch", "profile_top") if k in e
        }
    res.summary[f"{model_name}/{precision}"] = {**head, **row.get("noise", {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "VARIANT", "PRECISION"), help="run one variant, print JSON")
    p.add_argument("--models", default="qwen3_moe,olmoe,mixtral")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=int, default=900, help="seconds per worker process")
    p.add_argument("--profile", action="store_true", help="record each process's largest kernels over one step")
    p.add_argument("--from-runs", nargs="+", metavar="JSONL", help="summarise saved processes instead of running")
    p.add_argument("--env-from", nargs="+", metavar="JSON", help="with --from-runs: the invocations' result files")
    p.add_argument("--note", action="append", default=[], help="a note for the result (repeatable)")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, profile=args.profile)), flush=True)
        return
    res = Results("train_step")
    if args.from_runs:  # processes of several invocations on one machine (each has its own stock runs)
        runs = [json.loads(ln) for path in args.from_runs for ln in open(path) if ln.strip()]
        for key in dict.fromkeys((r["model"], r["precision"]) for r in runs):
            record(res, *key, [r for r in runs if (r["model"], r["precision"]) == key])
        envs = [json.loads(open(path).read())["environment"] for path in args.env_from or []]
        env = dict(envs[0], command=" ; ".join(e["command"] for e in envs)) if envs else None
        res.notes.append(
            f"summarised from the process records of {len(args.from_runs)} invocations; each model's variants and "
            "its two stock runs come from one invocation (one machine, one process per variant)"
        )
    else:
        variants = [v for v in args.variants.split(",") if v != "stock"]
        for model_name in args.models.split(","):
            arch = MODELS[model_name].arch
            arch_variants = [v for v in variants if not v.startswith("liger") or liger_entry(arch)]
            for precision in args.precisions.split(","):
                runs = []
                for order in rotated(arch_variants, args.rounds):
                    for v in order:
                        r = _run_worker(model_name, v, precision, args.timeout, args.profile)
                        with open(results_dir() / "train_step_runs.jsonl", "a") as f:  # kept if cut short
                            f.write(json.dumps(r) + "\n")
                        print(json.dumps({k: r.get(k) for k in ("variant", "step_ms", "first_step_s", "error")}))
                        runs.append(r)
                record(res, model_name, precision, runs)
    res.notes.append(
        f"{STEPS} steps per process, median over steps {WARMUP}..{STEPS - 1}; step = forward with labels, backward, "
        "fused AdamW, zero_grad, with a device sync at both ends; first_step_s = step 0 (compilation, autotuning)"
    )
    res.notes.append(
        "vs_best_baseline = the fastest of stock/compile/liger over this variant (> 1: faster); summary speedup = "
        "the same for the fastest variant with fly in it"
    )
    res.notes.extend(args.note)
    print(res.save(env=env if args.from_runs else None))
    print(res.markdown())


if __name__ == "__main__":
    main()
