"""MX dequantisation (MX elements + E8M0 scales -> bf16, as frozen MX weights run every step): ours (the dispatched
``mx_dequantize``) against the ATen path (``formats.from_mx``, torchao's arithmetic through fp32) eager and under
``torch.compile``, and torchao's ``MXTensor.dequantize``; the share of copy bandwidth (GPU).

Every case is checked equal to the reference before it is timed (NaN blocks: NaN in both). Device times from CUDA-graph
replays, side by side in rotated rounds, inputs rotated through more than 3x the L2. Bytes moved = elements and scales
read + bf16 written. No goal: the frozen-MX step times in ``mx_memory`` are what users see.

    python -m benchmarks.bench_mx_dequantize      # writes mx_dequantize.json/.md
"""

from __future__ import annotations

import logging

import torch

import fly_lightning
from benchmarks.harness import (
    Results,
    backend_of,
    capture_graph,
    copy_bandwidth_gbps,
    geomean,
    interleaved_graph_ms,
    rotation_count,
)
from fly_lightning.quant import formats

CASES = [  # (rows, K, format): Qwen3-30B-A3B expert weights [E * N, K] (gate_up, down) and an activation
    (128 * 1536, 2048, "mxfp8_e4m3"),
    (128 * 2048, 768, "mxfp8_e4m3"),
    (128 * 1536, 2048, "mxfp4_e2m1"),
    (128 * 2048, 768, "mxfp4_e2m1"),
    (16384, 4096, "mxfp8_e5m2"),
]
CALLS_PER_GRAPH = 10


def _bytes(rows: int, k: int, fmt: str) -> int:
    return rows * k // formats.FORMATS[fmt].per_byte + rows * k // formats.BLOCK + rows * k * 2


def main() -> None:
    logging.getLogger("torchao").setLevel(logging.ERROR)
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    def aten(d: torch.Tensor, s: torch.Tensor, fmt: str) -> torch.Tensor:
        return formats.from_mx(d, s, fmt, torch.bfloat16)

    compiled = torch.compile(aten, dynamic=False)
    res = Results("mx_dequantize")
    copy_gbps = copy_bandwidth_gbps()
    for rows, k, fmt in CASES:
        nbytes = _bytes(rows, k, fmt)
        sets = rotation_count(nbytes, max_sets=4)
        f = formats.FORMATS[fmt]
        inputs = [
            formats.to_mx(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), fmt) for _ in range(sets)
        ]  # fmt: skip
        d, s = inputs[0]
        y = fly_lightning.mx_dequantize(d, s, fmt)
        want = aten(d, s, fmt)
        exact = torch.equal(y.isnan(), want.isnan()) and torch.equal(y[~want.isnan()], want[~want.isnan()])
        row = dict(case=f"{rows}x{k} {fmt}", mbytes=round(nbytes / 2**20, 1))
        row.update(backend=backend_of("mx_dequantize", d, s, fmt, torch.bfloat16), exact=exact)
        if not exact:
            res.add(**row)
            continue

        def torchao(d: torch.Tensor, s: torch.Tensor, elem: torch.dtype = f.torch_dtype) -> torch.Tensor:
            return MXTensor(d, s, elem, 32, torch.bfloat16, None, None, False).dequantize(torch.bfloat16)

        fns = {
            "ours": lambda d, s, fmt=fmt: fly_lightning.mx_dequantize(d, s, fmt),
            "aten": lambda d, s, fmt=fmt: aten(d, s, fmt),
            "aten_compiled": lambda d, s, fmt=fmt: compiled(d, s, fmt),
        }
        try:
            torchao(d, s)
            fns["torchao"] = torchao
        except Exception as exc:  # noqa: BLE001 (another torchao's MXTensor signature: named, not fatal)
            row["torchao"] = f"{type(exc).__name__}: {str(exc)[:80]}"
        graphs = {n: capture_graph(fn, inputs, CALLS_PER_GRAPH) for n, fn in fns.items()}
        ms = interleaved_graph_ms(graphs, CALLS_PER_GRAPH)
        del graphs
        base = min(t for n, t in ms.items() if n != "ours")
        row.update({f"{n}_ms": round(t, 4) for n, t in ms.items()})
        row.update(speedup=base / ms["ours"], copy_share=nbytes / ms["ours"] / 1e6 / copy_gbps)
        res.add(**row)
        del inputs
    res.summary = {
        "copy_bandwidth_gbps": copy_gbps,
        "geomean_speedup_vs_fastest_other": geomean([r["speedup"] for r in res.rows if "speedup" in r]),
        "min_copy_share": min((r["copy_share"] for r in res.rows if "copy_share" in r), default=None),
        "all_exact": all(r["exact"] for r in res.rows),
    }
    res.notes.append("speedup = the fastest of ATen eager, ATen compiled and torchao's MXTensor.dequantize over ours")
    res.notes.append("copy_share = (elements + scales read, bf16 written) / our time, over the measured copy bandwidth")
    print(res.save())
    print(res.markdown())


if __name__ == "__main__":
    main()
