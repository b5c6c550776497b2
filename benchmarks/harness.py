"""Shared benchmark harness: device-event timing with warm-up and input rotation, side-by-side timing in shuffled
rounds, CUDA-graph timing for small ops, cold-start timing, and results as JSON + markdown carrying the device,
versions, command and git revision.

Steady state only: every timed function is called before timing starts, so compilation and tuning stay out of the
numbers (suites that report cold start time it separately, with ``first_call_s``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
L2_BYTES = 64 * 2**20  # H100/H200 have 50-60 MB of L2; rotate through at least 3x this


def results_dir() -> Path:
    """Where suites write: $FLY_RESULTS_DIR (GPU sessions collect it), else $OUT, else benchmarks/results."""
    return Path(os.environ.get("FLY_RESULTS_DIR") or os.environ.get("OUT") or RESULTS_DIR)


def rotation_count(bytes_per_set: int, min_sets: int = 2, max_sets: int = 64) -> int:
    """How many input sets to cycle through so one pass touches more than 3x the L2."""
    return int(max(min_sets, min(max_sets, math.ceil(3 * L2_BYTES / max(1, bytes_per_set)))))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_call_s(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Host wall time of one call through its completion on the device (``(seconds, result)``): a cold start when
    ``fn`` has not run on this signature in the process (JIT compilation, autotuning and module loading included).
    The GPU session gives each phase empty Triton and Inductor caches, so nothing comes from an earlier run's disk."""
    device = _device_of(args)
    _sync(device)
    start = time.perf_counter()
    out = fn(*args)
    _sync(device)
    return time.perf_counter() - start, out


def time_ms(
    fn: Callable[..., Any],
    inputs: Sequence[tuple],
    *,
    warmup: int = 10,
    reps: int = 100,
) -> dict[str, float]:
    """Per-call times of ``fn(*inputs[i % len(inputs)])``: median, p20, p80 (ms).

    On CUDA each call is bracketed by events (device time, launch gaps included); on CPU by ``perf_counter``.
    """
    device = _device_of(inputs[0])
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    _sync(device)
    times: list[float] = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for i, (start, end) in enumerate(events):
            args = inputs[(warmup + i) % len(inputs)]  # past the sets the warm-up touched
            start.record()
            fn(*args)
            end.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for i in range(reps):
            t0 = time.perf_counter()
            fn(*inputs[(warmup + i) % len(inputs)])
            times.append((time.perf_counter() - t0) * 1e3)
    return _stats(times)


def host_us(fn: Callable[[], object], number: int = 1000, repeat: int = 5) -> float:
    """Per call: ``number`` calls then one device sync, best of ``repeat`` (the device finishes each call's small
    kernel before the host issues the next, so this is the host's time)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best / number * 1e6


def _turns(names: list[str], rounds: int) -> list[list[str]]:
    """The order of each round: ``names[r]`` first in round r, the others after it in a seeded shuffle, the rounds
    rounded up to a multiple of the number of names so that each goes first equally often. Shuffled, not rotated: in
    a rotation each function always follows the same one, and after a long bf16 GEMM at full power the next kernel
    ran at lower clocks (mx_grouped_mm suite, H100: MXFP8 on Mixtral's gate/up, always timed right after the bf16
    baseline, read 12% slower than the identical prepass plan timed elsewhere in the round)."""
    rounds = -(-rounds // len(names)) * len(names)
    turns = []
    for r in range(rounds):
        first = names[r % len(names)]
        rest = [n for n in names if n != first]
        random.Random(r).shuffle(rest)
        turns.append([first, *rest])
    return turns


def interleaved_ms(
    fns: dict[str, Callable[..., Any]], inputs: Sequence[tuple], reps: int | dict[str, int], *, rounds: int = 4
) -> dict[str, float]:
    """Side-by-side timing: each function's median of its round medians (``time_ms``), the functions taking turns
    within a round, so that a drift of the GPU's clocks during a case falls on all of them alike (timed one after
    another, the function timed first had an edge on the H200: README, grouped GEMM). ``reps``: calls per function in
    all (per name, or one number for every function), at least 3 per round; each function's calls (warm-up
    included) walk through ``inputs`` in order across rounds, so no timed call reuses a set touched just before."""
    names = list(fns)
    turns = _turns(names, rounds) if names else []
    total = reps if isinstance(reps, dict) else dict.fromkeys(names, reps)
    per_round = {n: max(3, total[n] // max(1, len(turns))) for n in names}
    samples: dict[str, list[float]] = {n: [] for n in names}
    pos = dict.fromkeys(names, 0)  # each function's next input set: every call, warm-up included, takes the next one
    for order in turns:
        for n in order:
            shift = pos[n] % len(inputs)
            rotated = list(inputs[shift:]) + list(inputs[:shift])
            samples[n].append(time_ms(fns[n], rotated, warmup=2, reps=per_round[n])["median_ms"])
            pos[n] += 2 + per_round[n]
    return {n: statistics.median(v) for n, v in samples.items()}


def capture_graph(fn: Callable[..., Any], inputs: Sequence[tuple], calls_per_graph: int = 20) -> torch.cuda.CUDAGraph:
    """``calls_per_graph`` calls cycling through ``inputs``, captured in one CUDA graph (after three warm-up calls on
    a side stream) and replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(*inputs[i % len(inputs)])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls_per_graph):
            fn(*inputs[i % len(inputs)])
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph, replays: int, calls_per_graph: int) -> list[float]:
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls_per_graph)
    return times


