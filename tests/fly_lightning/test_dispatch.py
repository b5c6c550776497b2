"""Dispatcher: cached decisions, per-call counts, fallback reasons, failure fallback, measured selection."""

import pytest
import torch

import fly_lightning
from fly_lightning import DISPATCH_LOG, dispatch_config
from fly_lightning.backends import BACKENDS
from fly_lightning.dispatch import Decision, Op


def _scratch_op(name="scratch", triton_supports=lambda x: True, triton_fn=None):
    """A private op (not in the global registry) with aten and triton backends."""
    op = Op(name=name, reference=lambda x: x * 2, signature=lambda x: (x.shape, x.dtype))
    op.implement("aten")(op.reference)
    calls = []

    def triton_impl(x):
        calls.append(x.shape)
        return x * 2

    op.implement("triton", supports=triton_supports)(triton_fn or triton_impl)
    return op, calls


def test_decision_cached_and_every_call_counted():
    op, calls = _scratch_op()
    for _ in range(5):
        op(torch.ones(3))
    op(torch.ones(4))
    recs = DISPATCH_LOG.records("scratch")
    assert [(r["shape"], r["backend"], r["calls"]) for r in recs] == [("3", "triton", 5), ("4", "triton", 1)]
    assert len(calls) == 6
    assert recs[0]["first_call_s"] is not None


def test_unsupported_input_falls_back_with_reason():
    op, calls = _scratch_op(triton_supports=lambda x: True if x.dtype == torch.float32 else f"dtype {x.dtype}")
    out = op(torch.ones(3, dtype=torch.float64))
    assert torch.equal(out, torch.full((3,), 2.0, dtype=torch.float64))
    rec = DISPATCH_LOG.records("scratch")[0]
    assert rec["backend"] == "aten" and rec["fallback"] and "triton: dtype torch.float64" in rec["reason"]
    assert calls == []


def test_kernel_failure_on_first_call_falls_back_and_is_recorded():
    def broken(x):
        raise RuntimeError("out of shared memory")

    op, _ = _scratch_op(triton_fn=broken)
    out = op(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0))
    op(torch.ones(2))
    rec = DISPATCH_LOG.records("scratch")[0]
    assert rec["backend"] == "aten" and rec["calls"] == 2
    assert "triton: raised RuntimeError: out of shared memory" in rec["reason"]


def test_an_input_that_aten_refuses_too_changes_no_decision():
    """A first call whose input ATen refuses as well is the input's fault: the kernel keeps the signature, and the
    next call goes through the first-call path again (it may still fall back)."""
    seen = []

    def picky(x):
        seen.append(float(x.sum()))
        if x.sum() < 0:
            raise RuntimeError("kernel refused")
        return x * 2

    def aten(x):
        if x.sum() < -5:
            raise ValueError("aten refused")
        return x * 2

    op = Op(name="scratch", reference=lambda x: x * 2, signature=lambda x: (x.shape, x.dtype))
    op.implement("aten")(aten)
    op.implement("triton")(picky)
    with pytest.raises(ValueError, match="aten refused"):
        op(torch.full((2,), -4.0))
    rec = DISPATCH_LOG.records("scratch")[0]
    assert (rec["backend"], rec["calls"], rec["fallback"]) == ("triton", 0, False)
    assert torch.equal(op(torch.ones(2)), torch.full((2,), 2.0))
    rec = DISPATCH_LOG.records("scratch")[0]
    assert (rec["backend"], rec["calls"]) == ("triton", 1) and seen == [-8.0, 2.0]


def test_a_kernel_that_failed_is_never_adopted_from_another_rank():
    def broken(x):
        raise RuntimeError("kernel bug")

    op, _ = _scratch_op(triton_fn=broken)
    dec = Decision("scratch", "sig", "3", "float32", "triton", broken, (), 0, tuning_key="k")
    dec.alternatives = {"aten": op.impls["aten"].fn, "triton": broken}
    DISPATCH_LOG.add(dec)
    assert torch.equal(fly_lightning.dispatch._first_call(op, dec, (torch.ones(3),)), torch.full((3,), 2.0))
    assert dec.backend == "aten" and "triton" not in dec.alternatives
    assert fly_lightning.dispatch._adopt("scratch", "k", {"backend": "triton"}) == 0 and dec.backend == "aten"


