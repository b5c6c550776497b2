"""``FastLaunch``: the compiled kernel keyed by what Triton specialises on, its launcher called directly, the plain
launch wherever the shortcut could differ. A fake kernel stands in for Triton's (no GPU here); the GPU tests run the
real launchers (every MX GEMM, cast and dequantisation test goes through it)."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from fly_lightning.kernels.triton import _launch
from fly_lightning.kernels.triton._launch import FastLaunch, _key

needs_knobs = pytest.mark.skipif(_launch.knobs is None, reason="Triton without launch knobs: plain launches only")


class FakeKernel:
    """A JITFunction's surface: ``params``, ``fn``, ``kernel[grid](...)`` returning a compiled kernel."""

    def __init__(self, names, constexpr, defaults=None):
        defaults = defaults or {}
        self.params = [
            SimpleNamespace(name=n, is_constexpr=n in constexpr, default=defaults.get(n, inspect.Parameter.empty))
            for n in names
        ]
        self.fn = SimpleNamespace(__name__="fake")
        self.plain: list[tuple] = []
        self.launched: list[tuple] = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.plain.append((grid, args, kwargs))
            return SimpleNamespace(
                function="fn", packed_metadata="meta", run=self._launcher, launch_metadata=lambda *a: "launch-meta"
            )

        return run

    def _launcher(self, *args):
        self.launched.append(args)


@pytest.fixture
def on_gpu0(monkeypatch):
    monkeypatch.setattr(_launch, "_device", lambda: 0)
    monkeypatch.setattr(_launch, "_stream", lambda device: 1234)


def test_key_separates_what_triton_specialises_on():
    x = torch.zeros(64)
    same = [(x, 32), (x, 48), (x.clone(), 64)]
    assert len({_key(a) for a in same}) == 1
    differ = [(x, 32), (x[1:], 32), (x, 1), (x, 33), (x, 2**31 + 16), (x, 2**63 + 16), (x.double(), 32), (x, 0.5),
              (x, None)]  # fmt: skip
    assert len({_key(a) for a in differ}) == len(differ)
    with pytest.raises(TypeError, match="no specialisation key"):
        _key((x, True))  # bools, descriptors, ...: not keyed here (the plain launch runs)


def test_constants_between_runtime_arguments_keep_the_plain_launch():
    assert FastLaunch(FakeKernel(["X", "BLOCK", "n"], {"BLOCK"})).broken


@needs_knobs
def test_first_call_compiles_then_launcher_is_called_directly(on_gpu0):
    k = FakeKernel(["X", "n", "BLOCK", "FLAG"], {"BLOCK", "FLAG"}, defaults={"FLAG": False})
    fast = FastLaunch(k)
    x = torch.zeros(64)
    fast((4,), (x, 32), BLOCK=16, num_warps=4)
    assert len(k.plain) == 1 and not k.launched
    fast((5, 2), (x, 48), BLOCK=16, num_warps=4)  # same specialisation: the launcher, grid padded to 3-D
    assert len(k.plain) == 1
    hooks = _launch.knobs.runtime
    # no enter hook: no launch metadata (Triton's launch_metadata would return None too)
    want = (5, 2, 1, 1234, "fn", "meta", None, hooks.launch_enter_hook, hooks.launch_exit_hook, x, 48, 16)
    assert k.launched[-1] == (*want, False)  # the omitted constexpr at its default
    fast((4,), (x[1:], 48), BLOCK=16, num_warps=4)  # misaligned pointer: a new key, Triton decides
    fast((4,), (x, 49), BLOCK=16, num_warps=4)  # not divisible by 16 any more: likewise
    fast((4,), (x, 48), BLOCK=32, num_warps=4)  # another constant
    fast((4,), (x, 48), BLOCK=16, num_warps=8)  # another option
    fast((4,), (x, 48), BLOCK=16, FLAG=True, num_warps=4)  # a default overridden
    assert len(k.plain) == 6 and len(k.launched) == 1
    fast((4,), (x, 48, 16), num_warps=2)  # not the runtime arguments the kernel takes: Triton's launch reports it
    assert len(k.plain) == 7


