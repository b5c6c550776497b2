"""Host time of one eager routing call on the GPU machine, taken apart layer by layer.

The routing suite's eager column (``moe_route.md``) costs 0.09-0.18 ms per call where the kernel itself takes 2-54
us: eager calls are bound by the host. This probe times, per call, each layer from the public entry down to Triton's
launch, with the outputs' allocations and a one-argument Triton launch for scale, so the next change goes where the
time is. Each figure is the best of 5 repeats of the mean over 2000 back-to-back calls, the GPU synchronised at the
end of each repeat; the kernel is short enough that the host, not the GPU, sets the pace (checked: the graph replay
time is printed alongside).

    python -m benchmarks.probe_route_host
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

import fly_lightning
from benchmarks.bench_moe_route import aten_route
from benchmarks.harness import Results, time_graph_ms
from fly_lightning.kernels.triton import moe_route as tri
from fly_lightning.ops.moe_route import MOE_ROUTE, moe_route_op

CASES = [("mixtral", 16384, 8, 2), ("qwen3-moe", 16384, 128, 8)]


@triton.jit
def _one_arg(X):
    tl.store(X + tl.program_id(0), 1.0)


def per_call_us(fn, calls: int = 2000, repeats: int = 5) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def _layers(t: int, e: int, k: int) -> dict:
    """What is timed for one shape: each layer of an eager call, from the public entry down to Triton's launch."""
    logits = torch.randn(t, e, device="cuda", dtype=torch.bfloat16)
    args = (logits, k, "softmax", True, None, 1.0, None, None, False)
    dev = logits.device
    plan_args = (t, e, k, logits.dtype, e, "softmax", True, False, None, None, False, dev, None, False)
    plan = tri._plan(*plan_args)
    w = torch.empty(t, k, device=dev)
    ids = torch.empty(t, k, device=dev, dtype=torch.int32)
    counts = torch.empty(e, device=dev, dtype=torch.int32)
    offsets = torch.empty(e, device=dev, dtype=torch.int32)
    ws = tri._workspace(dev, 2 * e)[: 2 * e].view(torch.int64) if plan.packed_tail else tri._workspace(dev, 1 + e)
    runtime = (logits, e, logits, w, ids, ids, counts, counts, offsets, ws, t, plan.tiles, plan.tiles_per_program, 1.0)

    def alloc():
        for shape, dtype in (((t, k), torch.float32), ((t, k), torch.int32), ((e,), torch.int32), ((e,), torch.int32),
                             ((0,), torch.int32), ((0,), torch.int32)):  # fmt: skip
            torch.empty(shape, dtype=dtype, device=dev)

    return {
        "public moe_route": lambda: fly_lightning.moe_route(logits, k),
        "custom op (autograd wrapper)": lambda: moe_route_op(*args),
        "dispatcher (MOE_ROUTE)": lambda: MOE_ROUTE(*args),
        "triton backend": lambda: tri.moe_route_triton(*args),
        "triton launch only": lambda: tri._moe_route_fwd[(plan.programs,)](*runtime, **plan.constexprs),
        "six output allocations": alloc,
        "launch plan lookup": lambda: tri._plan(*plan_args),
        "ATen sequence": lambda: aten_route(logits, k, "softmax", True, None, 1.0, None, None),
        "graph replay (device time)": lambda: fly_lightning.moe_route(logits, k),
    }


def main() -> None:
    res = Results("route_host")
    scratch = torch.empty(1, device="cuda")
    res.add(
        case="-", layer="one-argument Triton launch", host_us=round(per_call_us(lambda: _one_arg[(1,)](scratch)), 2)
    )
    for name, t, e, k in CASES:
        for layer, fn in _layers(t, e, k).items():
            if layer.startswith("graph"):
                us = time_graph_ms(lambda f=fn: f(), [()])["median_ms"] * 1e3
            else:
                us = per_call_us(fn)
            res.add(case=name, T=t, E=e, k=k, layer=layer, host_us=round(us, 2))
    res.notes.append("best of 5 repeats of the mean over 2000 eager calls, synchronised per repeat; deterministic off")
    path = res.save()
    print(res.markdown())
    print(f"written {path}")


if __name__ == "__main__":
    main()
