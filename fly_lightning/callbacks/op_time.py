"""``OperatorTime``: every N steps, profile one training step and break its time down by operator and backend.

An operator speedup is worth only the share of the step that operator holds. On the profiled steps this callback
measures that share: the step's device time (GPU runs: CUDA/HIP kernels) or CPU time (CPU runs), split into each
fly-lightning operator by the backend that ran it, dense GEMM, attention (with the SDPA backend that ran),
communication collectives, the optimizer, everything else, and the overhead outside operators; plus the
time-weighted coverage (the share of the step in specialised backends) and the Amdahl bound it implies. How the time
is attributed, and the limits of the method, are in ``fly_lightning.callbacks.breakdown``.

Zero overhead on other steps: ``on_train_batch_start`` compares a counter and returns; no profiler object exists
between profiled steps, and ``fly_lightning.dispatch.profile_ranges`` (the per-call profiler ranges) is on only
inside the profiled step.

The profiled step runs from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, optimizer step;
not the data loading), with a device synchronisation at both ends on GPU, so its wall time is the step's time on the
device. Each profiled step's breakdown is logged as ``OperatorTime/<part>/ms`` and ``/pct``,
``OperatorTime/step_ms``, ``/coverage``, ``/amdahl_bound``, ``/residual_ms`` (averaged over ranks); at the end of fit
rank 0 prints the mean over profiled steps as a rich table (outlier steps, over 3x the median, left out and named),
the median and spread of the step times, and writes ``op_time.json`` (every step, their mean, the mean without
outliers, the spread) and, when matplotlib is installed, ``op_time.png`` (stacked bars; without matplotlib the
output says so once) to ``dirpath`` or the trainer's ``log_dir``, beside the dispatch manifest. The Amdahl bound is
shown for GPU runs only.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from fly_lightning import dispatch
from fly_lightning._files import write_text_atomic
from fly_lightning.callbacks import _common
from fly_lightning.callbacks.breakdown import STEP_RANGE, UPDATE_MARK, StepBreakdown, analyse, mean

log = logging.getLogger(__name__)
PREFIX = "OperatorTime"


class _Session:
    """The live state of one profiled step."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.batch = batch
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)  # nothing from earlier steps may run inside the window
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities)
        self.prof.start()
        try:
            dispatch.profile_ranges = True
            self.range = torch.profiler.record_function(STEP_RANGE)
            self.t0 = time.perf_counter()  # the wall clock brackets the range, so it can only be longer by a few µs
            self.range.__enter__()
        except BaseException:
            dispatch.profile_ranges = False
            self.prof.stop()
            raise

    def finish(self, step: int) -> StepBreakdown:
        try:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.range.__exit__(None, None, None)
            wall_ms = (time.perf_counter() - self.t0) * 1e3
        finally:
            dispatch.profile_ranges = False
            self.prof.stop()
        return analyse(self.prof.events(), step=step, step_ms=wall_ms)

    def abort(self) -> None:
        dispatch.profile_ranges = False
        try:
            self.range.__exit__(None, None, None)
        finally:
            self.prof.stop()


