"""``DispatchCoverage``: which backend served each operator during a fit, logged, tabulated and written as a manifest.

Enabling a backend proves nothing until its use is confirmed, and one shape taking the fast kernel while another
falls back to ATen is normal; this callback shows both. Per operator of the registry (``fly_lightning.OPS``): calls
during the fit, the share served by each backend, fallbacks with their reasons and the shapes behind them, the shape
signatures first seen during the fit, and their cold start (first call incl. JIT compile, and ``select="measure"``
tuning) apart from steady-state calls.

- Scalars ``DispatchCoverage/<op>/<metric>`` go to the trainer's loggers on the steps where Lightning logs
  (``log_every_n_steps``), from this rank's counters (no collective per step): ``calls``, ``specialised_share``,
  ``share_<backend>`` for each backend the op has, ``fallback_calls``, ``signatures``, ``new_signatures``,
  ``cold_start_s`` (first calls incl. JIT compile, plus tuning), ``steady_calls`` (the calls after those).
- At the end of fit the counters of every rank are gathered; rank 0 prints a rich table and writes the dispatch
  manifest (``fly_lightning.callbacks.manifest``) to ``dirpath`` or the trainer's ``log_dir``.

The dispatch log is process-wide and may hold decisions from before the fit: their calls are counted from the fit's
start, and only decisions created during the fit count as new signatures.
"""

from __future__ import annotations

import datetime
import platform
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

from fly_lightning.callbacks import _common
from fly_lightning.callbacks.manifest import Usage, make_manifest, merge_sections, rank_sections, write_manifest
from fly_lightning.dispatch_log import DISPATCH_LOG
from fly_lightning.policy import DispatchConfig, get_dispatch_config
from fly_lightning.registry import OPS

if TYPE_CHECKING:
    from rich.table import Table

    from fly_lightning.dispatch_log import Decision

PREFIX = "DispatchCoverage"