def time_graph_ms(
    fn: Callable[..., Any], inputs: Sequence[tuple], *, calls_per_graph: int = 20, replays: int = 30
) -> dict[str, float]:
    """Device time per call from CUDA-graph replays (no host launch overhead): for launch-bound small ops.

    ``calls_per_graph`` calls cycling through ``inputs`` are captured in one graph; each replay is timed with events
    and divided by the number of calls.
    """
    if _device_of(inputs[0]).type != "cuda":
        raise RuntimeError("time_graph_ms needs CUDA")
    return _stats(_replay_ms(capture_graph(fn, inputs, calls_per_graph), replays, calls_per_graph))


def interleaved_graph_ms(
    graphs: dict[str, torch.cuda.CUDAGraph], calls_per_graph: int, *, replays: int = 20, rounds: int = 4
) -> dict[str, float]:
    """``interleaved_ms`` for captured graphs (``capture_graph``): per call, each graph's median of its round medians,
    about ``replays`` replays in all (at least 3 per round), the graphs taking turns in shuffled order (``_turns``)."""
    names = list(graphs)
    turns = _turns(names, rounds) if names else []
    samples: dict[str, list[float]] = {n: [] for n in names}
    for order in turns:
        for n in order:
            times = _replay_ms(graphs[n], max(3, replays // len(turns)), calls_per_graph)
            samples[n].append(_stats(times)["median_ms"])
    return {n: statistics.median(v) for n, v in samples.items()}


def probe_graph_ms(
    fns: dict[str, Callable[..., Any]], inputs: Sequence[tuple], ref: torch.Tensor, label: str, calls: int = 20
) -> tuple[dict[str, float], dict[str, float]]:
    """For the probes: each of ``fns`` checked against ``ref`` (relative error; "bf16" is a precision change, not
    checked) on ``inputs[0]``, captured, then all graph-timed side by side (``interleaved_graph_ms``). A function that
    fails is printed under ``label`` and left out. Returns (milliseconds, errors) by name."""
    graphs, errs = {}, {}
    for name, fn in fns.items():
        try:
            y = fn(*inputs[0])
            errs[name] = ((y.float() - ref).norm() / ref.norm()).item() if name != "bf16" else 0.0
            graphs[name] = capture_graph(fn, inputs, calls)
        except Exception as exc:  # noqa: BLE001 (a plan that does not compile is reported)
            print(f"{label} {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
    return interleaved_graph_ms(graphs, calls), errs


def print_probe_rows(ms: dict[str, float], errs: dict[str, float], flops: float, base: str = "bf16") -> None:
    """For the probes: one line per function of ``probe_graph_ms``'s results: microseconds, TFLOP/s, ``base``'s time
    over its own, relative error."""
    for k, t in ms.items():
        print(f"   {k:16s} {t * 1e3:9.1f} us {flops / t / 1e9:7.1f} TFLOP/s  x_{base} {ms[base] / t:5.2f}"
              f"  err {errs.get(k, 0):.2e}", flush=True)  # fmt: skip


def probe_each(fn: Callable[[Any], None], items: Iterable[Any], label: Callable[[Any], str]) -> None:
    """For the probes: ``fn`` on each item; a failure is printed under ``label(item)`` and the next item runs. The
    caching allocator's cache is emptied between items (each probe case allocates its own large operands)."""
    for item in items:
        try:
            fn(item)
        except Exception as exc:  # noqa: BLE001 (report and go on)
            print(f"{label(item)}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        torch.cuda.empty_cache()


def _stats(times: list[float]) -> dict[str, float]:
    s = sorted(times)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]
    return {"median_ms": q(0.5), "p20_ms": q(0.2), "p80_ms": q(0.8), "n": len(s)}


def _device_of(args: tuple) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def geomean(values: Sequence[float]) -> float:
    vals = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def copy_bandwidth_gbps(device: torch.device | str = "cuda", nbytes: int = 2 * 2**30) -> float:
    """Measured device-to-device copy bandwidth (bytes read + written), the memory ceiling for memory-bound ops."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    t = time_ms(lambda src, dst: dst.copy_(src), [(x, y)], warmup=5, reps=30)["median_ms"]
    return 2 * nbytes / t / 1e6


def backend_of(op_name: str, *args: Any) -> str | None:
    """The backend the dispatcher chose for these arguments' signature under the current policy (None before the
    signature's first call), from the public dispatch log."""
    import fly_lightning

    signature = fly_lightning.get_op(op_name).signature(*args)
    uid = fly_lightning.get_dispatch_config().uid
    for d in reversed(fly_lightning.DISPATCH_LOG.decisions):
        if d.op == op_name and d.config_uid == uid and d.signature == signature:
            return d.backend
    return None


VERSIONED = ("triton", "lightning", "torchao", "liger_kernel", "flydsl", "transformers")


def _version(module: str) -> str | None:
    """The installed version of ``module``'s distribution, "not installed", or None when it cannot be told."""
    try:
        return importlib.metadata.version(module.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return getattr(importlib.import_module(module), "__version__", None)
    except ImportError:
        return "not installed"
    except Exception:
        return None


def command_line() -> str:
    """How this process was started: ``python3 -m benchmarks.<suite> ...`` for a module run (``sys.argv[0]`` is then
    the file's path, which differs between machines)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = ["-m", spec.name] if spec is not None and spec.name else sys.argv[:1]
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *head, *sys.argv[1:]])


def environment() -> dict[str, Any]:
    """Device, versions, command and git revision, recorded with every result file."""
    env: dict[str, Any] = {
        "command": command_line(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
    }
    for mod in VERSIONED:
        env[mod] = _version(mod)
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).parent,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).parent,
        )
        if rev.stdout.strip():
            env["git_rev"] = rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:
        pass
    if env.get("git_rev") is None:
        env["git_rev"] = os.environ.get("FLY_GIT_REV")
    return env


ENV_FIELDS = ("command", "device", "date_utc", "git_rev", "python", "torch", *VERSIONED)


def environment_markdown(env: dict[str, Any]) -> list[str]:
    """The environment as markdown lines; a field the run did not record (None: older result files) says so."""
    lines = ["## Environment", ""]
    for key in ENV_FIELDS:
        value = env.get(key)
        lines.append(f"- {key}: " + (f"`{value}`" if key == "command" and value else str(value or "not recorded")))
    return lines


@dataclass
class Results:
    """Rows of one suite plus a summary; ``save`` writes ``<name>.json`` and ``<name>.md``."""

    suite: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)  # in the JSON only (profiles, per-run data): not the md

    def add(self, **row: Any) -> dict[str, Any]:
        self.rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        return row

    def add_totals(self, keys: Sequence[str], ndigits: int) -> None:
        """Summary ``<key>_total`` and ``<key>_max`` over the rows that have each key (cold-start columns)."""
        for key in keys:
            values = [r[key] for r in self.rows if key in r]
            if values:
                self.summary[f"{key}_total"], self.summary[f"{key}_max"] = round(sum(values), ndigits), max(values)

    def save(self, out_dir: str | Path | None = None, env: dict[str, Any] | None = None) -> Path:
        """Write ``<suite>.json`` and ``<suite>.md`` (with the environment: this process's, or ``env`` for results
        summarised elsewhere from a run's records) to ``out_dir`` or ``results_dir()``."""
        out = Path(out_dir) if out_dir else results_dir()
        out.mkdir(parents=True, exist_ok=True)
        payload = {
            "suite": self.suite,
            "environment": env or environment(),
            "summary": self.summary,
            "notes": self.notes,
            "rows": self.rows,
            **({"details": self.details} if self.details else {}),
        }
        path = out / f"{self.suite}.json"
        path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        (out / f"{self.suite}.md").write_text(self.markdown(payload["environment"]))
        return path

    @classmethod
    def load(cls, path: str | Path) -> tuple[Results, dict[str, Any]]:
        """A saved result file: the results and the environment it recorded."""
        payload = json.loads(Path(path).read_text())
        res = cls(payload["suite"], payload["rows"], payload["summary"], payload["notes"], payload.get("details", {}))
        return res, payload.get("environment", {})

    def markdown(self, env: dict[str, Any] | None = None) -> str:
        lines = [f"# {self.suite}", ""]
        if self.rows:
            cols = list(dict.fromkeys(k for r in self.rows for k in r))
            lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in self.rows]
        else:
            lines.append("(no rows)")
        if self.summary:
            lines += ["", "## Summary", ""] + [f"- {k}: {_fmt(v)}" for k, v in self.summary.items()]
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        if env is not None:
            lines += ["", *environment_markdown(env)]
        return "\n".join(lines) + "\n"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, tuple):  # a tuple and the list JSON gives back for it read the same
        v = list(v)
    return str(v)
