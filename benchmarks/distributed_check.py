"""Multi-GPU check (NCCL): DDP and FSDP2 variants on a small MoE LM, against the stock strategies.

Each run is its own process group (Lightning re-executes this module for rank 1). bf16-true so the Triton grouped
GEMM and routing kernels serve the MoE layers; losses are compared step by step with a bf16 tolerance.

    python -m benchmarks.distributed_check            # driver: 4 runs on 2 GPUs, writes distributed_check.json/.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = ["ddp", "flydsl_ddp", "stock_fsdp2", "flydsl_fsdp2"]
STEPS = 12


def run_one(strategy_name: str, out: str) -> None:
    import lightning.pytorch as L
    import torch

    import fly_lightning
    from fly_lightning.recipes.data import MarkovLMData
    from fly_lightning.recipes.moe_finetune import MoECausalLM

    losses: list[float] = []

    class Recorder(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"].detach().float()))

    torch.manual_seed(0)
    model = MoECausalLM(
        hidden_size=512,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        num_experts=8,
        experts_per_token=2,
        expert_intermediate_size=512,
        max_seq_len=512,
        lr=1e-3,
        warmup_steps=2,
    )
    strategy: object = strategy_name
    if strategy_name == "stock_fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        from fly_lightning.strategies import _auto_fully_shard

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        model.configure_model = lambda: _auto_fully_shard(trainer.strategy, model.model)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu",
        devices=2,
        precision="bf16-true",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Recorder()],
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, MarkovLMData(seq_len=257, batch_size=4, n_train=512))
    if trainer.global_rank == 0:
        s = getattr(trainer.strategy, "transform_summary", None)
        Path(out).write_text(
            json.dumps(
                {
                    "strategy": type(trainer.strategy).__name__,
                    "losses": losses,
                    "dispatch": fly_lightning.DISPATCH_LOG.summary(),
                    "swapped": [] if s is None else [m for _, _, m in s.swapped],
                    "left": [] if s is None else s.left,
                },
                default=str,
            )
        )


def main() -> int:
    from benchmarks.harness import Results

    res = Results("distributed_check")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            out = Path(tmp) / f"{name}.json"
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.distributed_check", "--run", name, str(out)],
                env=env,
                capture_output=True,
                text=True,
                timeout=400,
            )
            ok = proc.returncode == 0 and out.exists()
            runs[name] = json.loads(out.read_text()) if ok else {"error": proc.stderr[-3000:]}
            print(name, "ok" if ok else "FAILED", flush=True)
            if not ok:
                print(proc.stderr[-3000:], flush=True)
    failures = 0
    for fly, stock in (("flydsl_ddp", "ddp"), ("flydsl_fsdp2", "stock_fsdp2")):
        a, b = runs[fly], runs[stock]
        if "error" in a or "error" in b:
            res.add(pair=f"{fly} vs {stock}", ok=False, error=(a.get("error") or b.get("error"))[-500:])
            failures += 1
            continue
        diffs = [abs(x - y) / max(abs(y), 1e-6) for x, y in zip(a["losses"], b["losses"], strict=True)]
        by_backend = {op: s["by_backend"] for op, s in a["dispatch"].items()}
        ok = max(diffs) < 3e-2 and len(a["losses"]) == STEPS
        failures += not ok
        res.add(
            pair=f"{fly} vs {stock}",
            ok=ok,
            max_rel_loss_diff=max(diffs),
            fly_losses=a["losses"],
            stock_losses=b["losses"],
            fly_strategy=a["strategy"],
            swapped=sorted(set(a["swapped"])),
            left=a["left"],
            by_backend=by_backend,
        )
    res.summary = {"pairs_ok": 2 - failures, "tolerance_rel": 3e-2, "steps": STEPS, "precision": "bf16-true"}
    res.notes.append("2 GPUs, NCCL; small Qwen3-MoE (hidden 512, 2 layers, 8 experts top-2), seq 256, batch 4/rank")
    res.save()
    print(res.markdown())
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--run":
        run_one(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