class DispatchCoverage(pl.Callback):
    """Dispatch coverage per operator: logged scalars, an end-of-fit table and a JSON manifest.

    Args:
        dirpath: where the manifest goes; default the trainer's ``log_dir``.
        filename: the manifest's file name.
        log_metrics: send ``DispatchCoverage/<op>/<metric>`` scalars to the loggers every ``log_every_n_steps``.
        print_table: print the table at the end of fit (rank 0).
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str = "dispatch_manifest.json",
        log_metrics: bool = True,
        print_table: bool = True,
    ) -> None:
        self.dirpath = dirpath
        self.filename = filename
        self.log_metrics = log_metrics
        self.print_table = print_table
        self.manifest: dict[str, Any] | None = None
        self.manifest_path: Path | None = None
        self._baseline: dict[Decision, int] = {}
        self._new: dict[Decision, int | None] = {}  # decision -> global step when first seen
        self._lock = threading.Lock()  # decisions may be made on the autograd thread
        self._unsubscribe = None
        self._trainer: pl.Trainer | None = None
        self._dir: Path | None = None
        self._policy = None

    # --- tracking ---------------------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer
        self._dir = _common.resolve_dir(trainer, self.dirpath)
        # the policy in force for the fit: a fly strategy restores the previous one in teardown, before on_fit_end
        self._policy = get_dispatch_config()
        with self._lock:
            self._baseline = {d: d.calls for d in DISPATCH_LOG.decisions}
            self._new = {}
        self._stop_listening()
        self._unsubscribe = DISPATCH_LOG.subscribe(self._on_decision)

    def _on_decision(self, decision: Decision) -> None:
        step = self._trainer.global_step if self._trainer is not None else None
        with self._lock:
            self._baseline.setdefault(decision, 0)
            self._new.setdefault(decision, step)

    def usages(self) -> list[Usage]:
        """This rank's decisions used during the fit, with their calls since the fit started."""
        with self._lock:
            items = list(self._baseline.items())
            new = dict(self._new)
        out = []
        for d, base in items:
            calls = d.calls - base
            if calls > 0 or d in new:
                out.append(Usage(d, calls, d in new, new.get(d)))
        return out

    def summary(self) -> dict[str, Any]:
        """This rank's ``ops``/``cold_start`` sections (see ``fly_lightning.callbacks.manifest``)."""
        return merge_sections([rank_sections(self.usages(), OPS.values())])

    # --- logging ----------------------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.log_metrics and _common.should_log(trainer):
            _common.log_metrics(trainer, self.metrics())

    def metrics(self) -> dict[str, float]:
        """``DispatchCoverage/<op>/<metric>`` for each op called during the fit, from this rank's counters."""
        sections = self.summary()
        out: dict[str, float] = {}
        for name, op in sections["ops"].items():
            if not op["calls"]:
                continue
            p = f"{PREFIX}/{name}"
            out[f"{p}/calls"] = float(op["calls"])
            out[f"{p}/specialised_share"] = float(op["specialised_share"])
            for backend in sorted(set(op["backends"]) | set(op["by_backend"])):
                out[f"{p}/share_{backend}"] = op["by_backend"].get(backend, 0) / op["calls"]
            out[f"{p}/fallback_calls"] = float(op["fallback_calls"])
            out[f"{p}/signatures"] = float(len(op["signatures"]))
            cold = sections["cold_start"].get(name, {})
            out[f"{p}/new_signatures"] = float(len(cold))
            # calls past the first (cold) call of each signature first seen in this fit
            out[f"{p}/steady_calls"] = float(op["calls"] - sum(c["first_call_s"] is not None for c in cold.values()))
            out[f"{p}/cold_start_s"] = sum((c["first_call_s"] or 0.0) + (c["tuning_s"] or 0.0) for c in cold.values())
        return out

    # --- end of fit -------------------------------------------------------------------------------------------------
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_listening()
        per_rank = _common.gather(rank_sections(self.usages(), OPS.values()))
        if not trainer.is_global_zero:
            return
        sections = merge_sections(per_rank)
        self.manifest = make_manifest(sections, _run_info(trainer, len(per_rank), self._policy))
        directory = self._dir or _common.resolve_dir(trainer, self.dirpath)
        self.manifest_path = write_manifest(self.manifest, directory / self.filename)
        if self.print_table:
            from rich.console import Console

            Console().print(coverage_table(self.manifest))
            Console().print(f"dispatch manifest: {self.manifest_path}")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_listening()

    def _stop_listening(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None


def coverage_table(manifest: dict[str, Any], title: str = "fly-lightning dispatch coverage") -> Table:
    """One row per registered operator: calls, share per backend, signatures (new), cold start, fallbacks."""
    from rich.table import Table

    world = manifest["run"].get("world_size", 1)
    table = Table(title=f"{title} ({world} rank{'s' if world != 1 else ''})")
    for col in ("op", "calls", "served by", "signatures (new)", "cold start", "fallbacks: reason [shapes]"):
        table.add_column(col, overflow="fold")
    for name in sorted(manifest["ops"]):
        op = manifest["ops"][name]
        cold = manifest["cold_start"].get(name, {})
        if not op["calls"]:
            table.add_row(name, "0", "not called", str(len(op["signatures"])), "-", "", style="dim")
            continue
        served = " · ".join(
            f"{b} {100 * n / op['calls']:.0f}%" for b, n in sorted(op["by_backend"].items(), key=lambda kv: -kv[1])
        )
        cold_s = sum((c["first_call_s"] or 0.0) + (c["tuning_s"] or 0.0) for c in cold.values())
        reasons: dict[str, list[str]] = {}
        for sig in op["signatures"].values():
            if sig["backend"] == "aten" and any(b != "aten" for b in sig["rejected"]):
                why = "; ".join(f"{b}: {r}" for b, r in sorted(sig["rejected"].items()))
                reasons.setdefault(why, []).append(sig["shape"])
        fallbacks = "\n".join(f"{why} [{' | '.join(shapes)}]" for why, shapes in sorted(reasons.items()))
        style = "yellow" if op["fallback_calls"] else ("green" if op["specialised_share"] > 0 else None)
        table.add_row(
            name,
            str(op["calls"]),
            served,
            f"{len(op['signatures'])} ({len(cold)})",
            f"{cold_s * 1e3:.1f} ms" if cold else "-",
            fallbacks,
            style=style,
        )
    return table


def _run_info(trainer: pl.Trainer, world_size: int, policy: DispatchConfig | None = None) -> dict[str, Any]:
    import lightning

    import fly_lightning

    versions = {
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "fly_lightning": fly_lightning.__version__,
        "python": platform.python_version(),
    }
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": world_size,
        "global_step": trainer.global_step,
        "policy": repr(policy or get_dispatch_config()),
        "device": device,
        "versions": versions,
    }
