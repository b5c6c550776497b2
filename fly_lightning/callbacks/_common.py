"""Helpers shared by the callbacks: output directory, gathering across ranks, Lightning's logging cadence."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl


def writes_outputs(trainer: pl.Trainer) -> bool:
    """Whether end-of-fit files are written: not under ``fast_dev_run``, which gives no log directory (the files
    would land in the working directory), nor on ranks other than 0."""
    return trainer.is_global_zero and not getattr(trainer, "fast_dev_run", False)


def resolve_dir(trainer: pl.Trainer, dirpath: str | Path | None) -> Path:
    """``dirpath``, else the trainer's log_dir. Call on every rank: ``trainer.log_dir`` broadcasts."""
    log_dir = trainer.log_dir
    return Path(dirpath) if dirpath is not None else Path(log_dir or trainer.default_root_dir)


def gather(obj: Any) -> list[Any]:
    """``obj`` from every rank (in rank order) when torch.distributed runs with several ranks, else ``[obj]``.

    A collective: every rank must call it at the same point.
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def should_log(trainer: pl.Trainer) -> bool:
    """True on the steps where Lightning writes to its loggers (``log_every_n_steps``), as its own monitors check."""
    if not trainer.loggers:
        return False
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None and hasattr(connector, "should_update_logs"):
        return bool(connector.should_update_logs)
    n = trainer.log_every_n_steps
    return bool(n) and (trainer.global_step % n == 0)


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Write scalars to every logger at Lightning's current logging step (what ``self.log`` would use)."""
    if not trainer.loggers or not metrics:
        return
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None and hasattr(connector, "log_metrics"):
        connector.log_metrics(metrics)
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
