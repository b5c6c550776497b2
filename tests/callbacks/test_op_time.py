"""OperatorTime: the step breakdown (categories, additivity), profiling only on the chosen steps, logged metrics."""

from __future__ import annotations

import json
import math
import os
from unittest import mock

import pytest
import torch

import fly_lightning
from fly_lightning import dispatch
from fly_lightning.callbacks import OperatorTime, StepBreakdown, analyse
from fly_lightning.callbacks.breakdown import OVERHEAD, STEP_RANGE, UPDATE_MARK, is_specialised, mean

# The parts must add up to the measured step. On CPU they are the self times of the events under the step range, and
# the wall clock brackets that range, so the residual is only the range's enter/exit cost: allow 3% + 0.2 ms (a
# double-counted or dropped subtree would be tens of percent).
TOLERANCE_PCT, TOLERANCE_MS = 3.0, 0.2


def _assert_adds_up(b: StepBreakdown) -> None:
    assert b.step_ms > 0
    assert abs(b.residual_ms) <= TOLERANCE_PCT / 100 * b.step_ms + TOLERANCE_MS, b.to_dict()
    assert all(v > 0 for v in b.parts_ms.values())


def _profiled_step(tiny, model, opt, batch) -> StepBreakdown:
    """One step profiled as the callback does it, with Lightning's order: the closure runs inside optimizer.step."""
    x, y = batch

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        with torch.profiler.record_function(UPDATE_MARK):  # what on_before_optimizer_step emits
            pass
        return loss

    opt.step(closure)  # warm-up: first calls decide and compile outside the profile
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    prof.start()
    dispatch.profile_ranges = True
    try:
        with torch.profiler.record_function(STEP_RANGE):
            opt.step(closure)
    finally:
        dispatch.profile_ranges = False
        prof.stop()
    return analyse(prof.events(), step=7)


def test_breakdown_categories_and_coverage(tiny):
    model = tiny.Model()
    opt = torch.optim.AdamW(model.parameters())
    b = _profiled_step(tiny, model, opt, tiny.batch())
    assert b.device == "cpu" and b.step == 7
    for label in ("rms_norm/triton", "rms_norm.backward/aten", "gemm", "attention/flash", "optimizer", OVERHEAD):
        assert label in b.parts_ms, sorted(b.parts_ms)
    assert b.specialised == ["rms_norm/triton"]
    assert b.coverage == pytest.approx(b.parts_ms["rms_norm/triton"] / b.step_ms)
    assert b.amdahl_bound == pytest.approx(1 / (1 - b.coverage))
    # step_ms defaults to the step range itself: the self times then add up exactly
    assert b.residual_ms == pytest.approx(0.0, abs=1e-6)
    # the forward and backward ran inside Optimizer.step: the update marker keeps them out of "optimizer"
    assert b.parts_ms["optimizer"] < 0.5 * b.step_ms
    metrics = b.metrics()
    assert metrics["OperatorTime/rms_norm/triton/pct"] == pytest.approx(100 * b.coverage)
    assert sum(v for k, v in metrics.items() if k.endswith("/pct")) == pytest.approx(100 - b.residual_pct)


def test_breakdown_labels_the_backend_that_ran(tiny):
    model = tiny.Model()
    opt = torch.optim.AdamW(model.parameters())
    with fly_lightning.dispatch_config(disabled_ops={"rms_norm"}):
        b = _profiled_step(tiny, model, opt, tiny.batch())
    assert "rms_norm/aten" in b.parts_ms and "rms_norm/triton" not in b.parts_ms
    assert b.specialised == [] and b.coverage == 0.0 and b.amdahl_bound == 1.0