class OperatorTime(pl.Callback):
    """Step time by operator and backend, measured with the torch profiler on one step every ``every_n_steps``.

    Args:
        every_n_steps: profile one optimizer step in this many.
        first_step: the first profiled step (counted from 0 in this fit); skip the warm-up and compile steps.
        dirpath: where ``op_time.json``/``op_time.png`` go; default the trainer's ``log_dir``.
        plot: write the PNG (needs matplotlib; without it the end-of-fit output says that no PNG was written).
        print_each: print the table of every profiled step (rank 0), not only the summary at the end of fit.
        log_metrics: send the scalars of each profiled step to the loggers.

    A step is an optimizer step: with ``accumulate_grad_batches`` > 1 the profile spans all micro-batches of the
    window and ends after the update (each batch is a step under manual optimization). A validation run that falls
    inside a profiled window is part of that step's time.
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        first_step: int = 10,
        dirpath: str | Path | None = None,
        plot: bool = True,
        print_each: bool = False,
        log_metrics: bool = True,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if first_step < 0:
            raise ValueError(f"first_step must be >= 0, got {first_step}")
        self.every_n_steps = every_n_steps
        self.first_step = first_step
        self.dirpath = dirpath
        self.plot = plot
        self.print_each = print_each
        self.log_metrics = log_metrics
        self.results: list[StepBreakdown] = []  # one per profiled step, averaged over ranks (rank 0 only)
        self.local_results: list[StepBreakdown] = []  # this rank's
        self.json_path: Path | None = None
        self.png_path: Path | None = None
        self._steps = 0  # optimizer steps begun in this fit
        self._due = False  # the current step is a profiled one
        self._in_step = False  # between a step's first micro-batch and the batch that ends it
        self._stepped = False  # the optimizer stepped in the current window
        self._session: _Session | None = None
        self._dir: Path | None = None

    def due(self, step: int) -> bool:
        """Whether optimizer step number ``step`` (from 0) is profiled."""
        return step >= self.first_step and (step - self.first_step) % self.every_n_steps == 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._dir = _common.resolve_dir(trainer, self.dirpath)
        self._steps, self._due, self._in_step, self._stepped = 0, False, False, False
        self.results, self.local_results = [], []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._in_step:  # a later micro-batch of the step: the profile (if any) goes on
            return
        self._in_step, self._stepped = True, False
        n = self._steps
        self._steps += 1
        self._due = self.due(n)
        if not self._due:
            return
        self._abort()
        if torch.autograd._profiler_enabled():  # e.g. Trainer(profiler="pytorch"): two profilers cannot nest
            rank_zero_warn(f"OperatorTime: another profiler is running; batch {n} is not broken down")
            return
        try:
            self._session = _Session(n, pl_module.device)
        except Exception as exc:  # profiling must never stop training
            dispatch.profile_ranges = False
            rank_zero_warn(f"OperatorTime: could not start the profiler on batch {n}: {exc!r}")

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._stepped = True
        if self._session is not None:
            with torch.profiler.record_function(UPDATE_MARK):  # marks where the closure ends and the update begins
                pass

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._stepped and pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1:
            return  # accumulating: the step ends with the batch that updates
        self._in_step = False
        if not self._due:
            return
        self._due = False
        session, self._session = self._session, None
        local = None
        if session is not None:
            try:
                local = session.finish(step=trainer.global_step)
            except Exception as exc:
                rank_zero_warn(f"OperatorTime: could not break down step {trainer.global_step}: {exc!r}")
            del session  # the profiler and its events go now, not at the next profiled step
        if local is not None:
            self.local_results.append(local)
        # every rank reaches this point on the same batch, profiled or not, so the gather cannot hang
        per_rank = [d for d in _common.gather(None if local is None else local.to_dict()) if d is not None]
        if not trainer.is_global_zero or not per_rank:
            return
        result = mean([_from_dict(d) for d in per_rank])
        result.ranks = len(per_rank)
        self.results.append(result)
        if self.log_metrics:
            _common.log_metrics(trainer, result.metrics(PREFIX))
        if self.print_each:
            from rich.console import Console

            Console().print(result.table(f"step {result.step}: time by operator"))
        log.info(
            "OperatorTime step %d: %.3f ms, coverage %.1f%%, residual %+.3f ms",
            result.step,
            result.step_ms,
            100 * result.coverage,
            result.residual_ms,
        )

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._due = self._in_step = False
        self._abort()  # a batch that started profiling but never reached on_train_batch_end

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._abort()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._abort()
        if not trainer.is_global_zero or not self.results:
            return
        directory = self._dir or _common.resolve_dir(trainer, self.dirpath)
        spread = step_spread(self.results)
        outliers = set(spread["outlier_steps"])
        kept = [r for r in self.results if r.step not in outliers]
        typical = mean(kept)
        record = {
            "mean": mean(self.results).to_dict(),  # every profiled step
            "typical": typical.to_dict(),  # the mean without the outlier steps
            "step_ms": spread,
            "steps": [r.to_dict() for r in self.results],
        }
        writes = _common.writes_outputs(trainer)
        self.json_path = None
        if writes:
            try:  # the run is over: a file that cannot be written is reported, never a crash of a finished fit
                text = json.dumps(record, indent=2, sort_keys=True) + "\n"
                self.json_path = write_text_atomic(directory / "op_time.json", text)
            except OSError as exc:
                writes = False
                rank_zero_warn(f"OperatorTime: op_time.json not written ({type(exc).__name__}: {exc})")
        from rich.console import Console

        console = Console()
        n = len(self.results)
        of = f"{len(kept)} of {n}" if outliers else f"{n}"
        console.print(typical.table(f"time by operator, mean of {of} profiled step{'s' * (n != 1)}"))
        for line in spread_lines(spread):
            console.print(line, highlight=False)
        if self.plot and writes:
            if importlib.util.find_spec("matplotlib") is None:
                console.print(
                    "op_time.png not written: matplotlib is not installed (pip install matplotlib)", highlight=False
                )
                return
            from fly_lightning.callbacks.plot import save_step_bars

            try:
                self.png_path = save_step_bars(self.results, directory / "op_time.png")
            except (OSError, ValueError) as exc:  # a full disk, a backend that cannot render
                rank_zero_warn(f"OperatorTime: op_time.png not written ({type(exc).__name__}: {exc})")
                return
            if self.png_path is not None:
                console.print(f"step breakdown: {self.png_path}", highlight=False)

    def _abort(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.abort()


OUTLIER_FACTOR = 3.0


def step_spread(results: list[StepBreakdown]) -> dict[str, Any]:
    """Median, minimum and maximum of the profiled steps' times, and the outliers: with three steps or more, a step
    more than ``OUTLIER_FACTOR`` times the median (a stall, a collection, a recompile), which a mean would hide in."""
    times = [r.step_ms for r in results]
    median = statistics.median(times)
    outliers = [r.step for r in results if len(results) >= 3 and r.step_ms > OUTLIER_FACTOR * median]
    return {"median": median, "min": min(times), "max": max(times), "n": len(times), "outlier_steps": outliers}


def spread_lines(spread: dict[str, Any]) -> list[str]:
    """The lines under the table: step time spread, and the outliers left out of it."""
    if spread["n"] < 2:
        return []
    lines = [
        f"step time over {spread['n']} profiled steps: median {spread['median']:.1f} ms, "
        f"min {spread['min']:.1f}, max {spread['max']:.1f}"
    ]
    if spread["outlier_steps"]:
        steps = ", ".join(str(s) for s in spread["outlier_steps"])
        lines.append(
            f"[yellow]outlier step{'s' * (len(spread['outlier_steps']) > 1)} {steps} (over {OUTLIER_FACTOR:g}x the "
            f"median): left out of the table, kept in op_time.json[/yellow]"
        )
    return lines


def _from_dict(d: dict[str, Any]) -> StepBreakdown:
    return StepBreakdown(
        step=d["step"],
        device=d["device"],
        step_ms=d["step_ms"],
        parts_ms=dict(d["parts_ms"]),
        specialised=list(d["specialised"]),
        kernel_overlap_ms=d["kernel_overlap_ms"],
        ranks=d["ranks"],
        notes=list(d["notes"]),
    )
