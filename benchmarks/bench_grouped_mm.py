"""Grouped GEMM suite (GPU): fly-lightning's ``grouped_mm`` against ``torch._grouped_mm`` (CUTLASS), a per-expert
loop of ``torch.mm`` and the Triton peer (Inductor's grouped-mm template: ``torch.compile`` of ``torch._grouped_mm``
under ``max_autotune`` with only Triton GEMM backends), on the 24 cases of ``benchmarks/grouped_mm_cases.py``. One
dense ``torch.mm`` of the same FLOPs is timed beside them as a ceiling reference.

Every case is first checked against an fp32 per-group reference (each implementation, relative Frobenius error),
then timed (device events, steady state: compilation and autotuning excluded) in interleaved rounds: ours, the
baselines and the dense reference take turns (``harness.interleaved_ms``). TFLOP/s = 2*M*K*N / time. ``fly`` is
the configuration table (the default); ``fly_tuned`` the measured choice among a few configurations per case. Cold
start is reported apart: ``fly_cold_s`` (our first call of the case), ``fly_tune_s``, ``peer_compile_s``.

The peer autotunes ~40 configurations per distinct shape at its first call (~15-25 s each). By default it runs on
the 8 distinct model-projection shapes, which cover the 16 projection and uneven cases; ``--peer all`` adds the 8
uniform shapes (about 3 more minutes), ``--peer none`` skips it. Inductor caches under $TORCHINDUCTOR_CACHE_DIR:
point it at a kept folder to reuse the autotuning across runs.

    python -m benchmarks.bench_grouped_mm               # about 4-5 min on an H200 (peer autotuning ~3)
    python -m benchmarks.bench_grouped_mm --peer all    # the committed run: the peer on every case, about 8 min
    (writes grouped_mm.{json,md})
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import fly_lightning
from benchmarks.grouped_mm_cases import Case, cases, make_inputs
from benchmarks.harness import Results, backend_of, first_call_s, geomean, interleaved_ms, rotation_count, time_ms
from fly_lightning.ops.grouped_mm import grouped_mm_reference

PEER_UNIFORM_SUBSET: tuple[str, ...] = ()  # uniform cases the default peer subset also compiles


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _ratio(num_ms: float, den_ms: float) -> float:
    """Four significant digits: a fixed number of decimals rounds the interpreter's tiny ratios to 0."""
    return float(f"{num_ms / den_ms:.4g}")


def loop_fn(case: Case) -> Callable:
    """One ``torch.mm`` per expert into slices of one output (group sizes known on the host: no sync timed)."""
    bounds, start = [], 0
    for c in case.counts:
        bounds.append((start, start + c))
        start += c

    def loop(x, w, offs):
        out = torch.empty(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
        for e, (s, t) in enumerate(bounds):
            if t > s:
                torch.mm(x[s:t], w[e], out=out[s:t])
        return out

    return loop


def _inductor_patch():
    return torch._inductor.config.patch(max_autotune=True, max_autotune_gemm_backends="TRITON")


class Peer:
    """Inductor's Triton grouped-mm template, compiled (and autotuned) once per distinct shape."""

    def __init__(self) -> None:
        self.compiled: dict[tuple, Callable] = {}
        self.compile_s: dict[tuple, float] = {}
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)

    def get(self, case: Case, x, w, offs) -> Callable:
        key = case.shape_key
        if key not in self.compiled:
            fn = torch.compile(lambda a, b, o: torch._grouped_mm(a, b, offs=o), dynamic=False)
            start = time.perf_counter()
            with _inductor_patch():
                fn(x, w, offs)
            if x.is_cuda:
                torch.cuda.synchronize()
            self.compile_s[key] = time.perf_counter() - start

            def run(a, b, o, fn=fn):
                with _inductor_patch():
                    return fn(a, b, o)

            self.compiled[key] = run
        return self.compiled[key]


def _elapsed_ms(fn: Callable, reps: int = 1) -> float:
    """Mean time of ``reps`` back-to-back calls (device events on CUDA, else wall clock), after one warm-up call."""
    fn()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) * 1e3 / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _reps(fn: Callable, args: tuple, budget_s: float = 0.25) -> int:
    return int(min(100, max(10, budget_s * 1e3 / max(_elapsed_ms(lambda: fn(*args)), 1e-3))))


ROUNDS = 4  # side-by-side timing (harness.interleaved_ms): ours first had an edge when timed in sequence