def test_dispatch_ranges_only_while_enabled():
    x, w = torch.randn(4, 32), torch.ones(32)
    fly_lightning.rms_norm(x, w)  # decide outside the profiles

    def names(on: bool) -> set[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            dispatch.profile_ranges = on
            try:
                fly_lightning.rms_norm(x, w)
            finally:
                dispatch.profile_ranges = False
        return {e.name for e in prof.events()}

    assert not any(n.startswith("fly::rms_norm/") for n in names(False))
    assert "fly::rms_norm/triton" in names(True)


def test_specialised_and_mean():
    assert is_specialised("moe_route/triton") and is_specialised("grouped_mm/flydsl")
    assert not any(map(is_specialised, ("rms_norm/aten", "rms_norm.backward/triton", "gemm", "attention/flash")))
    a = StepBreakdown(1, "cpu", 10.0, {"x/triton": 4.0, OVERHEAD: 6.0}, ["x/triton"])
    b = StepBreakdown(2, "cpu", 20.0, {"x/triton": 4.0, "gemm": 10.0, OVERHEAD: 6.0}, ["x/triton"])
    m = mean([a, b])
    assert m.step_ms == 15.0 and m.parts_ms == {"x/triton": 4.0, "gemm": 5.0, OVERHEAD: 6.0}
    assert m.residual_ms == 0.0 and m.coverage == pytest.approx(4 / 15)
    full = StepBreakdown(1, "cpu", 2.0, {"x/triton": 2.0}, ["x/triton"])
    assert math.isinf(full.amdahl_bound) and "OperatorTime/amdahl_bound" not in full.metrics()
    with pytest.raises(ValueError, match="no breakdowns"):
        mean([])


def test_analyse_needs_the_step_range():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(3).sum()
    with pytest.raises(ValueError, match="OperatorTime::step"):
        analyse(prof.events())


def test_fit_profiles_only_the_chosen_steps(tiny, tmp_path, capsys):
    cb = OperatorTime(every_n_steps=2, first_step=1)
    with mock.patch.object(torch.profiler, "profile", wraps=torch.profiler.profile) as spy:
        trainer, model = tiny.fit(tmp_path, [cb], steps=4)
    assert spy.call_count == 2
    # the per-call ranges were on inside profiled steps only, and are off again
    assert model.ranges_on == [False, True, False, True]
    assert dispatch.profile_ranges is False and cb._session is None
    assert [r.step for r in cb.results] == [2, 4]  # global step after the profiled batch's update
    for r in cb.results:
        _assert_adds_up(r)
        assert r.device == "cpu" and r.ranks == 1
        assert {"rms_norm/triton", "rms_norm.backward/aten", "gemm", "optimizer"} <= set(r.parts_ms)
        assert r.parts_ms["rms_norm/triton"] > 0 and 0 < r.coverage < 1
    for local, result in zip(cb.local_results, cb.results, strict=True):  # one rank: the mean over ranks is itself
        assert local.step_ms == result.step_ms and local.parts_ms == pytest.approx(result.parts_ms)
    # scalars at the profiled steps, in the CSVLogger file
    rows = [r for r in tiny.rows(trainer) if "OperatorTime/step_ms" in r]
    assert [int(r["step"]) for r in rows] == [1, 3]
    for row, result in zip(rows, cb.results, strict=True):
        assert float(row["OperatorTime/step_ms"]) == pytest.approx(result.step_ms)
        assert float(row["OperatorTime/rms_norm/triton/ms"]) == pytest.approx(result.parts_ms["rms_norm/triton"])
        assert float(row["OperatorTime/coverage"]) == pytest.approx(result.coverage)
        parts = sum(float(v) for k, v in row.items() if k.startswith("OperatorTime/") and k.endswith("/ms"))
        assert parts + float(row["OperatorTime/residual_ms"]) == pytest.approx(float(row["OperatorTime/step_ms"]))
    # summary table, JSON and PNG beside the logs
    out = capsys.readouterr().out
    assert "mean of 2 profiled steps" in out and "rms_norm/triton" in out
    assert "Amdahl" not in out  # CPU times say nothing about what a GPU kernel would save
    assert "step time over 2 profiled steps: median" in out and "outlier" not in out
    saved = json.loads(cb.json_path.read_text())
    assert [s["step"] for s in saved["steps"]] == [2, 4]
    assert saved["mean"]["step_ms"] == pytest.approx(sum(r.step_ms for r in cb.results) / 2)
    assert cb.json_path.parent == cb.png_path.parent == tmp_path / "lightning_logs" / "version_0"
    assert cb.png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_step_is_an_optimizer_step_under_gradient_accumulation(tiny, tmp_path):
    # two micro-batches per step: a profiled step spans both and ends after the update, whatever the epoch boundary
    cb = OperatorTime(every_n_steps=2, first_step=0, plot=False)
    updates = []  # per optimizer step: whether a profile was running at its update
    original = cb.on_before_optimizer_step
    cb.on_before_optimizer_step = lambda *a: (updates.append(cb._session is not None), original(*a))[1]
    _, model = tiny.fit(tmp_path, [cb], steps=4, accumulate_grad_batches=2)
    assert model.ranges_on == [True, True, False, False] * 2  # 8 micro-batches over two epochs of 4
    assert updates == [True, False, True, False]
    assert [r.step for r in cb.results] == [1, 3]
    for r in cb.results:
        _assert_adds_up(r)
        assert r.parts_ms["optimizer"] > 0


def test_no_profiler_without_the_callback(tiny, tmp_path):
    with mock.patch.object(torch.profiler, "profile", wraps=torch.profiler.profile) as spy:
        _, model = tiny.fit(tmp_path, [], steps=2)
    assert spy.call_count == 0 and model.ranges_on == [False, False]


def test_png_is_optional(monkeypatch, tmp_path):
    import builtins

    from fly_lightning.callbacks.plot import save_step_bars

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    b = StepBreakdown(1, "cpu", 1.0, {OVERHEAD: 1.0}, [])
    with pytest.warns(UserWarning, match="pip install matplotlib"):
        assert save_step_bars([b], tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="every_n_steps"):
        OperatorTime(every_n_steps=0)
    with pytest.raises(ValueError, match="first_step"):
        OperatorTime(first_step=-1)
    cb = OperatorTime(every_n_steps=3, first_step=2)
    assert [n for n in range(10) if cb.due(n)] == [2, 5, 8]


def _synthetic_gpu_trace(wrapper: str = "GeneratedBackwardFor_fly_rms_norm_default"):
    """A CUDA step as kineto reports it: CPU ops with kernels attached by correlation id, device intervals, a GPU-side
    mirror of a user range, a collective overlapping compute on another stream and a kernel no CPU op launched.
    ``wrapper``: the op's autograd wrapper (the custom op's, or the eager path's autograd.Function)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    events, next_id = [], iter(range(1, 1000))

    def cpu(name, start, end, thread=1, user=False, kernels=()):
        e = FunctionEvent(
            next(next_id), name, thread, start, end, use_device="cuda", scope=7 if user else 0, is_user_annotation=user
        )
        for kname, dur in kernels:
            e.append_kernel(kname, 0, dur)
        events.append(e)

    def gpu(name, start, end, user=False):
        events.append(
            FunctionEvent(
                next(next_id),
                name,
                7,
                start,
                end,
                use_device="cuda",
                device_type=DeviceType.CUDA,
                is_user_annotation=user,
            )
        )

    cpu(STEP_RANGE, 0, 1000, user=True)
    cpu("Optimizer.step#AdamW.step", 10, 900, user=True)
    cpu("aten::linear", 20, 60)
    cpu("aten::addmm", 25, 55, kernels=[("sm90_gemm", 100)])
    if wrapper.startswith("GeneratedBackwardFor"):  # the custom op's own event; the eager path has none
        cpu("fly::rms_norm", 70, 120)
    cpu(wrapper, 72, 118, kernels=[("_rms_norm_rows", 50)])  # launched in range
    cpu("fly::rms_norm/triton", 75, 115, user=True)
    cpu("aten::scaled_dot_product_attention", 130, 200)
    cpu("aten::_scaled_dot_product_flash_attention", 135, 195, kernels=[("flash_fwd_kernel", 80)])
    cpu(UPDATE_MARK, 600, 601, user=True)
    cpu("aten::_foreach_add_", 610, 650, kernels=[("multi_tensor_apply_kernel", 40)])
    # the autograd engine's thread
    cpu(f"autograd::engine::evaluate_function: {wrapper}Backward", 300, 400, thread=2)
    cpu("aten::mul", 310, 320, thread=2, kernels=[("elementwise_kernel", 30)])
    cpu("record_param_comms", 410, 420, thread=2, kernels=[("ncclDevKernel_AllReduce_Sum", 200)])
    gpu("sm90_gemm", 100, 200)
    gpu("_rms_norm_rows", 200, 250)
    gpu("flash_fwd_kernel", 250, 330)
    gpu("elementwise_kernel", 400, 430)
    gpu("ncclDevKernel_AllReduce_Sum", 420, 620)  # a second stream: overlaps the optimizer's kernel by 20 us
    gpu("multi_tensor_apply_kernel", 600, 640)
    gpu("graph_replayed_kernel", 700, 710)  # no CPU operator launched it
    gpu("Optimizer.step#AdamW.step", 100, 640, user=True)  # GPU-side mirror of a user range: not a kernel
    trace = EventList(sorted(events, key=lambda e: (e.time_range.start, -e.time_range.end)), use_device="cuda")
    trace._build_tree()
    return trace


@pytest.mark.parametrize("wrapper", ["GeneratedBackwardFor_fly_rms_norm_default", "fly_rms_norm_eager"])
def test_gpu_breakdown_attributes_kernels_through_their_cpu_ops(wrapper):
    b = analyse(_synthetic_gpu_trace(wrapper), step=3)
    assert b.device == "cuda"
    assert b.parts_ms == pytest.approx(
        {
            "gemm": 0.100,
            "rms_norm/triton": 0.050,
            "attention/flash": 0.080,
            "rms_norm.backward/aten": 0.030,
            "comm": 0.200,
            "optimizer": 0.040,
            "other": 0.010,
            OVERHEAD: 1.0 - 0.480,  # the step window minus the union of device intervals
        }
    )
    assert b.specialised == ["rms_norm/triton"] and b.coverage == pytest.approx(0.05)
    # concurrent streams: the kernels sum to 20 us more than the busy time; that is the (negative) residual
    overlap = (0.100 + 0.050 + 0.080 + 0.030 + 0.200 + 0.040 + 0.010) - 0.480
    assert b.kernel_overlap_ms == pytest.approx(overlap) and b.residual_ms == pytest.approx(-overlap)


def test_steps_under_another_profiler_are_skipped(tiny, tmp_path):
    cb = OperatorTime(every_n_steps=1, first_step=0, plot=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.warns(UserWarning, match="another profiler is running"):
            tiny.fit(tmp_path, [cb], steps=1)
    assert cb.results == [] and dispatch.profile_ranges is False


def test_ranks_are_averaged(tiny, tmp_path):
    """With several ranks every profiled step is gathered and averaged on rank 0 (a second rank simulated here)."""
    from fly_lightning.callbacks import _common

    def two_ranks(obj):
        other = json.loads(json.dumps(obj))
        other["step_ms"] += 2.0
        other["parts_ms"]["overhead"] = other["parts_ms"].get("overhead", 0.0) + 2.0
        return [obj, other]

    cb = OperatorTime(every_n_steps=1, first_step=1, plot=False)
    with mock.patch.object(_common, "gather", side_effect=two_ranks) as gather:
        tiny.fit(tmp_path, [cb], steps=2)
    assert gather.call_count == 1
    (local,), (result,) = cb.local_results, cb.results
    assert result.ranks == 2 and result.step_ms == pytest.approx(local.step_ms + 1.0)
    assert result.parts_ms["overhead"] == pytest.approx(local.parts_ms["overhead"] + 1.0)
    assert result.residual_ms == pytest.approx(local.residual_ms)


def _end_of_fit(cb: OperatorTime, results: list[StepBreakdown], tmp_path) -> None:
    from types import SimpleNamespace

    cb.results, cb._dir = results, tmp_path
    cb.on_fit_end(SimpleNamespace(is_global_zero=True), None)


def _step(step: int, ms: float, device: str = "cpu") -> StepBreakdown:
    return StepBreakdown(step, device, ms, {"rms_norm/triton": ms / 2, "gemm": ms / 2}, ["rms_norm/triton"])


def test_one_slow_step_is_flagged_not_averaged_in(tmp_path, capsys, monkeypatch):
    # the case: one 3.7 s step among 58 ms ones made the table say 1280 ms/step
    monkeypatch.setenv("COLUMNS", "80")
    cb = OperatorTime(plot=False)
    results = [_step(5, 58.0), _step(15, 3700.0), _step(25, 57.0), _step(35, 59.0)]
    _end_of_fit(cb, results, tmp_path)
    out = capsys.readouterr().out
    assert "mean of 3 of 4 profiled steps" in out
    assert "58.000" in out and "1280" not in out and "968" not in out  # the table is the typical step's
    assert "step time over 4 profiled steps: median 58.5 ms, min 57.0, max 3700.0" in out
    assert "outlier step 15" in out and "left out of the table" in out
    saved = json.loads(cb.json_path.read_text())
    assert saved["step_ms"] == {"median": 58.5, "min": 57.0, "max": 3700.0, "n": 4, "outlier_steps": [15]}
    assert saved["typical"]["step_ms"] == pytest.approx(58.0)
    assert saved["mean"]["step_ms"] == pytest.approx((58 + 3700 + 57 + 59) / 4)
    assert max(len(line) for line in out.splitlines()) <= 80


def test_no_outlier_with_two_steps_or_an_even_spread(tmp_path, capsys):
    from fly_lightning.callbacks.op_time import step_spread

    assert step_spread([_step(1, 10.0), _step(2, 100.0)])["outlier_steps"] == []  # no majority to judge by
    assert step_spread([_step(1, 10.0), _step(2, 12.0), _step(3, 29.0)])["outlier_steps"] == []
    assert step_spread([_step(1, 10.0), _step(2, 12.0), _step(3, 37.0)])["outlier_steps"] == [3]


def test_missing_matplotlib_is_said_once(tmp_path, capsys, monkeypatch, recwarn):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    cb = OperatorTime()  # plot on by default: a missing matplotlib is not a silent skip
    assert cb.plot is True
    _end_of_fit(cb, [_step(5, 10.0)], tmp_path)
    out = capsys.readouterr().out
    assert out.count("op_time.png not written: matplotlib is not installed (pip install matplotlib)") == 1
    assert cb.png_path is None and not (tmp_path / "op_time.png").exists()
    assert not [w for w in recwarn if "matplotlib" in str(w.message)]  # said once, not also as a warning


def test_amdahl_bound_only_for_gpu_steps():
    from rich.console import Console

    def render(b: StepBreakdown) -> str:
        console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
        console.print(b.table())
        return console.export_text()

    assert "Amdahl" in render(_step(1, 10.0, "cuda")) and "Amdahl" not in render(_step(1, 10.0, "cpu"))


def test_small_parts_fold_into_one_row():
    parts = {"rms_norm/triton": 50.0, "gemm": 49.0, "optimizer": 0.3, "other": 0.4, "overhead": 0.3}
    b = StepBreakdown(1, "cpu", 100.0, parts, ["rms_norm/triton"])
    table = b.table()
    labels = list(table.columns[0].cells)
    assert "3 parts < 0.5% each" in labels and "optimizer" not in labels and "rms_norm/triton" in labels
    assert b.to_dict()["parts_ms"]["optimizer"] == 0.3  # the JSON keeps every part
