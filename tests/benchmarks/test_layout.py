"""The benchmark directory's layout: one script per suite, shared code in the harness and the case modules only, one
current result per suite (JSON + markdown, each carrying the command, device, versions and revision), and a GPU session
script whose phases name existing modules."""

import ast
import json
import re
from pathlib import Path

import pytest

from benchmarks.harness import RESULTS_DIR, Results

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SHARED = {
    "benchmarks.harness",
    "benchmarks.grouped_mm_cases",
    "benchmarks.moe_route_cases",
    "benchmarks.train_step_cases",
}
# result name -> the script that writes it
SUITES = {
    "rms_norm": "bench_rms_norm",
    "grouped_mm": "bench_grouped_mm",
    "moe_route": "bench_moe_route",
    "topk": "bench_moe_route",
    "moe_layer": "bench_moe_layer",
    "recipe_step": "bench_recipe_step",
    "dispatch_overhead": "bench_dispatch_overhead",
    "gemm_roof": "bench_gemm_roof",
    "moe_route_floor": "bench_moe_route_floor",
    "goal_bounds": "goal_bounds",
    "train_step": "bench_train_step",
    "cold_start": "bench_cold_start",
    "mx_quality": "bench_mx_quality",
    "mx_gemm": "bench_mx_gemm",
    "mx_grouped_mm": "bench_mx_grouped_mm",
    "mx_memory": "bench_mx_memory",
    "mx_cast": "bench_mx_cast",
    "mx_linear": "bench_mx_linear",
    "host_profile": "profile_host",
}


def _benchmark_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from benchmarks... import name`` and ``import benchmarks...`` in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks"):
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.startswith("benchmarks")]
    return out


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_scripts_share_code_only_through_the_harness_and_the_case_modules(path):
    for module, name in _benchmark_imports(path):
        assert module in SHARED, f"{path.name} imports {module}: scripts import only {sorted(SHARED)}"
        assert not name.startswith("_"), f"{path.name} imports the private {module}.{name}"
    if f"benchmarks.{path.stem}" in SHARED:  # the shared modules import only the harness
        assert {m for m, _ in _benchmark_imports(path)} <= {"benchmarks.harness"}


def _committed() -> set[str]:
    return {p.stem for p in RESULTS_DIR.iterdir()}


@pytest.mark.parametrize("suite", SUITES)
def test_each_suite_is_written_by_its_script(suite):
    script = (BENCH / f"{SUITES[suite]}.py").read_text()
    assert f'Results("{suite}")' in script, f"{SUITES[suite]}.py does not write {suite}"
    assert suite in _committed(), f"no committed {suite} result"


@pytest.mark.parametrize("suite", sorted(_committed()))
def test_each_result_is_one_json_and_its_markdown_with_the_environment(suite):
    assert suite in SUITES or (BENCH / f"bench_{suite}.py").exists(), f"{suite}: no suite writes it"
    payload = json.loads((RESULTS_DIR / f"{suite}.json").read_text())
    env = payload["environment"]
    assert payload["suite"] == suite
    for field in ("command", "device", "date_utc", "torch", "triton", "git_rev"):
        assert env.get(field), f"{suite}.json records no {field}"
    res, _ = Results.load(RESULTS_DIR / f"{suite}.json")
    assert (RESULTS_DIR / f"{suite}.md").read_text() == res.markdown(env), f"{suite}.md is not {suite}.json rendered"


def test_results_hold_only_json_and_markdown_pairs():
    names = {p.name for p in RESULTS_DIR.iterdir()}
    assert all(p.is_file() for p in RESULTS_DIR.iterdir()), "no folders (logs, runs) under results/"
    assert names == {f"{s}.{ext}" for s in _committed() for ext in ("json", "md")}


def test_gpu_session_phases_run_existing_modules_and_the_gpu_tests():
    text = (BENCH / "gpu_session.sh").read_text()
    modules = set(re.findall(r"python3 -m benchmarks\.(\w+)", text))
    assert all((BENCH / f"{m}.py").exists() for m in modules), modules
    assert set(SUITES.values()) - {"goal_bounds"} <= modules  # goal_bounds runs on the CPU
    tests = re.search(r"^\s*tests\) (.*?);;", text, re.M | re.S).group(1)
    assert "TRITON_INTERPRET=0" in tests and "-m pytest" in tests and "tests/gpu" in tests and "-m gpu" in tests
    assert "--junitxml" in tests
