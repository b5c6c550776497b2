"""The benchmark harness's own logic, on the CPU."""

import time

import torch

from benchmarks.bench_moe_route import Case, _cold_starts
from benchmarks.harness import first_call_s


def test_first_call_s_times_the_call_and_returns_its_result():
    def slow(x):
        time.sleep(0.02)
        return x + 1

    seconds, out = first_call_s(slow, torch.zeros(3))
    assert torch.equal(out, torch.ones(3))
    assert 0.02 <= seconds < 5


def test_route_cold_starts_cover_each_signature_and_report_a_failing_baseline():
    calls = []

    def ours(x):
        calls.append("ours")

    def ours_perm(x):
        calls.append("perm")

    def compiled(x):
        raise RuntimeError("no compiler\nsecond line")

    x = torch.zeros(2, 8)
    cold = _cold_starts(Case("c", 2, 8, 2, permutation=True), ours, compiled, ours_perm, x)
    assert calls == ["ours", "perm"]
    assert cold["ours_cold_s"] >= 0 and cold["ours_perm_cold_s"] >= 0
    assert cold["compiled_cold_error"] == "RuntimeError: no compiler"
    plain = _cold_starts(Case("c", 2, 8, 2), ours, None, ours_perm, x)
    assert set(plain) == {"ours_cold_s"} and calls[-1] == "ours"
