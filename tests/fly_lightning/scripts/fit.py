"""A short Lightning fit used by the strategy tests, run as a subprocess (multi-process Lightning re-executes argv).

    python fit.py STRATEGY DEVICES OUT.json [moe] [mx] [frozen]

STRATEGY is a registered name, ``stock_fsdp2``, or ``flydsl_tp`` / ``stock_tp`` (tensor parallel over all devices,
sequence-parallel norms as in torchtitan, the plan applied by the user in ``configure_model``).

``mx``: a ``flydsl*`` strategy (``flydsl_tp`` too) gets ``quantization=FlyMXConfig()`` (converted before DDP wraps
or FSDP2 shards).
``frozen``: ``FlyMXConfig(frozen=True)`` instead (under DDP each rank initialising its model from another seed); every
rank writes, for its frozen MX tensors, a checksum and the bytes it holds to OUT.json.rank<N>, and rank 0 the bytes of
buffers DDP syncs per step.

Writes the per-step losses, the strategy class, the dispatch summary and the transform summary of rank 0 to OUT.json.
"""

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import fly_lightning  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class TinyLM(L.LightningModule):
    def __init__(self, d: int = 32, vocab: int = 64, n_layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.head = nn.Linear(d, vocab)
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        logits = self(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        tokens = batch[0]
        logits = self(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.val_losses.append(float(loss.detach()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _tensor_parallel(model: TinyLM, tp_mesh) -> None:
    """torchtitan's plan: norms sequence-parallel (their inputs are DTensors sharded on the sequence dim)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    for block in model.layers:
        plan = {
            "norm": SequenceParallel(),
            "ff": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "ff.0": ColwiseParallel(),
            "ff.2": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize_module(block, tp_mesh, plan)
    top = {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(model, tp_mesh, top)


class TinyMoELM(TinyLM):
    """A two-layer Qwen3-MoE from transformers (8 experts, top-2): the norms and MoE blocks get swapped."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        from fly_lightning.recipes.moe_finetune import build_hf_model

        self.model = build_hf_model("qwen3_moe", 64, 32, 2, 4, 2, 8, 2, 24, 64)
        self.losses, self.val_losses = [], []

    def forward(self, tokens):
        return self.model(tokens).logits


class SyncedBuffers(L.Callback):
    """The bytes of buffers DDP sends from rank 0 before every forward (``broadcast_buffers``), read in training
    (teardown unwraps the model)."""

    bytes = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        buffers = getattr(trainer.strategy.model, "modules_buffers", [])
        self.bytes = sum(b.numel() * b.element_size() for b in buffers)


def main() -> None:
    strategy, devices, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    name, extras = strategy, sys.argv[4:]
    rank = int(os.environ.get("LOCAL_RANK", 0))
    # frozen under DDP: the ranks start apart, the strategy must make their buffers equal (FSDP2 shards what each rank
    # holds, broadcasting nothing: there, as for any FSDP2 model, the ranks start alike)
    torch.manual_seed(rank if "frozen" in extras and "ddp" in strategy else 0)
    model = TinyMoELM() if "moe" in extras else TinyLM()
    data = torch.randint(0, 64, (64, 17), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8, shuffle=False)
    quantization = fly_lightning.FlyMXConfig(frozen="frozen" in extras) if {"mx", "frozen"} & set(extras) else None
    if strategy == "stock_fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
        from fly_lightning.strategies import _auto_fully_shard

        model.configure_model = lambda: _auto_fully_shard(trainer.strategy, model)
    elif quantization and strategy.startswith("flydsl") and strategy != "flydsl_tp":
        cls = L.strategies.StrategyRegistry[strategy]["strategy"]
        strategy = cls(quantization=quantization, report=False)
    elif strategy in ("flydsl_tp", "stock_tp"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        cls = fly_lightning.FlyModelParallelStrategy if strategy == "flydsl_tp" else ModelParallelStrategy
        quant = {"quantization": quantization} if quantization and strategy == "flydsl_tp" else {}
        strategy = cls(data_parallel_size=1, tensor_parallel_size=devices, **quant)
        model.configure_model = lambda: _tensor_parallel(model, trainer.strategy.device_mesh["tensor_parallel"])
    synced = SyncedBuffers()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=True,
        callbacks=[synced],
    )
    trainer.fit(model, loader)
    if name in ("flydsl_fsdp2", "stock_fsdp2"):
        # the same Trainer again: the automatic sharding runs a second time on the already sharded model
        trainer.validate(model, loader, verbose=False)
    if "frozen" in extras:
        from fly_lightning.quant.frozen import _mx_names

        record = {"names": [], "checksum": 0, "local_bytes": 0, "full_bytes": 0, "parameters": 0}
        for prefix, m in model.named_modules():
            for name in _mx_names(m):
                t = getattr(m, name)
                local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
                full = t.full_tensor() if hasattr(t, "full_tensor") else t
                record["names"].append(f"{prefix}.{name}")
                record["checksum"] += int(full.to(torch.int64).sum()) * len(record["names"])
                record["local_bytes"] += local.numel() * local.element_size()
                record["full_bytes"] += full.numel() * full.element_size()
                record["parameters"] += isinstance(t, nn.Parameter)
        json.dump(record, open(f"{out}.rank{trainer.global_rank}", "w"))
    if trainer.global_rank == 0:
        s = getattr(trainer.strategy, "transform_summary", None)
        json.dump(
            {
                "strategy": type(trainer.strategy).__name__,
                "losses": model.losses,
                "val_losses": model.val_losses,
                "dispatch": fly_lightning.DISPATCH_LOG.summary(),
                "swapped": [] if s is None else s.swapped,
                "left": [] if s is None else s.left,
                "modules": sorted({type(m).__name__ for m in model.modules()}),
                "ddp_buffer_bytes": synced.bytes,
            },
            open(out, "w"),
        )


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        # Lightning leaves the process group up: torn down at interpreter exit, gloo aborted there once in CI
        # ("terminate called without an active exception"); both ranks end it here, together
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
