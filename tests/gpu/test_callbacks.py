"""The callbacks on a real GPU: ``DispatchCoverage`` and ``OperatorTime`` on a short bf16 fit of a small transformer
(4 blocks of width 1024, 8 steps, two of them profiled).

Checks that the breakdown is in device time and names our operator's backend, GEMM, the SDPA backend that ran and the
optimizer; that its parts add up to the measured step (residual within the kernel overlap + 2% + 0.05 ms); that its
kernel attribution agrees with torch's own per-op device totals on an independently profiled step; that the profiler
ran on the chosen steps only; and that the manifest is valid with every RMSNorm call on Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

pytestmark = pytest.mark.gpu

D, HEADS, T, B, LAYERS = 1024, 8, 1024, 8, 4
STEPS, EVERY, FIRST = 8, 3, 2  # profiled batches 2 and 5


def _model() -> Any:
    """A LightningModule of ``LAYERS`` pre-norm blocks (``FlyRMSNorm``, SDPA, GELU MLP), MSE loss, AdamW."""
    import lightning.pytorch as pl
    from torch import nn

    import fly_lightning

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = fly_lightning.FlyRMSNorm(D), fly_lightning.FlyRMSNorm(D)
            self.qkv, self.proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D, bias=False), nn.GELU(), nn.Linear(4 * D, D, bias=False))

        def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(self.norm1(x_BTD)).view(B, T, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
            a_BNTK = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x_BTD = x_BTD + self.proj(a_BNTK.transpose(1, 2).reshape(B, T, D))
            return x_BTD + self.mlp(self.norm2(x_BTD))

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.blocks(x).float(), y.float())
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Model()


@dataclass
class Fit:
    profiles: int
    profile_ranges_after: bool
    results: list  # OperatorTime's StepBreakdowns
    manifest: dict
    cross: dict[str, float]


@pytest.fixture(scope="module")
def fit(tmp_path_factory: pytest.TempPathFactory) -> Fit:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from fly_lightning import dispatch
    from fly_lightning.callbacks import DispatchCoverage, OperatorTime, load_manifest

    out = tmp_path_factory.mktemp("callbacks")
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * B, T, D), torch.randn(STEPS * B, T, D))
    coverage, op_time = DispatchCoverage(dirpath=out), OperatorTime(every_n_steps=EVERY, first_step=FIRST, dirpath=out)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        precision="bf16-true",
        max_steps=STEPS,
        logger=CSVLogger(out, name="logs"),
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[coverage, op_time],
    )
    model = _model()
    with mock.patch.object(torch.profiler, "profile", wraps=torch.profiler.profile) as spy:
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=B))
    return Fit(
        profiles=spy.call_count,
        profile_ranges_after=dispatch.profile_ranges,
        results=list(op_time.results),
        manifest=load_manifest(coverage.manifest_path),  # validates
        cross=_cross_check(model, data, Path(out)),
    )


def _cross_check(model: Any, data: torch.utils.data.TensorDataset, out: Path) -> dict[str, float]:
    """Profile one more step by hand; our device-time parts against torch's own totals (all device events, and the
    self device time of the GEMM ops in ``key_averages``; nothing else runs GEMMs in this model)."""
    from torch.autograd import DeviceType

    from fly_lightning import dispatch
    from fly_lightning.callbacks import analyse
    from fly_lightning.callbacks.breakdown import _GEMM, OVERHEAD, STEP_RANGE

    model = model.to("cuda")
    x, y = (t[:B].to("cuda", next(model.parameters()).dtype) for t in data.tensors)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad()
        model.training_step((x, y), 0).backward()
        opt.step()

    with mock.patch.object(model, "log"):
        step()
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            dispatch.profile_ranges = True
            try:
                with torch.profiler.record_function(STEP_RANGE):
                    step()
                    torch.cuda.synchronize()
            finally:
                dispatch.profile_ranges = False
    events = prof.events()
    b = analyse(events)
    cpu = DeviceType.CPU
    ranges = {e.name for e in events if e.device_type == cpu and getattr(e, "is_user_annotation", False)}
    # device events, less the GPU-side spans of record_function ranges (not kernels)
    annotation = lambda e: getattr(e, "is_user_annotation", False) or e.name in ranges
    device_events = [e for e in events if e.device_type != cpu and not annotation(e)]
    gemm = sum(a.self_device_time_total for a in prof.key_averages() if a.key in _GEMM and a.device_type == cpu)
    return {
        "step_ms": b.step_ms,
        "overlap_ms": b.kernel_overlap_ms,
        "ours_device_ms": sum(v for k, v in b.parts_ms.items() if k != OVERHEAD),
        "torch_device_ms": sum(e.self_device_time_total for e in device_events) / 1e3,
        "ours_gemm_ms": b.parts_ms.get("gemm", 0.0),
        "torch_gemm_ms": gemm / 1e3,
    }


def test_profiler_runs_on_the_chosen_steps_only(fit: Fit):
    expected = f"expected 2 (batches {FIRST}, {FIRST + EVERY})"
    assert fit.profiles == 2, f"profiler constructed {fit.profiles} times, {expected}"
    assert fit.profile_ranges_after is False, "dispatch profile ranges left on after the fit"
    assert len(fit.results) == 2


def test_breakdown_names_the_parts_in_device_time(fit: Fit):
    for r in fit.results:
        assert r.device == "cuda", f"step {r.step}"
        labels = set(r.parts_ms)
        for label in ("rms_norm/triton", "rms_norm.backward/aten", "gemm", "optimizer"):
            assert label in labels, f"step {r.step}: no {label!r} part in {sorted(labels)}"
        sdpa = [x for x in labels if x.startswith("attention/")]
        assert sdpa and "attention/unknown" not in sdpa, f"step {r.step}: SDPA backend parts {sdpa}"
        assert 0.0 < r.coverage < 1.0, f"step {r.step}: coverage {r.coverage}"


def test_breakdown_parts_add_up_to_the_step(fit: Fit, record_property):
    for r in fit.results:
        bound = r.kernel_overlap_ms + 0.02 * r.step_ms + 0.05
        record_property(f"step{r.step}_residual_ms", round(r.residual_ms, 4))
        record_property(f"step{r.step}_step_ms", round(r.step_ms, 3))
        assert abs(r.residual_ms) <= bound, f"step {r.step}: residual {r.residual_ms:.3f} ms > {bound:.3f} ms"


def test_manifest_has_every_rms_norm_call_on_triton(fit: Fit):
    rms = fit.manifest["ops"]["rms_norm"]
    assert rms["calls"] > 0 and rms["by_backend"].get("triton", 0) == rms["calls"], rms["by_backend"]


@pytest.mark.parametrize("what", ["device", "gemm"])
def test_kernel_attribution_agrees_with_torch_totals(fit: Fit, what: str, record_property):
    ours, theirs = fit.cross[f"ours_{what}_ms"], fit.cross[f"torch_{what}_ms"]
    record_property(f"ours_{what}_ms", round(ours, 4))
    record_property(f"torch_{what}_ms", round(theirs, 4))
    assert abs(ours - theirs) <= 0.02 * theirs + 0.02, f"{what} kernel time {ours:.3f} ms vs torch's {theirs:.3f} ms"
