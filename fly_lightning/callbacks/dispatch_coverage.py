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
from lightning.pytorch.utilities import rank_zero_warn

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
        print_table: print the table at the end of fit (rank 0). Under a fly strategy with ``report=True`` this table
            replaces the strategy's per-shape dispatch table for the fit (the two would repeat each other): the
            transform summary, then one coverage table, with the fallback reasons below it.
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
        self._strategy_report: tuple[Any, bool] | None = None  # (fly strategy, its report flag) while we stand in

    # --- tracking ---------------------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer
        strategy = trainer.strategy
        if self.print_table and getattr(strategy, "fly_report", False):
            self._strategy_report = (strategy, strategy.fly_report)
            strategy.fly_report = False  # its teardown (before on_fit_end) would print the per-shape table too
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
        stood_in = self._restore_strategy_report()
        per_rank = _common.gather(rank_sections(self.usages(), OPS.values()))
        if not trainer.is_global_zero:
            return
        sections = merge_sections(per_rank)
        self.manifest = make_manifest(sections, _run_info(trainer, len(per_rank), self._policy))
        self.manifest_path = None
        if _common.writes_outputs(trainer):
            directory = self._dir or _common.resolve_dir(trainer, self.dirpath)
            try:  # the run is over: a file that cannot be written is reported, never a crash of a finished fit
                self.manifest_path = write_manifest(self.manifest, directory / self.filename)
            except OSError as exc:
                rank_zero_warn(f"DispatchCoverage: {self.filename} not written ({type(exc).__name__}: {exc})")
        if self.print_table:
            from rich.console import Console

            console = Console()
            summary = getattr(stood_in, "transform_summary", None)
            if summary is not None and (summary.swapped or summary.left):
                summary.print()
            console.print(coverage_table(self.manifest))
            for line in coverage_notes(self.manifest):
                console.print(line, highlight=False, markup=False)
            if self.manifest_path is not None:
                console.print(f"dispatch manifest: {self.manifest_path}", highlight=False, markup=False)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_listening()
        self._restore_strategy_report()

    def _restore_strategy_report(self) -> Any:
        """Give the strategy its report flag back; returns the strategy when this callback stood in for its report."""
        if self._strategy_report is None:
            return None
        strategy, flag = self._strategy_report
        self._strategy_report = None
        strategy.fly_report = flag
        return strategy

    def _stop_listening(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None


def coverage_table(manifest: dict[str, Any], title: str = "fly-lightning dispatch coverage") -> Table:
    """One row per operator called during the fit: calls, share per backend, shape signatures (new), cold start.

    Fallback reasons, with their shapes, are lines below the table (``coverage_notes``), so that no column has to
    hold long text and no word is split; ops not called are named in one line there.
    """
    from rich.table import Table

    world = manifest["run"].get("world_size", 1)
    table = Table(title=f"{title} ({world} rank{'s' if world != 1 else ''})")
    for col, justify in (("op", "left"), ("calls", "right"), ("served by", "left"), ("shapes (new)", "right")):
        table.add_column(col, justify=justify, no_wrap=col != "served by")
    table.add_column("cold start", justify="right", no_wrap=True)
    for name in sorted(manifest["ops"]):
        op = manifest["ops"][name]
        if not op["calls"]:
            continue
        cold = manifest["cold_start"].get(name, {})
        served = " · ".join(
            f"{b} {100 * n / op['calls']:.0f}%" for b, n in sorted(op["by_backend"].items(), key=lambda kv: -kv[1])
        )
        cold_s = sum((c["first_call_s"] or 0.0) + (c["tuning_s"] or 0.0) for c in cold.values())
        style = "yellow" if op["fallback_calls"] else ("green" if op["specialised_share"] > 0 else None)
        table.add_row(
            name,
            str(op["calls"]),
            served,
            f"{len(op['signatures'])} ({len(cold)})",
            f"{cold_s * 1e3:.1f} ms" if cold else "-",
            style=style,
        )
    return table


def coverage_notes(manifest: dict[str, Any]) -> list[str]:
    """The text under the coverage table: backends passed over on every shape (said once), then per op the reasons
    its shapes fell back to ATen with those shapes, and the ops not called."""
    ops = manifest["ops"]
    called = {name: op for name, op in ops.items() if op["calls"]}
    sigs = [sig for op in called.values() for sig in op["signatures"].values()]
    # a backend rejected on every signature of every op (not installed, not this GPU...) is a fact about the machine
    everywhere = set.intersection(*(set(sig["rejected"]) for sig in sigs)) if sigs else set()
    lines = []
    if everywhere:
        for backend in sorted(everywhere):
            why = sorted({sig["rejected"][backend] for sig in sigs})
            lines.append(f"{backend} passed over on every shape: {'; '.join(why)}")
    for name, op in sorted(called.items()):
        reasons: dict[str, list[str]] = {}
        for sig in op["signatures"].values():
            if sig["backend"] == "aten" and any(b != "aten" for b in sig["rejected"]):
                why = "; ".join(f"{b}: {r}" for b, r in sorted(sig["rejected"].items()) if b not in everywhere)
                reasons.setdefault(why or "; ".join(sorted(sig["rejected"].values())), []).append(sig["shape"])
        for why, shapes in sorted(reasons.items()):
            lines.append(f"{name} on aten: {why} [{' | '.join(shapes)}]")
    idle = sorted(name for name, op in ops.items() if not op["calls"])
    if idle:
        lines.append(f"not called: {', '.join(idle)}")
    return lines


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
