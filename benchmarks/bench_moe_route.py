"""MoE routing suite (GPU): ``fly_lightning.moe_route`` against the ATen routing sequence and ``torch.compile`` of it,
with deterministic algorithms off and on, on the ten cases of ``benchmarks/moe_route_cases.py``; then
``fly_lightning.topk`` against ``torch.topk``.

    python -m benchmarks.bench_moe_route               # about 2-3 minutes on an H200 (writes moe_route.*, topk.*)
    python -m benchmarks.bench_moe_route --no-compile  # skip the torch.compile baseline (saves most of the time)

The suite first checks every case on the GPU against the reference (ids, weights, counts, offsets, permutation; also
after CUDA-graph capture and with deterministic algorithms) and skips the timing of a case that fails. Timings:
``*_ms`` are per call with CUDA events around each eager call (host overhead included when it dominates),
``*_graph_ms`` from CUDA-graph replays (device time only); cold start apart, ``*_cold_s`` (first calls, before the
check). The plain ``bincount`` variant of the ATen sequence synchronises with the host, so it is timed eagerly only.
Bytes moved: logits read + outputs written; the copy-bandwidth share is reported for cases with at least 16 MiB of
logits.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import replace

import torch

from benchmarks.harness import (
    Results,
    capture_graph,
    copy_bandwidth_gbps,
    first_call_s,
    geomean,
    interleaved_graph_ms,
    interleaved_ms,
    rotation_count,
)
from benchmarks.moe_route_cases import (
    BIG_LOGITS_BYTES,
    CASES,
    MIB,
    Case,
    aten_route,
    aten_route_permutation,
    route_args,
    route_bytes,
    route_inputs,
)

TOPK_CASES = [
    (16384, 8, 2, torch.bfloat16),
    (4096, 60, 4, torch.bfloat16),
    (16384, 128, 8, torch.bfloat16),
    (65536, 128, 8, torch.bfloat16),
    (16384, 256, 8, torch.float32),
    (8192, 1000, 5, torch.float32),
]


# --- helpers ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def deterministic(on: bool):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def check(case: Case, x: torch.Tensor, bias) -> tuple[str | None, dict]:
    """None when our output matches the reference (see the module docstring), else what differs."""
    from fly_lightning import DISPATCH_LOG
    from fly_lightning.ops.moe_route import moe_route_op, moe_route_reference, routing_counts

    args = (x, *route_args(case, bias), True)
    out = moe_route_op(*args)
    backend = DISPATCH_LOG.records("moe_route")[-1]
    if backend["backend"] != "triton":
        return f"ran on {backend['backend']}: {backend['reason']}", {}
    ref = moe_route_reference(*args)
    w, ids, counts, offsets, slots, pos = out
    info = {}
    differ = (ids != ref[1]).any(1)
    info["rows_differ"] = int(differ.sum())
    if info["rows_differ"]:
        if bias is None and case.n_groups is None:
            return f"{info['rows_differ']} rows choose other experts", info
        # biased / grouped fp32 scores: the kernel's exp differs from torch's by ulps; near ties may swap
        s = torch.softmax(x.double(), -1) if case.score == "softmax" else torch.sigmoid(x.double())
        v = (s if bias is None else s + bias.double())[differ]
        got, want = v.gather(1, ids[differ].long()).sum(1), v.gather(1, ref[1][differ].long()).sum(1)
        if info["rows_differ"] > max(2, case.tokens // 1000) or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            return f"{info['rows_differ']} rows choose other experts (not near ties)", info
    same = ~differ
    if not torch.allclose(w[same], ref[0][same], rtol=1e-5, atol=1e-6, equal_nan=True):
        return f"weights differ by up to {(w[same] - ref[0][same]).abs().max().item():.3g}", info
    for name, got, want in zip(
        ("counts", "offsets", "sorted_slots", "slot_pos"),
        (counts, offsets, slots, pos),
        routing_counts(ids, case.experts, True),
        strict=True,
    ):
        if not torch.equal(got, want):
            return f"{name} inconsistent with the ids", info
    plain = moe_route_op(*args[:-1], False)  # without the permutation: counts come from another code path
    for name, got, want in zip(("weights", "ids", "counts", "offsets"), plain, out, strict=False):
        if not torch.equal(got, want):
            return f"{name} differ without the permutation", info
    # the counting tail the launcher does not use must give the same outputs, with and without the permutation
    from fly_lightning.kernels.triton._moe_route_config import launch_config
    from fly_lightning.kernels.triton.moe_route import moe_route_triton

    cfg = launch_config(case.experts, case.k, x.element_size(), case.n_groups is not None, case.bias)
    other_cfg = replace(cfg, tail="packed" if cfg.tail == "ticket" else "ticket")
    for with_perm, want_all in ((True, out), (False, plain)):
        got_all = moe_route_triton(*args[:-1], with_perm, config=other_cfg)
        if not all(torch.equal(a, b) for a, b in zip(got_all, want_all, strict=True)):
            return f"the {other_cfg.tail} tail differs (permutation {with_perm})", info
    # back-to-back launches (no host sync between them): every launch must find its workspace zeroed by the previous
    # one and publish complete totals, with and without the permutation (the launcher's counting tail)
    for with_perm in (False, True):
        runs = [moe_route_op(*args[:-1], with_perm)[2] for _ in range(100)]
        if not all(torch.equal(c, counts) for c in runs):
            return "counts change across back-to-back launches", info
    with deterministic(True):
        det = moe_route_op(*args)
    if not all(torch.equal(a, b) for a, b in zip(out, det, strict=True)):
        return "deterministic algorithms change the result", info
    # two graphs, the second with two launches (one without the permutation: the histogram path), replayed
    # interleaved: every captured launch must leave its workspace zero for the next replay, or counts would drift
    static, other = x.clone(), x.flip(0).contiguous()
    moe_route_op(static, *args[1:])  # warm both signatures before capture
    moe_route_op(other, *args[1:-1], False)
    graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
    with torch.cuda.graph(graphs[0]):
        captured = moe_route_op(static, *args[1:])
    with torch.cuda.graph(graphs[1]):
        captured_b = [moe_route_op(static, *args[1:]), moe_route_op(other, *args[1:-1], False)]
    for g in (0, 1, 0, 1, 1, 0):
        graphs[g].replay()
    torch.cuda.synchronize()
    expected_other = moe_route_op(other, *args[1:-1], False)
    for got, want in ((captured, out), (captured_b[0], out), (captured_b[1], expected_other)):
        if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
            return "CUDA-graph replay differs from eager", info
    return None, info


ROUNDS = 4  # side-by-side timing: a drift of the GPU's clocks falls on ours and the baselines alike
CALLS_PER_GRAPH = 20


def _err(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def _sync(inputs) -> None:
    if inputs[0][0].is_cuda:
        torch.cuda.synchronize()


def _time(fns: dict, inputs, graph: tuple[str, ...] = (), eager: bool = True) -> tuple[dict, dict, list[str]]:
    """Eager and CUDA-graph times (ms per call) of several implementations of one case, side by side: they take
    turns in rotated rounds (``harness.interleaved_ms`` / ``interleaved_graph_ms``); ``graph`` names those also
    timed in graphs, captured in that order after the eager timing. What cannot run, be captured or be timed is
    reported in the errors, not fatal (each step synchronises, so a device error is charged to its step)."""
    errors, ok, graphs = [], {}, {}
    for name, fn in fns.items():
        try:
            fn(*inputs[0])
            _sync(inputs)
            ok[name] = fn
        except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
            errors.append(f"{name}: {_err(exc)}")
    eager_ms, graph_ms = {}, {}
    if eager and ok:
        try:
            eager_ms = interleaved_ms(ok, inputs, 100, rounds=ROUNDS)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"eager timing: {_err(exc)}")
    for name in graph:
        if name in ok:
            try:
                graphs[name] = capture_graph(ok[name], inputs, CALLS_PER_GRAPH)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{name} graph: {_err(exc)}")
    if graphs:
        try:
            graph_ms = interleaved_graph_ms(graphs, CALLS_PER_GRAPH, replays=20, rounds=ROUNDS)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"graph timing: {_err(exc)}")
    return eager_ms, graph_ms, errors


def _bind(fn, *args, **kwargs):
    """``x -> fn(x, *args, **kwargs)``, with the arguments bound now (not at call time)."""
    return lambda x: fn(x, *args, **kwargs)


def _ratio(a, b):
    return a / b if a and b else None


def _cold_starts(case: Case, ours, comp, ours_perm, x: torch.Tensor) -> dict:
    """First-call times of this case's signatures (before anything else runs them; see ``first_call_s``)."""
    cold = {"ours_cold_s": round(first_call_s(ours, x)[0], 3)}
    if case.permutation:
        cold["ours_perm_cold_s"] = round(first_call_s(ours_perm, x)[0], 3)
    if comp is not None:
        try:
            cold["compiled_cold_s"] = round(first_call_s(comp, x)[0], 3)
        except Exception as exc:  # noqa: BLE001 - reported with the case, as _time does
            cold["compiled_cold_error"] = _err(exc)
    return cold


