"""The callbacks on a real GPU: DispatchCoverage and OperatorTime on a short bf16 fit of a small transformer.

    python -m benchmarks.gpu_check_callbacks            # CUDA (the H200); about a minute, most of it start-up
    python -m benchmarks.gpu_check_callbacks --cpu      # dry run of this script on CPU (Triton interpreter, tiny)

Checks that on CUDA the breakdown is in device time, names our operator's backend, GEMM, the SDPA backend that ran
and the optimizer; that its parts add up to the measured step (residual within the kernel overlap + 2% + 0.05 ms);
that its kernel attribution agrees with torch's own per-op device totals on an independently profiled step; that the
profiler ran on the chosen steps only; and that the manifest is valid. Writes the CSV log, ``dispatch_manifest.json``,
``op_time.json``, ``op_time.png``, ``tables.txt`` and ``gpu_check_callbacks.json`` to ``$OUT/callbacks`` (or
``benchmarks/results/callbacks``); exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from unittest import mock

import torch
from torch import nn

from benchmarks.harness import results_dir

ap = argparse.ArgumentParser()
ap.add_argument("--cpu", action="store_true", help="dry run on CPU with the Triton interpreter")
ARGS = ap.parse_args()
if ARGS.cpu:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

import fly_lightning  # noqa: E402
from fly_lightning import dispatch  # noqa: E402
from fly_lightning.callbacks import DispatchCoverage, OperatorTime, analyse, load_manifest  # noqa: E402
from fly_lightning.callbacks.breakdown import _GEMM, OVERHEAD, STEP_RANGE  # noqa: E402

CPU = DeviceType.CPU

DEVICE = "cpu" if ARGS.cpu else "cuda"
D, HEADS, T, B, LAYERS = (32, 2, 8, 2, 1) if ARGS.cpu else (1024, 8, 1024, 8, 4)
STEPS, EVERY, FIRST = 8, 3, 2  # profiled batches 2 and 5
OUT = results_dir() / "callbacks"


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


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * B, T, D), torch.randn(STEPS * B, T, D))
    coverage, op_time = DispatchCoverage(dirpath=OUT), OperatorTime(every_n_steps=EVERY, first_step=FIRST, dirpath=OUT)
    trainer = pl.Trainer(
        accelerator="cpu" if ARGS.cpu else "gpu",
        devices=1,
        precision="32-true" if ARGS.cpu else "bf16-true",
        max_steps=STEPS,
        logger=CSVLogger(OUT, name="logs"),
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[coverage, op_time],
    )
    model = Model()
    with mock.patch.object(torch.profiler, "profile", wraps=torch.profiler.profile) as spy:
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=B))
    profiles = spy.call_count

    failures: list[str] = []

    def need(cond: bool, what: str) -> None:
        if not cond:
            failures.append(what)
            print(f"FAIL: {what}", file=sys.stderr)

    need(profiles == 2, f"profiler constructed {profiles} times, expected 2 (batches {FIRST}, {FIRST + EVERY})")
    need(dispatch.profile_ranges is False, "dispatch profile ranges left on after the fit")
    need(len(op_time.results) == 2, f"{len(op_time.results)} breakdowns, expected 2")
    for r in op_time.results:
        need(r.device == DEVICE, f"step {r.step}: breakdown in {r.device} time, expected {DEVICE}")
        labels = set(r.parts_ms)
        for label in ("rms_norm/triton", "rms_norm.backward/aten", "gemm", "optimizer"):
            need(label in labels, f"step {r.step}: no {label!r} part in {sorted(labels)}")
        sdpa = [x for x in labels if x.startswith("attention/")]
        need(len(sdpa) >= 1 and "attention/unknown" not in sdpa, f"step {r.step}: SDPA backend parts {sdpa}")
        bound = r.kernel_overlap_ms + 0.02 * r.step_ms + 0.05
        need(abs(r.residual_ms) <= bound, f"step {r.step}: residual {r.residual_ms:.3f} ms > {bound:.3f} ms")
        need(0.0 < r.coverage < 1.0, f"step {r.step}: coverage {r.coverage}")
    manifest = load_manifest(coverage.manifest_path)  # validates
    rms = manifest["ops"]["rms_norm"]
    need(rms["by_backend"].get("triton", 0) == rms["calls"] > 0, f"rms_norm not all on triton: {rms['by_backend']}")

    # independent cross-check of the kernel attribution against torch's own per-op device totals
    cross = _cross_check(model, data)
    if DEVICE == "cuda":
        for what in ("device", "gemm"):
            ours, theirs = cross[f"ours_{what}_ms"], cross[f"torch_{what}_ms"]
            why = f"{what} kernel time {ours:.3f} ms vs torch's {theirs:.3f} ms"
            need(abs(ours - theirs) <= 0.02 * theirs + 0.02, why)

    buf = io.StringIO()
    from rich.console import Console

    from fly_lightning.callbacks.breakdown import mean
    from fly_lightning.callbacks.dispatch_coverage import coverage_table

    console = Console(file=buf, width=160)
    console.print(coverage_table(manifest))
    console.print(mean(op_time.results).table("time by operator, mean of the profiled steps"))
    (OUT / "tables.txt").write_text(buf.getvalue())
    print(buf.getvalue())
    summary = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"d": D, "heads": HEADS, "t": T, "b": B, "layers": LAYERS},
        "profiles": profiles,
        "breakdowns": [r.to_dict() for r in op_time.results],
        "cross_check": cross,
        "failures": failures,
    }
    (OUT / "gpu_check_callbacks.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    print(f"{'FAILED' if failures else 'OK'}: {len(failures)} failure(s); outputs in {OUT}")
    return 1 if failures else 0


def _cross_check(model: Model, data: torch.utils.data.TensorDataset) -> dict[str, float]:
    """Profile one more step by hand; compare our device-time parts with torch's own totals (all device events, and
    the self device time of the GEMM ops in ``key_averages``; nothing else runs GEMMs in this model)."""
    model = model.to(DEVICE)
    x, y = (t[:B].to(DEVICE, next(model.parameters()).dtype) for t in data.tensors)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = lambda: (opt.zero_grad(), model.training_step((x, y), 0).backward(), opt.step())  # noqa: E731
    with mock.patch.object(model, "log"):
        step()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            dispatch.profile_ranges = True
            try:
                with torch.profiler.record_function(STEP_RANGE):
                    step()
                    if DEVICE == "cuda":
                        torch.cuda.synchronize()
            finally:
                dispatch.profile_ranges = False
    b = analyse(prof.events())
    events = prof.events()
    ranges = {e.name for e in events if e.device_type == CPU and getattr(e, "is_user_annotation", False)}
    # device events, less the GPU-side spans of record_function ranges (not kernels)
    device_events = [
        e
        for e in events
        if e.device_type != CPU and not getattr(e, "is_user_annotation", False) and e.name not in ranges
    ]
    gemm = sum(a.self_device_time_total for a in prof.key_averages() if a.key in _GEMM and a.device_type == CPU)
    return {
        "step_ms": b.step_ms,
        "overlap_ms": b.kernel_overlap_ms,
        "ours_device_ms": sum(v for k, v in b.parts_ms.items() if k != OVERHEAD),
        "torch_device_ms": sum(e.self_device_time_total for e in device_events) / 1e3,
        "ours_gemm_ms": b.parts_ms.get("gemm", 0.0),
        "torch_gemm_ms": gemm / 1e3,
    }


if __name__ == "__main__":
    sys.exit(main())