def test_int_arguments_are_keyed_by_type():
    """``2``, ``2.0`` and ``True`` hash alike; a decision cached for one must not let another skip validation."""
    x = torch.randn(4, 8)
    fly_lightning.topk(x, 2)
    fly_lightning.topk(x, 1)
    for k in (2.0, True):
        with pytest.raises(ValueError, match="int"):
            fly_lightning.topk(x, k)


def test_policy_change_makes_a_new_decision():
    op, calls = _scratch_op()
    op(torch.ones(2))
    with dispatch_config(backends=("aten",)):
        op(torch.ones(2))
    op(torch.ones(2))
    recs = DISPATCH_LOG.records("scratch")
    assert [(r["backend"], r["calls"]) for r in recs] == [("triton", 2), ("aten", 1)]
    # aten-only policy: triton is simply not a candidate, so it is passed over without a reason
    assert not recs[1]["fallback"] and "triton" not in recs[1]["reason"]


def test_backend_preference_order_respected():
    op, _ = _scratch_op()
    with dispatch_config(backends=("aten", "triton")):  # aten is moved last: it can never shadow a candidate
        op(torch.ones(2))
    assert DISPATCH_LOG.records("scratch")[0]["backend"] == "triton"


def test_unavailable_backend_reason_recorded(monkeypatch):
    op, _ = _scratch_op()
    monkeypatch.delenv("TRITON_INTERPRET")  # a CPU machine without the interpreter: Triton has no device
    fly_lightning.registry.reset_availability()
    try:
        op(torch.ones(2))
    finally:
        monkeypatch.undo()
        fly_lightning.registry.reset_availability()
    rec = DISPATCH_LOG.records("scratch")[0]
    assert rec["backend"] == "aten" and "triton: no CUDA/ROCm device" in rec["reason"]


def test_flydsl_never_available_without_rocm():
    assert BACKENDS["flydsl"].is_available() is False
    assert "ROCm" in BACKENDS["flydsl"].unavailable_reason()


def test_measure_selects_fastest_and_records_tuning():
    import time

    def slow(x):
        time.sleep(0.01)
        return x * 2

    op, _ = _scratch_op(triton_fn=slow)
    with dispatch_config(select="measure"):
        out = op(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0))
    rec = DISPATCH_LOG.records("scratch")[0]
    assert rec["backend"] == "aten"
    assert rec["tuning_s"] > 0 and set(rec["timings_ms"]) == {"triton", "aten"}
    assert "slower when measured" in rec["reason"]


def test_validation_runs_once_per_signature_before_any_backend():
    events = []

    def validate(x):
        events.append("validate")
        if x.dim() == 0:
            raise ValueError("bad")

    op = Op(name="v", reference=lambda x: x, signature=lambda x: (x.shape,), validate=validate)
    op.implement("aten")(lambda x: events.append("aten") or x)
    op.implement("triton")(lambda x: events.append("triton") or x)
    op(torch.ones(2))
    op(torch.ones(2))
    assert events == ["validate", "triton", "triton"]
    events.clear()
    with pytest.raises(ValueError, match="bad"):
        op(torch.tensor(1.0))
    assert events == ["validate"]  # no backend ran


def test_unhashable_argument_reported_by_validation():
    def validate(x, k):
        if not isinstance(k, int):
            raise ValueError(f"k must be an int, got {type(k).__name__}")

    op = Op(name="u", reference=lambda x, k: x, signature=lambda x, k: (x.shape, k), validate=validate)
    op.implement("aten")(op.reference)
    with pytest.raises(ValueError, match="k must be an int, got list"):
        op(torch.ones(2), [2])


