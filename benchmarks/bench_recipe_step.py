"""End-to-end step time of the MoE recipe model: ``strategy="flydsl"`` against the stock single-device strategy (GPU).

What a user sees: the whole training step (forward, backward, optimizer; eager, ``bf16-mixed``), not one operator.
The two strategies run alternately on the same model configuration, seed and data, twice each; the median step time
over the steady-state steps (after ``WARMUP`` steps, so compilation and autotuning stay out) is reported per run,
with the losses compared step by step.

    python -m benchmarks.bench_recipe_step        # writes recipe_step.json/.md
"""

from __future__ import annotations

import statistics
import time

import lightning.pytorch as L
import torch

import fly_lightning
from benchmarks.harness import Results
from fly_lightning.recipes.data import LMData
from fly_lightning.recipes.moe_finetune import MoECausalLM

STEPS, WARMUP = 40, 10
CONFIGS = {
    # the recipe's GPU run (benchmarks/gpu_session.sh, phase recipe): host-bound, a small model
    "recipe-1024": dict(hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=4, num_experts=16,
                        experts_per_token=4, expert_intermediate_size=768, seq_len=1025, batch_size=8),
    # OLMoE-1B-7B-like layers (width, 64 experts, top-8), two of them: device-bound
    "olmoe-like-2L": dict(hidden_size=2048, num_layers=2, num_heads=16, num_kv_heads=16, num_experts=64,
                          experts_per_token=8, expert_intermediate_size=1024, seq_len=2049, batch_size=4),
}  # fmt: skip


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times_ms: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        self.times_ms.append((time.perf_counter() - self._t0) * 1e3)
        self.losses.append(float(outputs["loss"].detach().float()))


def fit(cfg: dict, strategy: str) -> StepTimer:
    cfg = dict(cfg)
    seq_len, batch_size = cfg.pop("seq_len"), cfg.pop("batch_size")
    torch.manual_seed(0)
    model = MoECausalLM(**cfg, max_seq_len=seq_len + 1, warmup_steps=2)
    data = LMData(seq_len=seq_len, batch_size=batch_size, n_train=batch_size * (STEPS + 1))
    timer = StepTimer()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model, data)
    return timer


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="run the configurations whose name contains this")
    only = p.parse_args().only
    res = Results("recipe_step")
    for name, cfg in CONFIGS.items():
        if only and only not in name:
            continue
        runs: dict[str, list[StepTimer]] = {"auto": [], "flydsl": []}
        for _ in range(2):
            for strategy in ("auto", "flydsl"):
                fly_lightning.DISPATCH_LOG.reset()
                runs[strategy].append(fit(cfg, strategy))
        dispatch = {op: s["by_backend"] for op, s in fly_lightning.DISPATCH_LOG.summary().items()}
        tokens = cfg["batch_size"] * (cfg["seq_len"] - 1)
        med = {s: [statistics.median(t.times_ms[WARMUP:]) for t in ts] for s, ts in runs.items()}
        stock, fly = statistics.median(med["auto"]), statistics.median(med["flydsl"])

        def diff(a: StepTimer, b: StepTimer) -> float:
            return max(abs(x - y) for x, y in zip(a.losses, b.losses, strict=True))

        # the control: two stock runs of the same seed (nondeterministic kernels, chaotic training) set the scale
        loss_diff, stock_diff = diff(runs["auto"][0], runs["flydsl"][0]), diff(runs["auto"][0], runs["auto"][1])
        row = dict(
            config=name,
            tokens_per_step=tokens,
            stock_step_ms=round(stock, 2),
            fly_step_ms=round(fly, 2),
            speedup=round(stock / fly, 3),
            stock_runs_ms=[round(v, 2) for v in med["auto"]],
            fly_runs_ms=[round(v, 2) for v in med["flydsl"]],
            fly_tokens_per_s=round(tokens / fly * 1e3),
            max_loss_diff=round(loss_diff, 4),
            max_loss_diff_stock_vs_stock=round(stock_diff, 4),
            first_step_loss_diff=round(abs(runs["auto"][0].losses[0] - runs["flydsl"][0].losses[0]), 5),
            final_loss_stock=round(runs["auto"][0].losses[-1], 4),
            final_loss_fly=round(runs["flydsl"][0].losses[-1], 4),
            fly_dispatch=str(dispatch),
        )
        print(row, flush=True)
        res.add(**row)
        res.summary[f"{name}_losses"] = {s: [[round(v, 4) for v in t.losses] for t in ts] for s, ts in runs.items()}
    res.notes.append(
        f"bf16-mixed, eager, AdamW; {STEPS} steps per run, median over steps {WARMUP}..{STEPS}; each strategy run "
        "twice, alternating; step = on_train_batch_start..end with a device sync at both ends"
    )
    res.notes.append("speedup = stock / fly step time (> 1: fly faster)")
    print(res.save())


if __name__ == "__main__":
    main()
