"""Host time of one eager routing call on the GPU machine, taken apart layer by layer.

The routing suite's eager column (``moe_route.md``) costs 0.09-0.18 ms per call where the kernel itself takes 2-54
us: eager calls are bound by the host. This probe times, per call, each layer from the public entry down to Triton's
launch, with the outputs' allocations and a one-argument Triton launch for scale, so the next change goes where the
time is. Each figure is the best of 5 rounds of the mean over 2000 back-to-back calls (every layer timed in turn in
each round), the GPU synchronised at both ends; the kernel is short enough that the host, not the GPU, sets the pace
(its CUDA-graph replay time is reported alongside). A small MoE block's forward and backward is timed too, with its
backward passes calling their ATen formulas directly and, side by side, through their custom ops.

    python -m benchmarks.probe_route_host
"""

from __future__ import annotations

import importlib
import time

import torch
import triton
import triton.language as tl

import fly_lightning
from benchmarks.bench_moe_route import aten_route
from benchmarks.harness import Results, time_graph_ms
from fly_lightning.kernels.triton import moe_route as tri
from fly_lightning.kernels.triton import rms_norm as tri_rms
from fly_lightning.modules.moe import FlyMoE
from fly_lightning.ops.moe_route import MOE_ROUTE, moe_route_op
from fly_lightning.ops.rms_norm import RMS_NORM, rms_norm_op

CASES = [("mixtral", 16384, 8, 2), ("qwen3-moe", 16384, 128, 8)]


@triton.jit
def _one_arg(X):
    tl.store(X + tl.program_id(0), 1.0)


def mean_call_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def per_call_us(layers: dict, calls: int = 2000, rounds: int = 5) -> dict[str, float]:
    """Best per layer over ``rounds`` rounds that time every layer in turn (a slow spell of the host then hits all
    layers alike, not whichever ran during it)."""
    for fn in layers.values():
        mean_call_us(fn, 20)
    best = dict.fromkeys(layers, float("inf"))
    for _ in range(rounds):
        for name, fn in layers.items():
            best[name] = min(best[name], mean_call_us(fn, calls))
    return best


def _layers(t: int, e: int, k: int) -> tuple[dict, torch.Tensor]:
    """What is timed for one shape: each layer of an eager call, from the public entry down to Triton's launch."""
    logits = torch.randn(t, e, device="cuda", dtype=torch.bfloat16)
    args = (logits, k, "softmax", True, None, 1.0, None, None, False)
    grad_args = (logits.detach().requires_grad_(), *args[1:])  # a training step's router logits
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

    layers = {
        "public moe_route": lambda: fly_lightning.moe_route(logits, k),
        "public moe_route, logits requiring grad (eager autograd.Function)": lambda: fly_lightning.moe_route(
            grad_args[0], k
        ),
        "custom op, logits requiring grad": lambda: moe_route_op(*grad_args),
        "custom op (autograd wrapper)": lambda: moe_route_op(*args),
        "dispatcher (MOE_ROUTE)": lambda: MOE_ROUTE(*args),
        "triton backend": lambda: tri.moe_route_triton(*args),
        "triton launch only": lambda: tri._moe_route_fwd[(plan.programs,)](*runtime, **plan.constexprs),
        "six output allocations": alloc,
        "launch plan lookup": lambda: tri._plan(*plan_args),
        "ATen sequence": lambda: aten_route(logits, k, "softmax", True, None, 1.0, None, None),
    }
    return layers, logits