def test_support_predicate_that_raises_is_a_recorded_fallback():
    def predicate(x):
        raise AttributeError("no such attribute")

    op, calls = _scratch_op(triton_supports=predicate)
    assert torch.equal(op(torch.ones(2)), torch.full((2,), 2.0))
    rec = DISPATCH_LOG.records("scratch")[0]
    assert rec["backend"] == "aten" and rec["fallback"] and calls == []
    assert "triton: support check raised AttributeError: no such attribute" in rec["reason"]


def test_measure_records_a_candidate_that_raises():
    def broken(x):
        raise RuntimeError("too many resources requested")

    op, _ = _scratch_op(triton_fn=broken)
    with dispatch_config(select="measure"):
        out = op(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0))
    rec = DISPATCH_LOG.records("scratch")[0]
    assert rec["backend"] == "aten" and set(rec["timings_ms"]) == {"aten"}
    assert "triton: raised when measured: RuntimeError: too many resources requested" in rec["reason"]


def test_reset_availability_forgets_decisions(monkeypatch):
    x = torch.ones(2, 8)
    fly_lightning.rms_norm(x, None, 1e-6)
    assert DISPATCH_LOG.records("rms_norm")[-1]["backend"] == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    fly_lightning.registry.reset_availability()
    try:
        fly_lightning.rms_norm(x, None, 1e-6)  # the same signature: decided again, Triton gone
    finally:
        monkeypatch.undo()
        fly_lightning.registry.reset_availability()
    rec = DISPATCH_LOG.records("rms_norm")[-1]
    assert rec["backend"] == "aten" and "triton: no CUDA/ROCm device" in rec["reason"]


def test_unknown_op_name_in_policy_raises():
    with pytest.raises(ValueError, match=r"unknown operator\(s\) \['rmsnorm'\]"):
        with dispatch_config(disabled_ops={"rmsnorm"}):
            pass
    # a policy that reached dispatch without being set (the environment's) is checked on first use
    from fly_lightning import policy

    op, _ = _scratch_op()
    monkey = policy.DispatchConfig(op_backends={"rms_nrom": ("aten",)})
    previous, policy._active = policy._active, monkey
    try:
        with pytest.raises(ValueError, match="rms_nrom"):
            op(torch.ones(2))
    finally:
        policy._active = previous


def test_table_and_summary():
    op, _ = _scratch_op(triton_supports=lambda x: True if x.numel() < 4 else "too big")
    op(torch.ones(2))
    op(torch.ones(2))
    op(torch.ones(8))
    s = DISPATCH_LOG.summary()["scratch"]
    assert s["calls"] == 3 and s["by_backend"] == {"triton": 2, "aten": 1}
    assert s["specialised_share"] == pytest.approx(2 / 3)
    assert s["fallback_reasons"] == {"flydsl: no kernel for this op; triton: too big": ["8"]}
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(DISPATCH_LOG.table())
    text = console.export_text()
    assert "scratch" in text and "too big" in text
    # the reason shared by every row is said once, in the caption, not on each row
    assert text.count("flydsl: no kernel for this op") == 1
    assert "passed over on every row: flydsl: no kernel for this op" in text


def test_check_runs_on_every_call_after_validation():
    # validation runs once per signature; ``check`` (values a signature cannot hold) runs on every call, after it
    seen = []

    def check(x):
        seen.append("check")
        if (x < 0).any():
            raise ValueError("negative")

    op = Op(
        name="checked",
        reference=lambda x: x * 2,
        signature=lambda x: (x.shape, x.dtype),
        validate=lambda x: seen.append("validate"),
        check=check,
    )
    op.implement("aten")(op.reference)
    op(torch.ones(3))
    op(torch.ones(3))
    assert seen == ["validate", "check", "check"]
    with pytest.raises(ValueError, match="negative"):
        op(-torch.ones(3))  # same signature: only the check can catch it