# --- the suite -------------------------------------------------------------------------------------------------------


def run_suite(compile_baseline: bool) -> None:
    import fly_lightning
    from fly_lightning import moe_route, topk

    start = time.perf_counter()
    dev = torch.device("cuda")
    torch._dynamo.config.cache_size_limit = 256
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256
    copy_gbps = copy_bandwidth_gbps(dev)
    res = Results("moe_route")
    res.notes.append(
        f"copy bandwidth {copy_gbps:.0f} GB/s (read + write); SMs "
        f"{torch.cuda.get_device_properties(dev).multi_processor_count}"
    )
    compiled = torch.compile(aten_route, dynamic=False) if compile_baseline else None
    speed = {key: [] for key in ("eager_off", "graph_off", "eager_on", "graph_on", "vs_compiled_graph_off")}
    big_pct = []
    for case in CASES:
        inputs, bias = route_inputs(case, dev)
        args = route_args(case, bias)
        ours = _bind(moe_route, *args)  # the public API, dispatcher included
        comp = _bind(compiled, *args) if compiled else None
        cold = _cold_starts(case, ours, comp, _bind(moe_route, *args, return_permutation=True), inputs[0][0])
        err, info = check(case, inputs[0][0], bias)
        base = dict(
            case=case.name,
            T=case.tokens,
            E=case.experts,
            k=case.k,
            dtype=str(case.dtype)[6:],
            score=case.score
            + ("+bias" if case.bias else "")
            + (f"+groups{case.n_groups}/{case.topk_groups}" if case.n_groups else ""),
            logits_MiB=round(case.logits_bytes / MIB, 2),
            **info,
        )
        if err is not None:
            res.add(**base, **cold, error=err)
            continue
        aten = _bind(aten_route, *args)
        aten_bc = _bind(aten_route, *args, counts="bincount")
        for det in (False, True):
            tag = "on" if det else "off"
            with deterministic(det):
                row = dict(base, deterministic=det, **({} if det else cold))
                fns = dict(ours=ours, aten=aten, aten_bincount=aten_bc, **({"compiled": comp} if comp else {}))
                in_graphs = tuple(n for n in fns if n != "aten_bincount")  # the bincount variant: eager only
                eager, graphed, errors = _time(fns, inputs, graph=in_graphs)
                for name in fns:
                    row[f"{name}_ms"] = eager.get(name)
                    if name in in_graphs:
                        row[f"{name}_graph_ms"] = graphed.get(name)
                row["speedup_vs_aten"] = _ratio(row["aten_ms"], row["ours_ms"])
                row["speedup_vs_aten_graph"] = _ratio(row["aten_graph_ms"], row["ours_graph_ms"])
                row["speedup_vs_compiled_graph"] = _ratio(row.get("compiled_graph_ms"), row["ours_graph_ms"])
                if row["ours_graph_ms"]:
                    gbps = route_bytes(case) / row["ours_graph_ms"] / 1e6
                    row["GBps"] = round(gbps, 1)
                    row["pct_copy_bw"] = round(100 * gbps / copy_gbps, 1)
                    if case.logits_bytes >= BIG_LOGITS_BYTES and not det:
                        big_pct.append((case.name, row["pct_copy_bw"]))
                if case.permutation and not det:
                    perm_ours = _bind(moe_route, *args, return_permutation=True)
                    perm_aten = _bind(aten_route_permutation, *args)
                    fns = dict(ours_perm=perm_ours, aten_perm=perm_aten)
                    _, graphed, perm_errors = _time(fns, inputs, graph=tuple(fns), eager=False)
                    for name in fns:
                        row[f"{name}_graph_ms"] = graphed.get(name)
                    row["speedup_perm_vs_aten_graph"] = _ratio(row["aten_perm_graph_ms"], row["ours_perm_graph_ms"])
                    errors += perm_errors
                if errors:
                    row["errors"] = "; ".join(errors)
                speed[f"eager_{tag}"].append(row["speedup_vs_aten"])
                speed[f"graph_{tag}"].append(row["speedup_vs_aten_graph"])
                if not det:
                    speed["vs_compiled_graph_off"].append(row["speedup_vs_compiled_graph"])
                res.add(**row)
    for key, values in speed.items():
        res.summary[f"geomean_speedup_{key}"] = round(geomean(values), 2)
    res.summary["pct_copy_bw_16MiB_cases"] = ", ".join(f"{n} {p}%" for n, p in big_pct)
    res.summary["goal_geomean_40x_vs_aten_graph_off"] = res.summary["geomean_speedup_graph_off"] >= 40
    res.summary["goal_50pct_copy_bw"] = bool(big_pct) and all(p >= 50 for _, p in big_pct)
    res.summary["dispatch"] = str(fly_lightning.DISPATCH_LOG.summary().get("moe_route", {}).get("by_backend"))
    res.add_totals(("ours_cold_s", "ours_perm_cold_s", "compiled_cold_s"), 2)
    res.summary["suite_seconds"] = round(time.perf_counter() - start, 1)
    res.notes.append("speedup_vs_aten*: ATen sequence time / ours (same timing method); geomeans over the 10 cases")
    res.notes.append(
        f"timing: ours and the baselines of a case take turns in rounds (at least {ROUNDS}, a multiple of their "
        f"number; order rotated each round; eager: about 100 calls each in all; graphs: {CALLS_PER_GRAPH} calls per "
        "graph, about 20 replays each in all), and each reports the median of its round medians "
        "(harness.interleaved_ms / interleaved_graph_ms)"
    )
    res.notes.append(
        "cold start, apart from the timings (deterministic-off rows): *_cold_s is the first call's host wall time "
        "through its completion on the GPU, Triton and Inductor caches empty at the start of the process. "
        "ours_cold_s: the public call (dispatch decision, kernel compilation, launch); ours_perm_cold_s: then the "
        "variant with the permutation (another compilation); compiled_cold_s: torch.compile of the ATen sequence "
        "(dynamic=False: one compilation per case; with deterministic algorithms on it compiles again, not shown)."
    )
    print(res.save())

    tres = Results("topk")
    speed_t = {"eager": [], "graph": []}
    for t, e, k, dt in TOPK_CASES:
        x = [(torch.randn(t, e, device=dev).to(dt),) for _ in range(rotation_count(t * e * dt.itemsize))]
        v, i = topk(x[0][0], k)
        tv, ti = torch.topk(x[0][0], k)
        row = dict(T=t, E=e, k=k, dtype=str(dt)[6:])
        if not (torch.equal(v, tv) and torch.equal(x[0][0].gather(1, i), tv)):
            tres.add(**row, error="values differ from torch.topk")
            continue
        fns = dict(ours=_bind(topk, k), torch=_bind(torch.topk, k))
        eager, graphed, errors = _time(fns, x, graph=tuple(fns))
        for name in ("ours", "torch"):
            row[f"{name}_ms"], row[f"{name}_graph_ms"] = eager.get(name), graphed.get(name)
        row["speedup"] = _ratio(row["torch_ms"], row["ours_ms"])
        row["speedup_graph"] = _ratio(row["torch_graph_ms"], row["ours_graph_ms"])
        if errors:
            row["errors"] = "; ".join(errors)
        speed_t["eager"].append(row["speedup"])
        speed_t["graph"].append(row["speedup_graph"])
        tres.add(**row)
    tres.summary = {f"geomean_speedup_{k}": round(geomean(v), 2) for k, v in speed_t.items()}
    print(tres.save())
    print(f"total {time.perf_counter() - start:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    a = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    run_suite(compile_baseline=not a.no_compile)


if __name__ == "__main__":
    main()
