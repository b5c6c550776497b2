"""A tiny LightningModule with dispatched calls (FlyRMSNorm), dense GEMMs and SDPA, and a short CPU fit."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

import fly_lightning
from fly_lightning import dispatch

B, T, H, HEADS = 4, 8, 32, 2


class Tiny(pl.LightningModule):
    """Linear -> FlyRMSNorm -> SDPA -> Linear; records whether dispatch profiler ranges were on in each step."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.norm = fly_lightning.FlyRMSNorm(H)
        self.out = nn.Linear(H, H)
        self.ranges_on: list[bool] = []

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        h_BTH = self.norm(self.inp(x_BTH))
        q_BNTD = h_BTH.view(B, T, HEADS, H // HEADS).transpose(1, 2)
        a_BTH = torch.nn.functional.scaled_dot_product_attention(q_BNTD, q_BNTD, q_BNTD).transpose(1, 2)
        return self.out(a_BTH.reshape(B, T, H))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.ranges_on.append(dispatch.profile_ranges)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(
    root: Path, callbacks: list, steps: int = 4, log_every_n_steps: int = 2, **trainer_kwargs
) -> tuple[pl.Trainer, Tiny]:
    data = torch.utils.data.TensorDataset(torch.randn(steps * B, T, H), torch.randn(steps * B, T, H))
    trainer = pl.Trainer(
        accelerator="cpu",
        **({"devices": 1} | trainer_kwargs),
        max_steps=steps,
        logger=CSVLogger(root),
        log_every_n_steps=log_every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    model = Tiny()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=B))
    return trainer, model


def metric_rows(trainer: pl.Trainer) -> list[dict[str, str]]:
    """The CSVLogger's rows, empty cells dropped."""
    path = Path(trainer.logger.log_dir) / "metrics.csv"
    with path.open() as f:
        return [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


@pytest.fixture
def tiny() -> SimpleNamespace:
    """``fit(root, callbacks)``, ``rows(trainer)``, ``Model`` and ``batch()`` for the callback tests."""
    return SimpleNamespace(
        fit=fit, rows=metric_rows, Model=Tiny, batch=lambda: (torch.randn(B, T, H), torch.randn(B, T, H))
    )
