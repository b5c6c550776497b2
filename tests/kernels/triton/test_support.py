"""``written_in_full``: with deterministic algorithms, the Triton backends allocate their outputs without PyTorch's
fill (they store every element), and leave the fill setting as they found it. ``launch_tuned``: the autotuner runs
once per tuning key."""

import contextlib

import pytest
import torch
import triton
import triton.language as tl
from torch.overrides import TorchFunctionMode
from torch.profiler import profile

from fly_lightning.kernels.triton import moe_combine, moe_route, rms_norm, swiglu, topk
from fly_lightning.kernels.triton._support import launch_tuned, written_in_full


@contextlib.contextmanager
def _deterministic(fill: bool = True):
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = True


def _ops(fn) -> list[str]:
    with profile() as prof:
        fn()
    return [e.name for e in prof.events()]


def test_skips_the_fill_only_inside_and_restores_it():
    with _deterministic():
        assert "aten::fill_" in _ops(lambda: torch.empty(8))
        with written_in_full():
            assert not torch.utils.deterministic.fill_uninitialized_memory
            assert "aten::fill_" not in _ops(lambda: torch.empty(8))
        assert torch.utils.deterministic.fill_uninitialized_memory
        with pytest.raises(RuntimeError), written_in_full():
            raise RuntimeError("kernel failed")
        assert torch.utils.deterministic.fill_uninitialized_memory


def test_leaves_the_setting_alone_when_there_is_no_fill():
    assert isinstance(written_in_full(), contextlib.nullcontext)  # deterministic algorithms off
    with _deterministic(fill=False):
        with written_in_full():
            pass
        assert not torch.utils.deterministic.fill_uninitialized_memory


def _calls():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 16, generator=g).to(torch.bfloat16)
    x = torch.randn(6, 32, generator=g)
    gate_up = torch.randn(5, 24, generator=g)
    rows = torch.randn(12, 16, generator=g)
    weights = torch.rand(6, 2, generator=g)
    return {
        "moe_route": lambda: moe_route.moe_route_triton(logits, 2, "softmax", True, None, 1.0, None, None, True),
        "topk": lambda: topk.topk_triton(x, 3),
        "rms_norm": lambda: rms_norm.rms_norm_triton(x, torch.ones(32), 1e-6, 0.0, False),
        "swiglu": lambda: swiglu.swiglu_triton(gate_up, None),
        "moe_combine": lambda: moe_combine.moe_combine_triton(rows, weights, None, None),
    }


class _Allocations(TorchFunctionMode):
    """The fill setting at each ``torch.empty`` call, by the new tensor's address (the interpreter's own tensors
    come and go too; only the outputs' allocations are looked up)."""

    def __init__(self):
        super().__init__()
        self.fill = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.empty:
            self.fill[out.data_ptr()] = torch.utils.deterministic.fill_uninitialized_memory
        return out


@pytest.mark.parametrize("op", sorted(_calls()))
def test_backends_allocate_outputs_without_the_fill(op):
    call = _calls()[op]
    with _deterministic():
        with _Allocations() as seen:
            got = call()
        assert torch.utils.deterministic.fill_uninitialized_memory  # restored
    got = got if isinstance(got, tuple) else (got,)
    assert [seen.fill[t.data_ptr()] for t in got if t.numel()] == [False] * sum(t.numel() > 0 for t in got)
    with _deterministic(), pytest.MonkeyPatch.context() as patch:  # the same call with the fill: same outputs
        module = {"moe_route": moe_route, "topk": topk, "rms_norm": rms_norm, "swiglu": swiglu}.get(op, moe_combine)
        patch.setattr(module, "written_in_full", contextlib.nullcontext)
        want = call()
    for a, b in zip(got, want if isinstance(want, tuple) else (want,), strict=True):
        assert torch.equal(a, b)


# --- launch_tuned ---------------------------------------------------------------------------------------------------


@triton.jit
def _fill_block(Y, n, BLOCK: tl.constexpr, KEY: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    value = tl.full([BLOCK], BLOCK + KEY, tl.int32)  # which config ran, in the output
    tl.store(Y + offs, value.to(Y.dtype.element_ty), mask=offs < n)


def test_launch_tuned_tunes_once_per_key_then_launches_the_pick(monkeypatch):
    """The autotuner runs the first time a key is seen (and picks the config it measured fastest); later calls launch
    that config straight through the kernel; a new key value or dtype tunes again."""
    tuned = triton.autotune([triton.Config({"BLOCK": 4}), triton.Config({"BLOCK": 16})], key=["KEY"])(_fill_block)
    tuned._bench = lambda *args, config, **kwargs: [1.0 if config.kwargs["BLOCK"] == 16 else 2.0]
    runs = []
    real_run = type(tuned).run
    monkeypatch.setattr(type(tuned), "run", lambda self, *a, **k: runs.append(k["KEY"]) or real_run(self, *a, **k))

    def launch(dtype: torch.dtype, key: int) -> torch.Tensor:
        y = torch.zeros(37, dtype=dtype)
        launch_tuned(tuned, lambda meta: (triton.cdiv(37, meta["BLOCK"]),), (y, 37), {"KEY": key})
        return y

    for _ in range(3):
        assert torch.equal(launch(torch.float32, 1), torch.full((37,), 17.0))  # BLOCK 16 ran, every element
    assert runs == [1]
    launch(torch.float32, 2)
    launch(torch.int32, 2)
    assert runs == [1, 2, 2]
