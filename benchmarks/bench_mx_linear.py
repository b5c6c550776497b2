"""MX training Linear (GPU): one ``FlyMXLinear`` forward and forward+backward in each GEMM form, side by side with the
bf16 ``nn.Linear`` it replaces, to choose ``kernel_preference="auto"`` by measurement.

- ``mx_gemm``: cast activations and weight to MX bytes (``mx_cast``), then ``mx_scaled_mm`` (on Hopper from 128
  rows its prepass re-expresses both for cuBLAS's blockwise fp8 GEMM with a bf16 output, else dequantises to bf16);
- ``emulated``: fake-quantise both (``mx_fake_quantize``, one pass each), then cuBLAS on those bf16 values;
- ``bf16``: ``nn.Linear`` (the layer before conversion: a precision change, not a baseline for speed claims).

Cases: projections at training token counts and two below 128 rows, bf16, and one fp32 (masters without autocast).
Geomeans over the bf16 cases, from and below 128 rows (``auto`` takes the emulated form for bf16 at every row count,
from this suite's results; see ``fly_lightning.ops.mx_scaled_mm.emulated_form``).

Every case first compares the two forms' outputs (``forms_equal``, ``forms_max_diff``): bit for bit from 128 rows
where both end in the same bf16 values and the same cuBLAS GEMM (fp32 layers); bf16 MX x MX layers there take the fp8
GEMM, whose sums differ in the last bits (MXFP8; MXFP4's products sum exactly); below 128 rows the MX GEMM's in-loop
kernel sums in its own order. Event-timed eager calls (host included, as a training step runs them), the variants
taking turns in rotated rounds; inputs and layers (their weights) rotated through more than the L2. ``x_emulated`` =
mx_gemm time / emulated time.

    python -m benchmarks.bench_mx_linear      # writes mx_linear.json/.md
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from benchmarks.harness import Results, geomean, interleaved_ms, rotation_count

CASES = [  # (M tokens, K in, N out): Llama-style projections at training token counts, and two below 128 rows
    (16, 4096, 4096),
    (64, 4096, 14336),
    (1024, 4096, 4096),
    (4096, 4096, 4096),
    (8192, 4096, 14336),
    (8192, 14336, 4096),
    (16384, 2048, 2048),
]
FORMATS = ("mxfp8_e4m3", "mxfp4_e2m1")
FP32_CASES = [(4096, 4096, 4096)]  # fp32 masters without autocast (Lightning's 32-true): MXFP8 only
FORMS = ("mx_gemm", "emulated")


def _layers(k: int, n: int, fmt: str, dtype: torch.dtype) -> dict[str, nn.Module]:
    from fly_lightning.quant.linear import FlyMXLinear, MXSpec

    torch.manual_seed(0)
    base = nn.Linear(k, n, bias=False, device="cuda", dtype=dtype)
    out: dict[str, nn.Module] = {"bf16": base}
    for form in FORMS:
        out[form] = FlyMXLinear.from_linear(base, MXSpec(fmt, fmt, kernel_preference=form))
    return out


def main() -> None:
    logging.getLogger("torchao").setLevel(logging.ERROR)
    res = Results("mx_linear")
    runs = [(f, c, torch.bfloat16) for f in FORMATS for c in CASES] + [
        (FORMATS[0], c, torch.float32) for c in FP32_CASES
    ]
    for fmt, (m, k, n), dtype in runs:
        size = torch.finfo(dtype).bits // 8
        # weights rotate with the activations: at few rows they are most of the bytes, and one layer reused by every
        # call would be read from the L2
        sets = rotation_count(size * (m * (k + n) + k * n), max_sets=8)
        layer_sets = [_layers(k, n, fmt, dtype) for _ in range(sets)]
        xs = [(torch.randn(m, k, device="cuda", dtype=dtype, requires_grad=True), i) for i in range(sets)]
        gy = torch.randn(m, n, device="cuda", dtype=dtype)
        x0, layers = xs[0][0], layer_sets[0]
        with torch.no_grad():
            y_mx, y_em = layers["mx_gemm"](x0), layers["emulated"](x0)
        row = dict(case=f"{fmt} {m}x{k}x{n} {str(dtype)[6:]}", fmt=fmt, m=m, k=k, n=n, dtype=str(dtype)[6:])
        row.update(forms_equal=torch.equal(y_mx, y_em), forms_max_diff=(y_mx - y_em).abs().max().item())

        def fwd(x: torch.Tensor, layer: nn.Module) -> None:
            with torch.no_grad():
                layer(x)

        def step(x: torch.Tensor, layer: nn.Module, gy: torch.Tensor = gy) -> None:
            torch.autograd.grad(layer(x), (x, layer.weight), gy)  # no accumulation into .grad

        for kind, fn in (("fwd", fwd), ("step", step)):
            fns = {name: (lambda x, i, f=fn, name=name, ls=layer_sets: f(x, ls[i][name])) for name in layers}
            ms = interleaved_ms(fns, xs, reps=30)
            row.update({f"{kind}_{name}_ms": round(t, 4) for name, t in ms.items()})
            row[f"{kind}_x_emulated"] = ms["mx_gemm"] / ms["emulated"]
            row[f"{kind}_emulated_of_bf16"] = ms["bf16"] / ms["emulated"]
        res.add(**row)
        del xs, layers, layer_sets
    for kind in ("fwd", "step"):
        for fmt in FORMATS:
            for part, keep in (("m128", lambda m: m >= 128), ("small_m", lambda m: m < 128)):
                rows = [r for r in res.rows if r["fmt"] == fmt and r["dtype"] == "bfloat16" and keep(r["m"])]
                res.summary[f"{fmt}_{kind}_{part}_geomean_x_emulated"] = geomean(
                    [r[f"{kind}_x_emulated"] for r in rows]
                )
            rows = [r for r in res.rows if r["fmt"] == fmt and r["dtype"] == "bfloat16" and r["m"] >= 128]
            res.summary[f"{fmt}_{kind}_m128_geomean_emulated_of_bf16"] = geomean(
                [r[f"{kind}_emulated_of_bf16"] for r in rows]
            )
    res.summary["forms_equal_from_128_rows"] = all(r["forms_equal"] for r in res.rows if r["m"] >= 128)
    res.summary["forms_unequal"] = [r["case"] for r in res.rows if not r["forms_equal"]]  # below 128 rows too
    res.notes.append(
        "x_emulated: mx_gemm form time / emulated form time (above 1: emulated faster); m128 / small_m: "
        "geomeans over the bf16 cases from / below 128 rows (auto takes emulated for bf16 at both)"
    )
    res.notes.append("emulated_of_bf16: bf16 nn.Linear time / emulated time (the cost of MX numerics, below 1)")
    res.notes.append("fwd: forward under no_grad; step: forward + backward (straight-through, bf16 gradients)")
    print(res.save())
    print(res.markdown())


if __name__ == "__main__":
    main()