@needs_knobs
def test_refused_launcher_falls_back_for_good(on_gpu0):
    k = FakeKernel(["X", "BLOCK"], {"BLOCK"})
    fast = FastLaunch(k)

    def refuse(*args):
        raise TypeError("function takes exactly 9 arguments")

    k._launcher = refuse
    x = torch.zeros(16)
    for _ in range(3):
        fast((1,), (x,), BLOCK=16)
    assert len(k.plain) == 3 and fast.broken


@needs_knobs
def test_after_one_direct_launch_errors_propagate_and_nothing_launches_twice(on_gpu0):
    k = FakeKernel(["X", "BLOCK"], {"BLOCK"})
    fast = FastLaunch(k)
    x = torch.zeros(16)
    for _ in range(2):
        fast((1,), (x,), BLOCK=16)
    assert fast.verified and len(k.plain) == 1 and len(k.launched) == 1

    def fails_late(*args):  # e.g. a profiler's exit hook raising after the kernel was queued
        k.launched.append(args)
        raise ValueError("hook failed")

    compiled, _ = next(iter(fast.compiled.values()))
    compiled.run = fails_late
    with pytest.raises(ValueError, match="hook failed"):
        fast((1,), (x,), BLOCK=16)
    assert len(k.plain) == 1 and len(k.launched) == 2


@needs_knobs
def test_a_first_direct_launch_failing_with_hooks_set_is_not_replayed(on_gpu0, monkeypatch):
    k = FakeKernel(["X", "BLOCK"], {"BLOCK"})
    fast = FastLaunch(k)
    monkeypatch.setattr(_launch.knobs.runtime, "launch_exit_hook", lambda *a: None)

    def fails_late(*args):
        raise TypeError("hook failed")

    k._launcher = fails_late
    x = torch.zeros(16)
    fast((1,), (x,), BLOCK=16)
    with pytest.raises(TypeError, match="hook failed"):
        fast((1,), (x,), BLOCK=16)
    assert len(k.plain) == 1 and fast.broken


@needs_knobs
def test_debug_settings_and_pre_run_hooks_miss_the_cache(on_gpu0, monkeypatch):
    k = FakeKernel(["X", "BLOCK"], {"BLOCK"})
    fast = FastLaunch(k)
    x = torch.zeros(16)
    fast((1,), (x,), BLOCK=16)
    monkeypatch.setattr(_launch.knobs.runtime, "debug", not _launch.knobs.runtime.debug)
    fast((1,), (x,), BLOCK=16)  # Triton recompiles under the other setting: so does the cache
    assert len(k.plain) == 2 and not k.launched
    k.pre_run_hooks = [lambda *a, **kw: None]
    fast((1,), (x,), BLOCK=16)
    assert len(k.plain) == 3 and not k.launched


@needs_knobs
def test_a_compiled_kernel_without_the_launch_fields_takes_the_plain_launch(on_gpu0):
    k = FakeKernel(["X", "BLOCK"], {"BLOCK"})
    fast = FastLaunch(k)
    x = torch.zeros(16)
    fast((1,), (x,), BLOCK=16)
    del next(iter(fast.compiled.values()))[0].packed_metadata  # another Triton's CompiledKernel
    fast((1,), (x,), BLOCK=16)
    assert fast.broken and len(k.plain) == 2 and not k.launched


def test_rocm_keeps_the_plain_launch(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4")  # its Triton also keys tensors on storage size
    assert FastLaunch(FakeKernel(["X", "BLOCK"], {"BLOCK"})).broken


def test_interpreted_kernels_take_the_plain_launch():
    interpreted = FastLaunch(SimpleNamespace(fn=SimpleNamespace(__name__="f")))
    assert interpreted.broken


@needs_knobs
@pytest.mark.parametrize("which", ["launch_enter_hook", "launch_exit_hook"])
def test_a_launch_hook_gets_the_compiled_kernels_launch_metadata(on_gpu0, monkeypatch, which):
    k = FakeKernel(["X", "BLOCK"], {"BLOCK"})
    fast = FastLaunch(k)
    x = torch.zeros(16)
    hook = lambda *a: None  # noqa: E731 (a profiler's hook: Triton 3.9 passes the metadata to both)
    monkeypatch.setattr(_launch.knobs.runtime, which, hook)
    for _ in range(2):
        fast((1,), (x,), BLOCK=16)
    assert k.launched[-1][6] == "launch-meta" and hook in k.launched[-1][7:9]