def _rms_layers() -> dict:
    """The same question for RMSNorm, the op a training step calls most: a small [16, 4096] bf16 input."""
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.nn.Parameter(torch.ones(4096, device="cuda", dtype=torch.bfloat16))  # a module's weight
    xg = x.detach().requires_grad_()
    no_grad_rms_norm = torch.no_grad()(fly_lightning.rms_norm)
    y, rstd = tri_rms.rms_norm_triton(x, w, 1e-6, 0.0, False)  # autotunes once: the tuned config below is its pick
    best = tri_rms._rms_norm_rows_tuned.best_config
    rows, consts = best.kwargs["ROWS"], dict(H=4096, BLOCK=4096, CHUNKED=False, HAS_W=True, CAST_FIRST=False)
    args = (x, w, y, rstd, 16, 4096, 4096, 1e-6, 0.0)

    def alloc() -> None:
        torch.empty(x.shape, dtype=x.dtype, device=x.device)
        torch.empty((16, 1), dtype=torch.float32, device=x.device)

    return {
        "public rms_norm, input requiring grad": lambda: fly_lightning.rms_norm(xg, w, 1e-6),
        "custom op, input requiring grad": lambda: rms_norm_op(xg, w, 1e-6, 0.0, False),
        "public rms_norm, no grad": lambda: no_grad_rms_norm(x, w, 1e-6),
        "F.rms_norm, input requiring grad": lambda: torch.nn.functional.rms_norm(xg, (4096,), w, 1e-6),
        "dispatcher (RMS_NORM)": lambda: RMS_NORM(x, w, 1e-6, 0.0, False),
        "triton backend": lambda: tri_rms.rms_norm_triton(x, w, 1e-6, 0.0, False),
        "two output allocations": alloc,
        "autotuned launch only": lambda: tri_rms._rms_norm_rows_tuned[lambda m: (triton.cdiv(16, m["ROWS"]),)](
            *args, **consts
        ),
        f"launch with the tuned config ({best}) only": lambda: tri_rms._rms_norm_rows[(triton.cdiv(16, rows),)](
            *args, ROWS=rows, num_warps=best.num_warps, **consts
        ),
    }


_BACKWARD_CALLS = {  # module -> (its eager backward call, the custom op it bypasses outside tracing)
    "grouped_mm": ("_grouped_mm_backward_call", "grouped_mm_backward_op"),
    "moe_grouped_mm": ("_moe_grouped_mm_backward_call", "moe_grouped_mm_backward_op"),
    "moe_combine": ("_moe_combine_backward_call", "moe_combine_backward_op"),
    "swiglu": ("_swiglu_backward_call", "swiglu_backward_op"),
}


class _OpaqueBackward:
    """While entered, eager backward passes call their custom ops again (the path before ``traced_or_direct``)."""

    def __enter__(self) -> None:
        self.saved = {}
        for name, (call, custom) in _BACKWARD_CALLS.items():
            module = importlib.import_module(f"fly_lightning.ops.{name}")
            self.saved[module] = getattr(module, call)
            setattr(module, call, getattr(module, custom))

    def __exit__(self, *exc) -> None:
        for module, fn in self.saved.items():
            setattr(module, _BACKWARD_CALLS[module.__name__.rsplit(".", 1)[1]][0], fn)


def _moe_step_layers() -> dict:
    """A small ``FlyMoE`` block's forward and backward (64 tokens, 8 experts, top-2, bf16): host-bound, so the
    time per step is the host's. Side by side: the eager backward calling its ATen formulas directly, and through
    the backward custom ops as before."""
    moe = FlyMoE(256, 128, 8, 2, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step() -> None:
        y = moe(x)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(torch.ones_like(y))

    def step_opaque() -> None:
        with _OpaqueBackward():
            step()

    return {
        "FlyMoE forward+backward, backward formulas called directly": step,
        "FlyMoE forward+backward, backward through the custom ops": step_opaque,
    }


def main() -> None:
    res = Results("route_host")
    scratch = torch.empty(1, device="cuda")
    tiny = per_call_us({"tiny": lambda: _one_arg[(1,)](scratch)})["tiny"]
    res.add(case="-", layer="one-argument Triton launch", host_us=round(tiny, 2))
    for name, t, e, k in CASES:
        layers, logits = _layers(t, e, k)
        for layer, us in per_call_us(layers).items():
            res.add(case=name, T=t, E=e, k=k, layer=layer, host_us=round(us, 2))
        graph_ms = time_graph_ms(lambda x, k=k: fly_lightning.moe_route(x, k), [(logits,)])["median_ms"]
        res.add(
            case=name, T=t, E=e, k=k, layer="kernel, CUDA-graph replay (device time)", host_us=round(graph_ms * 1e3, 2)
        )
    for layer, us in per_call_us(_rms_layers()).items():
        res.add(case="rms_norm", T=16, E=4096, layer=layer, host_us=round(us, 2))
    for layer, us in per_call_us(_moe_step_layers(), calls=300).items():
        res.add(case="moe_block", T=64, E=8, k=2, layer=layer, host_us=round(us, 2))
    res.notes.append("per layer: the best of 5 rounds, each round timing every layer in turn as the mean over 2000 "
                     "back-to-back eager calls, synchronised at both ends; deterministic algorithms off")  # fmt: skip
    path = res.save()
    print(res.markdown())
    print(f"written {path}")


if __name__ == "__main__":
    main()
