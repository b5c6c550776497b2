"""Two GPUs over NCCL: ``flydsl_ddp`` and ``flydsl_fsdp2`` against Lightning's stock DDP and FSDP2 on a small MoE LM.

Each strategy trains in its own process group (a child process: ``python tests/gpu/test_distributed.py --run <name>
<out.json>``; Lightning re-runs that command for rank 1). bf16-true, so the Triton grouped GEMM and routing kernels
serve the MoE layers; the losses are compared step by step with a bf16 tolerance, and the fly runs must have served
calls on Triton. Skipped with fewer than two CUDA devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

RUNS = ("ddp", "flydsl_ddp", "stock_fsdp2", "flydsl_fsdp2")
PAIRS = (("flydsl_ddp", "ddp"), ("flydsl_fsdp2", "stock_fsdp2"))
STEPS = 12
TOLERANCE = 3e-2  # relative, per step
RUN_TIMEOUT_S = 300
# NVLink multicast stays off (the device machines' rule), also in the children's environment
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run_one(strategy_name: str, out: str) -> None:
    """Train ``STEPS`` steps with one strategy on 2 GPUs; rank 0 writes the losses and the dispatch summary."""
    import lightning.pytorch as L

    import fly_lightning
    from fly_lightning.recipes.data import LMData
    from fly_lightning.recipes.moe_finetune import MoECausalLM

    losses: list[float] = []

    class Recorder(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"].detach().float()))

    torch.manual_seed(0)
    model = MoECausalLM(hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=4, num_experts=8, experts_per_token=2,
                        expert_intermediate_size=512, max_seq_len=512, lr=1e-3, warmup_steps=2)  # fmt: skip
    strategy: object = strategy_name
    if strategy_name == "stock_fsdp2":  # Lightning's own ModelParallelStrategy, sharded as flydsl_fsdp2 shards
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
    trainer.fit(model, LMData(seq_len=257, batch_size=4, n_train=512))
    if trainer.global_rank == 0:
        s = getattr(trainer.strategy, "transform_summary", None)
        result = {
            "strategy": type(trainer.strategy).__name__,
            "losses": losses,
            "dispatch": fly_lightning.DISPATCH_LOG.summary(),
            "swapped": [] if s is None else [m for _, _, m in s.swapped],
            "left": [] if s is None else s.left,
        }
        Path(out).write_text(json.dumps(result, default=str))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each strategy's rank-0 result, or ``{"error": ...}``."""
    tmp = tmp_path_factory.mktemp("distributed")
    env = dict(os.environ, TRITON_INTERPRET="0", **NO_MULTICAST)
    out: dict[str, dict] = {}
    for name in RUNS:
        path = tmp / f"{name}.json"
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run", name, str(path)], env=env,
                                  capture_output=True, text=True, timeout=RUN_TIMEOUT_S)  # fmt: skip
            if proc.returncode == 0 and path.exists():
                out[name] = json.loads(path.read_text())
            else:
                out[name] = {"error": f"rc={proc.returncode}\n{proc.stderr[-3000:]}"}
        except subprocess.TimeoutExpired as exc:
            out[name] = {"error": f"timed out after {exc.timeout} s"}
    return out


@pytest.mark.parametrize("fly, stock", PAIRS, ids=[f"{a}-vs-{b}" for a, b in PAIRS])
def test_fly_strategy_matches_the_stock_one(runs, fly, stock, record_property):
    a, b = runs[fly], runs[stock]
    assert "error" not in b, f"{stock}: {b.get('error')}"
    assert "error" not in a, f"{fly}: {a.get('error')}"
    assert len(a["losses"]) == len(b["losses"]) == STEPS
    diffs = [abs(x - y) / max(abs(y), 1e-6) for x, y in zip(a["losses"], b["losses"], strict=True)]
    record_property("max_rel_loss_diff", max(diffs))
    record_property("fly_losses", json.dumps([round(v, 5) for v in a["losses"]]))
    record_property("stock_losses", json.dumps([round(v, 5) for v in b["losses"]]))
    record_property("fly_dispatch", json.dumps({op: s["by_backend"] for op, s in a["dispatch"].items()}))
    record_property("fly_swapped", json.dumps(sorted(set(a["swapped"]))))
    assert max(diffs) < TOLERANCE, f"losses differ by up to {max(diffs):.3g} (relative)"
    # the comparison means something only if the fly run ran kernels
    served = {op: s["by_backend"] for op, s in a["dispatch"].items()}
    assert any(b.get("triton", 0) > 0 for b in served.values()), f"nothing served by Triton: {served}"


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--run":
        run_one(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"usage: {sys.argv[0]} --run <strategy> <out.json> (the test runs it; see the module docstring)")