def suite(peer_mode: str, only: str | None = None, device: str = "cuda", case_list: list[Case] | None = None,
          reps: int | None = None, tune: bool = True) -> Results:  # fmt: skip
    from fly_lightning.kernels.triton import _grouped_mm_kernel as gk
    from fly_lightning.kernels.triton._grouped_mm_config import choose_config, shape_class, tune_candidates

    res = Results("grouped_mm")
    peer = Peer() if peer_mode != "none" else None
    impls: dict[str, Callable] = {"fly": lambda x, w, o: fly_lightning.grouped_mm(x, w, o), "aten": None, "loop": None}
    for case in case_list or cases():
        if only and only not in case.name:
            continue
        x, w, offs = make_inputs(case, device)
        nbytes = (x.numel() + w.numel() + case.m * case.n) * x.element_size()
        n_sets = rotation_count(nbytes, min_sets=1) if device == "cuda" else 1
        sets = [(x, w, offs)] + [make_inputs(case, device, seed=s) for s in range(1, n_sets)]
        impls["aten"] = lambda a, b, o: torch._grouped_mm(a, b, offs=o)
        impls["loop"] = loop_fn(case)
        use_peer = peer is not None and (peer_mode == "all" or case.family != "uniform" or
                                         case.name in PEER_UNIFORM_SUBSET)  # fmt: skip
        run = dict(impls)
        row = dict(case=case.name, family=case.family, load=case.load, E=case.e, M=case.m, K=case.k, N=case.n,
                   w_layout="K-major" if case.k_major else "N-major", max_rows=max(case.counts),
                   empty_groups=sum(1 for c in case.counts if c == 0),
                   fly_config=choose_config(x, w, case.m).label())  # fmt: skip
        if use_peer:
            try:
                run["peer"] = peer.get(case, x, w, offs)
                row["peer_compile_s"] = round(peer.compile_s.get(case.shape_key, 0.0), 1)
            except Exception as exc:  # reported, not fatal
                row["peer_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        ref = grouped_mm_reference(x.float(), w.float(), offs)
        for name, fn in run.items():
            try:
                seconds, out = first_call_s(fn, x, w, offs)
                if name == "fly":  # cold start: the first call of this shape in the process (see the notes)
                    row["fly_cold_s"] = round(seconds, 3)
                row[f"{name}_err"] = rel_err(out, ref)
            except Exception as exc:
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        row["fly_backend"] = backend_of("grouped_mm", x, w, offs, None)
        timed = {n: fn for n, fn in run.items() if f"{n}_error" not in row and row.get(f"{n}_err", 1.0) <= 2e-2}
        # a ceiling, not a contender: one cuBLAS GEMM of the same FLOPs with no groups (each input set's first
        # expert, same layout); it computes another function, so it has no error column
        timed["dense"] = lambda a, b, o: torch.mm(a, b[0])
        counts = {n: reps or _reps(fn, sets[0]) for n, fn in timed.items()}  # about 0.25 s of calls each
        for name, ms in interleaved_ms(timed, sets, counts, rounds=ROUNDS).items():
            row[f"{name}_ms"] = round(ms, 4)
            row[f"{name}_tflops"] = round(case.flops / ms / 1e9, 1)
        if tune and "fly_ms" in row:  # the measured choice among a few configurations
            try:
                start = time.perf_counter()
                best_cfg = gk.tune(
                    x, w, offs, candidates=tune_candidates(shape_class(case.m, case.n, case.k, case.e)[0]),
                    reps=reps or 10,
                )  # fmt: skip
                row["fly_tune_s"] = round(time.perf_counter() - start, 2)
                row["fly_tuned_config"] = best_cfg.label()
                fn = impls["fly"]
                row["fly_tuned_err"] = rel_err(fn(x, w, offs), ref)
                if gk.REJECTED:
                    row["fly_tuned_rejected"] = sorted(label for r in gk.REJECTED.values() for label in r)
                if row["fly_tuned_err"] > 2e-2:
                    raise RuntimeError(f"tuned configuration wrong: err {row['fly_tuned_err']:.2e}")
                ms = time_ms(fn, sets, warmup=3, reps=reps or _reps(fn, sets[0]))["median_ms"]
                row["fly_tuned_ms"], row["fly_tuned_tflops"] = round(ms, 4), round(case.flops / ms / 1e9, 1)
            except Exception as exc:
                row["fly_tuned_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            finally:
                gk.MEASURED.clear()  # the next case starts from the table again
                gk.REJECTED.clear()
        del ref
        for mine, prefix in (("fly", "x_vs"), ("fly_tuned", "tuned_x_vs"), ("dense", "dense_x_vs")):
            my_ms = row.get(f"{mine}_ms")
            for name in ("aten", "peer", "loop"):
                if my_ms and row.get(f"{name}_ms"):
                    row[f"{prefix}_{name}"] = _ratio(row[f"{name}_ms"], my_ms)
            best = min((row[k] for k in ("aten_ms", "peer_ms") if row.get(k)), default=None)
            if my_ms and best:
                row[f"{prefix}_best"] = _ratio(best, my_ms)
        res.add(**row)
        del x, w, offs, sets
        if device == "cuda":
            torch.cuda.empty_cache()
    _summarise(res, peer)
    return res


def _summarise(res: Results, peer: Peer | None) -> None:
    rows = res.rows
    keys = [f"{p}_{b}" for p in ("x_vs", "tuned_x_vs", "dense_x_vs") for b in ("peer", "aten", "best", "loop")]
    for key in keys:
        vals = [r[key] for r in rows if key in r]
        res.summary[f"geomean_{key}"] = round(geomean(vals), 3)
        res.summary[f"n_{key}"] = len(vals)
        res.summary[f"wins_{key}"] = sum(v >= 1.0 for v in vals)
        for fam in ("uniform", "projection", "uneven"):
            fam_vals = [r[key] for r in rows if key in r and r["family"] == fam]
            if fam_vals:
                res.summary[f"geomean_{key}_{fam}"] = round(geomean(fam_vals), 3)
    tflops = [r["fly_tflops"] for r in rows if "fly_tflops" in r]
    res.summary["fly_tflops_range"] = (min(tflops), max(tflops)) if tflops else None
    res.summary["failed_checks"] = [r["case"] for r in rows if r.get("fly_err", 1.0) > 2e-2]
    res.summary["tuned_errors"] = {r["case"]: r["fly_tuned_error"] for r in rows if "fly_tuned_error" in r}
    res.summary["fly_not_on_triton"] = [r["case"] for r in rows if r.get("fly_backend") != "triton"]
    if peer is not None:
        res.summary["peer_shapes_compiled"] = len(peer.compile_s)
        res.summary["peer_compile_total_s"] = round(sum(peer.compile_s.values()), 1)
    res.add_totals(("fly_cold_s", "fly_tune_s"), 1)
    res.notes += [
        "x_vs_<baseline> = baseline time / fly time (> 1: fly faster); x_vs_best: against the faster of "
        "torch._grouped_mm and the Triton peer where the peer ran, else torch._grouped_mm.",
        "peer = torch.compile(torch._grouped_mm) with max_autotune and max_autotune_gemm_backends='TRITON' (Inductor's "
        "grouped-mm template; it autotunes on uniform synthetic offsets, then runs on the real ones).",
        "loop = torch.mm per expert with host-known group sizes (no device sync timed: favourable to the loop).",
        "dense = one torch.mm (cuBLAS) of x [M, K] by the first expert's [K, N] weight: the same FLOPs with no groups, "
        "a ceiling reference rather than an implementation; dense_x_vs_<baseline> = baseline time / dense time, the "
        "score a grouped kernel as fast as that dense GEMM would get.",
        "timing: device events over rotating input sets; fly, aten, loop, peer and dense take turns in rounds (at "
        f"least {ROUNDS}, a multiple of their number; order rotated each round) and each reports the median of its "
        "round medians: side by side, so a drift of the GPU's clocks during the case falls on all of them. fly_tuned "
        "is timed on its own after the tuning, so its ratios are not side by side.",
        "fly = the configuration table (what users get by default); fly_tuned = the measured choice among "
        "tune_candidates() for the case (tuning time excluded; the table's configuration unless a candidate was "
        "more than 2% faster), reported as tuned_x_vs_<baseline>.",
        "cold start, apart from the timings: fly_cold_s = host wall time of the case's first fly call through its "
        "completion on the GPU (dispatch decision, Triton compilation of the configuration with N, K and the strides "
        "compiled in where the table says so, launch), Triton's cache empty at the start of the process; a case whose "
        "kernel an earlier case (or its tuning) already compiled reads warm, as a new batch of a known shape does in "
        "training. "
        "fly_tune_s: the measured choice's tuning (compiling and timing its candidates). peer_compile_s: the peer's "
        "first call (Inductor compilation and max-autotune), once per shape.",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--peer",
        choices=("subset", "all", "none"),
        default="subset",
        help="the Triton peer on the model-projection shapes (subset), every case (all) or none",
    )
    p.add_argument("--only", help="run the cases whose name contains this")
    p.add_argument("--no-tune", action="store_true", help="skip the per-case measured configuration (fly_tuned)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    start = time.perf_counter()
    res = suite(args.peer, args.only, tune=not args.no_tune)
    res.summary["wall_s"] = round(time.perf_counter() - start, 1)
    path = res.save()
    print(f"{res.summary}\nwrote {path}", flush=True)


if __name__ == "__main__":
    main()
