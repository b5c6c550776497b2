"""Probe (GPU): launch plans of the column-wise Triton ``mx_fake_quantize`` (MoE experts stored K-major, fake-quantised
every training step under ``FlyMXConfig``'s emulated form). Its ``COLS_PLAN`` was (64, 2, 4) until 0fbac22, the
four-warp tile that ran the column-wise ``mx_cast`` at 20-22% of copy bandwidth on the H200, where one warp per
program gave 83-85%; this probe measured the same for it (``COLS_PLAN``'s docstring) and it now takes one warp.

Per format, 4096x16384 bf16 (the mx_cast suite's column case) rotated through more than 3x the L2: each plan's
output compared with ``COLS_PLAN``'s first ("!" marks a difference), then event-timed; share = 4 bytes moved per
element / time / copy bandwidth. Prints; not a suite.

    python -m benchmarks.probe_mx_fake_quant_cols
"""

from __future__ import annotations

import torch

from benchmarks.harness import copy_bandwidth_gbps, rotation_count, time_ms
from fly_lightning.kernels.triton import mx_fake_quantize as fq

PLANS = [(64, 2, 4), (64, 1, 1), (128, 1, 1), (64, 2, 1), (32, 2, 1), (128, 1, 2), (256, 1, 2)]
SHAPE = (4096, 16384)


def main() -> None:
    copy = copy_bandwidth_gbps()
    nbytes = SHAPE[0] * SHAPE[1] * 2
    sets = [torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(rotation_count(2 * nbytes))]
    default = fq.COLS_PLAN
    for fmt in ("mxfp8_e4m3", "mxfp4_e2m1"):
        for mode in ("floor", "rceil"):
            ref = fq.launch(sets[0], fmt, mode, axis=0)
            shares = {}
            for plan in PLANS:
                fq.COLS_PLAN = plan
                try:
                    same = torch.equal(fq.launch(sets[0], fmt, mode, axis=0).view(torch.int16), ref.view(torch.int16))
                    fn = lambda x, fmt=fmt, mode=mode: fq.launch(x, fmt, mode, axis=0)  # noqa: E731
                    ms = time_ms(fn, [(x,) for x in sets], reps=60)["median_ms"]
                    shares["x".join(map(str, plan))] = f"{2 * nbytes / (ms * 1e6) / copy:.3f}" + ("" if same else " !")
                finally:
                    fq.COLS_PLAN = default
            print(f"{fmt} {mode} column-wise {SHAPE[0]}x{SHAPE[1]} bf16 (copy {copy:.0f} GB/s): {shares}", flush=True)


if __name__ == "__main__":
    main()
