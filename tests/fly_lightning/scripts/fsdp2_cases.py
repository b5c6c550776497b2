"""``flydsl_fsdp2`` on models its automatic sharding must handle, run as a subprocess on 2 CPU processes (gloo).

    python fsdp2_cases.py CASE OUT.json

CASE:
- ``inner_call``: ``training_step`` calls ``self.model(...)`` (never the LightningModule's forward), the model's
  head is tied to its embedding, and it holds nested ``nn.ModuleList``s (a list inside each block, as T5's
  ``block[i].layer``);
- ``builds_only``: a ``configure_model`` that builds layers and shards nothing;
- ``full_checkpoint``: restacked per-expert lists (``ListMoE``), a full single-file checkpoint
  (``save_distributed_checkpoint=False``) saved after 2 steps and resumed: the weights and the optimizer state the
  first run ended with, against those the resumed run starts its third step with;
- ``sharded_checkpoint``: the same through a sharded checkpoint (``save_distributed_checkpoint=True``).

Rank 0 writes OUT.json: per-step losses, whether every parameter ended sharded, and the full tensors compared.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import fly_lightning  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import H, ListMoE  # noqa: E402


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        for lin in self.layer:
            x = x + torch.tanh(lin(x))
        return x


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 64)
        self.head.weight = self.emb.weight  # tied, as many LMs: one parameter in two modules

    def forward(self, t):
        h = self.emb(t)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class InnerCall(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Inner()

    def training_step(self, batch, _):
        t = batch[0]
        return nn.functional.cross_entropy(self.model(t).flatten(0, 1), t.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BuildsOnly(L.LightningModule):
    def configure_model(self) -> None:
        if not hasattr(self, "layers"):
            torch.manual_seed(0)
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for lin in self.layers:
            x = lin(x)
        return x

    def training_step(self, batch, _):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ListMoEModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(H, H), ListMoE(), nn.Linear(H, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Snapshot(L.Callback):
    """Full weights and AdamW state by parameter name (collectives: every rank takes it), at the end of the run
    (``at_step`` None) or before the step that starts at ``global_step == at_step``."""

    def __init__(self, at_step: int | None = None) -> None:
        self.at_step, self.taken = at_step, None

    def _take(self, trainer, module) -> None:
        full = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().tolist()  # noqa: E731
        opt = trainer.optimizers[0]
        self.taken = {}
        for name, p in module.named_parameters():
            state = opt.state.get(p, {})
            self.taken[name] = [full(p), *(full(state[k]) for k in ("exp_avg", "exp_avg_sq")), float(state["step"])]

    def on_train_end(self, trainer, module) -> None:
        if self.at_step is None:
            self._take(trainer, module)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            self._take(trainer, module)


def _fit(
    module, data, steps, ckpt_in=None, ckpt_out=None, snapshot=None, distributed=False
) -> tuple[L.Trainer, list[float]]:
    losses = Losses()
    strategy = fly_lightning.FlyFSDP2Strategy(save_distributed_checkpoint=distributed, report=False)
    flags = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    callbacks = [losses] + ([snapshot] if snapshot else [])
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, callbacks=callbacks, **flags)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    return trainer, losses.losses


def _full(module: nn.Module) -> dict[str, list]:
    """Every parameter gathered (a collective: all ranks), by name."""
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in module.named_parameters()}
    return {n: t.detach().tolist() for n, t in full.items()}


def _sharded(module: nn.Module) -> bool:
    return all(hasattr(p, "full_tensor") for p in module.parameters())


def main(case: str, out: Path) -> None:
    result: dict = {}
    if case == "inner_call":
        data = torch.utils.data.TensorDataset(torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1)))
        module = InnerCall()
        trainer, result["losses"] = _fit(module, data, 4)
        result["sharded"] = _sharded(module)
    elif case == "builds_only":
        data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=torch.Generator().manual_seed(1)))
        module = BuildsOnly()
        trainer, result["losses"] = _fit(module, data, 2)
        result["sharded"] = _sharded(module)
    else:
        g = torch.Generator().manual_seed(3)
        data = torch.utils.data.TensorDataset(torch.randn(16, H, generator=g), torch.randn(16, 1, generator=g))
        ckpt = out.with_suffix(".ckpt")
        saved, loaded = Snapshot(), Snapshot(at_step=2)
        distributed = case == "sharded_checkpoint"
        _fit(ListMoEModule(), data, 2, ckpt_out=ckpt, snapshot=saved, distributed=distributed)
        resumed = ListMoEModule()
        trainer, result["losses"] = _fit(resumed, data, 3, ckpt_in=ckpt, snapshot=loaded, distributed=distributed)
        result["saved"], result["loaded"], result["sharded"] = saved.taken, loaded.taken, _sharded(resumed)
    if case == "inner_call" or case == "builds_only":
        result["weights"] = _full(module)
    if trainer.global_rank == 0:
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    if torch.distributed.is_initialized():  # as fit.py: both ranks end the gloo group together, not at exit
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
