"""Pre-tune a transformers model's shapes offline: ``fly-lightning tune --hf-config DIR`` runs this in a child
process with measured selection on and the tuning database chosen by the command.

The model is built from its config with random weights (``AutoModelForCausalLM.from_config``), swapped with
``fly_lightning.transform`` and run forward and backward on random tokens at the training run's batch size and
sequence length: every operator shape and grouped GEMM shape class the run will meet is measured once and stored.
Shapes are what matter here; routing loads of random weights differ from a trained model's, which changes only how
tokens spread over experts, not the shapes measured.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

# Lightning's precision names: (parameter dtype, bf16 autocast)
PRECISIONS = {
    "bf16-true": (torch.bfloat16, False),
    "bf16-mixed": (torch.float32, True),
    "32-true": (torch.float32, False),
}


def tune_hf_model(
    config: str, batch_size: int, seq_len: int, steps: int = 2, precision: str = "bf16-true"
) -> dict[str, int]:
    """Run ``steps`` forward+backward passes of the swapped model under ``select="measure"``; returns the number of
    decisions per backend."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import fly_lightning

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if batch_size < 1 or seq_len < 1 or steps < 1:
        raise ValueError("batch size, sequence length and steps must be positive")
    dtype, autocast = PRECISIONS[precision]
    cfg = AutoConfig.from_pretrained(config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.train()
    fly_lightning.transform(model)
    g = torch.Generator().manual_seed(0)
    with fly_lightning.dispatch_config(select="measure"):
        for _ in range(steps):
            ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), generator=g).to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
    counts: dict[str, int] = {}
    for d in fly_lightning.DISPATCH_LOG.decisions:
        counts[d.backend] = counts.get(d.backend, 0) + 1
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fly_lightning.pretune", description=__doc__.splitlines()[0])
    p.add_argument("config", help="a model directory or config.json (only the config is read)")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--precision", default="bf16-true", choices=sorted(PRECISIONS))
    a = p.parse_args(argv)
    counts = tune_hf_model(a.config, a.batch_size, a.seq_len, a.steps, a.precision)
    print("decisions by backend: " + ", ".join(f"{b} {n}" for b, n in sorted(counts.items())))
    from fly_lightning import DISPATCH_LOG

    if unmeasured := [d for d in DISPATCH_LOG.decisions if "tuning budget" in d.reason]:
        print(f"{len(unmeasured)} shape(s) not measured: the tuning budget (FLY_LIGHTNING_TUNING_BUDGET_S) ran out")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
