"""MX quality apart from speed: the recipe's model fine-tuned the same way (seed, data, steps) in bf16, MXFP8 and
MXFP4 training mode (``--model.quant``: ``FlyMXConfig`` on every Linear and the MoE experts but the head and routers),
then its validation loss, side by side. MXFP8 runs in both scale modes (rceil, its default, and floor): the scale
rule judged apart from the element format. Runs anywhere (CPU: the MX GEMMs take the emulated ATen path).

    python -m benchmarks.bench_mx_quality [--steps 200] [--precision bf16-mixed] [--quants none,mxfp8,mxfp8:floor]
"""

from __future__ import annotations

import argparse
import time

from benchmarks.harness import Results

QUANTS = ("none", "mxfp8", "mxfp8:floor", "mxfp4")
"""``quant[:mode]``: the recipe's ``--model.quant``, and its ``--model.quant_mode`` (none given: the default)."""


def fine_tune(quant: str, steps: int, precision: str, seed: int = 0, val_batches: int = 8) -> dict:
    """One short fine-tune of the recipe's default model and data; the validation loss before and after."""
    import lightning as L

    import fly_lightning
    from fly_lightning import FlyMXConfig
    from fly_lightning.recipes.data import LMData
    from fly_lightning.recipes.moe_finetune import MoECausalLM

    L.seed_everything(seed, verbose=False)
    fly_lightning.DISPATCH_LOG.reset()  # this run's decisions only
    quant, _, mode = quant.partition(":")
    model = MoECausalLM(quant=quant, quant_mode=mode or None, export_dir=None)
    fmt = {"mxfp8": "mxfp8_e4m3", "mxfp4": "mxfp4_e2m1"}.get(quant)
    mode = FlyMXConfig(fmt, fmt, mode or None).spec.mode if fmt else "-"  # the mode the run used
    data = LMData(seed=seed)
    trainer = L.Trainer(
        strategy="flydsl",
        accelerator="auto",
        devices=1,
        precision=precision,
        max_steps=steps,
        limit_val_batches=val_batches,
        val_check_interval=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=data)
    fit_s = time.perf_counter() - t0
    after = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    # which backend served the MX GEMMs and casts (evidence that the quality is the kernels', not the emulation's)
    mx_ops = {op: s["by_backend"] for op, s in fly_lightning.DISPATCH_LOG.summary().items() if op.startswith("mx_")}
    return dict(
        quant=quant, mode=mode, precision=precision, steps=steps, val_loss_before=before, val_loss=after, fit_s=fit_s,
        mx_dispatch=str(mx_ops) if mx_ops else "-",
    )  # fmt: skip


def run(steps: int, precision: str, quants: tuple[str, ...] = QUANTS, val_batches: int = 8) -> Results:
    res = Results("mx_quality")
    rows = [fine_tune(q, steps, precision, val_batches=val_batches) for q in quants]
    ref = next((r["val_loss"] for r in rows if r["quant"] == "none"), None)
    for r in rows:
        res.add(**r, vs_bf16=None if ref is None else r["val_loss"] - ref)
    res.summary.update({f"{r['quant']}_{r['mode']}_val_loss".replace("_-", ""): round(r["val_loss"], 4) for r in rows})
    res.notes.append(
        "same seed, data and schedule for every row; quant none = the precision's own GEMMs (bf16 under bf16-mixed), "
        "mxfp8 = E4M3 weights and activations, mxfp4 = E2M1, in the scale mode named; straight-through backward in "
        "bf16; vs_bf16 = val_loss - the none row's (positive: worse); fit_s is the host time of fit, not a speed "
        "result; mx_dispatch: calls per backend of each MX op in that run (validation included)"
    )
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--quants", default=",".join(QUANTS))
    args = p.parse_args()
    res = run(args.steps, args.precision, tuple(args.quants.split(",")))
    print(res.save())
    print(res.markdown())


if __name__ == "__main__":
    main()
