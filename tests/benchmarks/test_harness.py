"""The benchmark harness's own logic, on the CPU."""

import time

import torch

from benchmarks.bench_moe_route import _cold_starts, _time
from benchmarks.harness import Results, _turns, first_call_s, interleaved_ms
from benchmarks.moe_route_cases import Case


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


def test_interleaved_timing_takes_turns_each_first_equally_often_after_varied_predecessors():
    calls = []
    fns = {n: (lambda a, n=n: calls.append(n)) for n in ("a", "b", "c")}
    out = interleaved_ms(fns, [(torch.zeros(1),)], reps=18, rounds=4)
    assert set(out) == {"a", "b", "c"} and all(v >= 0 for v in out.values())
    # 4 rounds rounded up to 6, so each goes first twice; a block per name and round: 2 warm-up + 3 timed calls
    blocks = [calls[i] for i in range(0, len(calls), 5)]
    assert len(calls) == 5 * 3 * 6 and all(len(set(calls[i : i + 5])) == 1 for i in range(0, len(calls), 5))
    rounds = [blocks[i : i + 3] for i in range(0, 18, 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert [r[0] for r in rounds] == ["a", "b", "c", "a", "b", "c"]
    assert _turns(["a", "b", "c"], 4) == _turns(["a", "b", "c"], 4)  # seeded: the same order every run
    calls.clear()
    interleaved_ms(fns, [(torch.zeros(1),)], reps={"a": 48, "b": 18, "c": 18}, rounds=4)  # per-name counts
    assert calls[:10] == ["a"] * 10  # 2 warm-up + 48 // 6 timed


def test_turns_do_not_always_put_the_same_function_before_another():
    # a rotation would: there "ours" always ran right after the baseline before it, and inherited its clocks
    names = [f"f{i}" for i in range(16)]
    turns = _turns(names, 4)
    assert len(turns) == 16
    for n in names:
        before = {t[t.index(n) - 1] for t in turns if t.index(n) > 0}
        assert len(before) >= 5, (n, before)


def test_interleaved_timing_moves_along_the_inputs_each_round():
    seen = []
    inputs = [(torch.tensor(float(i)),) for i in range(10)]
    interleaved_ms({"a": lambda x: seen.append(int(x))}, inputs, reps=12, rounds=4)
    # 4 rounds of 2 warm-up + 3 timed calls: each call takes the next set, across rounds, warm-up included
    assert seen == [i % 10 for i in range(20)]


def test_route_timing_reports_a_failing_baseline_and_times_the_rest():
    def broken(x):
        raise ValueError("no such op\nmore")

    eager, graphed, errors = _time({"ours": lambda x: x + 1, "broken": broken}, [(torch.zeros(4),)])
    assert set(eager) == {"ours"} and eager["ours"] >= 0 and graphed == {}
    assert errors == ["broken: ValueError: no such op"]


def test_a_baseline_failing_without_a_message_is_still_reported():
    def silent(x):
        raise RuntimeError()

    cold = _cold_starts(Case("c", 2, 8, 2), lambda x: None, silent, None, torch.zeros(2, 8))
    assert cold["compiled_cold_error"] == "RuntimeError: "


def test_results_totals_cover_the_rows_that_have_each_key():
    res = Results("t")
    res.rows = [{"a_s": 1.25, "b_s": 2.0}, {"a_s": 0.5}, {}]
    res.add_totals(("a_s", "b_s", "c_s"), 1)
    assert res.summary == {"a_s_total": 1.8, "a_s_max": 1.25, "b_s_total": 2.0, "b_s_max": 2.0}


def test_saved_results_carry_the_environment_in_both_files(tmp_path):
    res = Results("demo", rows=[{"case": "a", "ms": 1.5, "shape": (2, 3)}], summary={"n": 1}, notes=["a note"])
    path = res.save(tmp_path)
    assert path == tmp_path / "demo.json"
    loaded, env = Results.load(path)
    assert loaded.rows == [{"case": "a", "ms": 1.5, "shape": [2, 3]}] and loaded.summary == {"n": 1}
    assert {"command", "device", "torch", "triton", "git_rev", "date_utc"} <= set(env)
    md = (tmp_path / "demo.md").read_text()
    assert md == loaded.markdown(env) == res.markdown(env)  # a tuple and its JSON list read the same
    assert f"- torch: {env['torch']}" in md and "## Environment" in md and "- a note" in md


def test_a_field_an_old_result_did_not_record_says_so():
    md = Results("old", rows=[{"x": 1}]).markdown({"command": "python3 x.py", "device": "NVIDIA H200"})
    assert "- command: `python3 x.py`" in md and "- device: NVIDIA H200" in md
    assert "- git_rev: not recorded" in md and "- liger_kernel: not recorded" in md


def test_backend_of_reads_the_decision_for_the_signature():
    import fly_lightning
    from benchmarks.harness import backend_of

    x, w = torch.randn(3, 16), torch.randn(16)
    args = (x, w, 1e-6, 0.0, False)
    assert backend_of("rms_norm", *args) is None  # not called yet
    with fly_lightning.dispatch_config(backends=("aten",)):
        fly_lightning.rms_norm(x, w, 1e-6)
        assert backend_of("rms_norm", *args) == "aten"
    assert backend_of("rms_norm", *args) is None  # another policy: not decided under it
