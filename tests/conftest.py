"""Test setup: Triton kernels run on CPU through the interpreter; dispatch state is reset between tests."""

import contextlib
import os

# must be set before any @triton.jit decorator runs
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import fly_lightning  # noqa: E402
from fly_lightning.backends import reset_availability  # noqa: E402

reset_availability()


@pytest.fixture(autouse=True)
def _clean_dispatch_state():
    """Each test starts with an empty dispatch log and the default policy."""
    previous = fly_lightning.set_dispatch_config(fly_lightning.DispatchConfig())
    fly_lightning.DISPATCH_LOG.reset()
    torch.manual_seed(0)
    yield
    fly_lightning.set_dispatch_config(previous)
    fly_lightning.DISPATCH_LOG.reset()


@pytest.fixture(scope="module")  # module scope: hypothesis refuses function-scoped fixtures
def poisoned_outputs():
    """Keep deterministic mode's fill of new tensors (NaN / largest integer) on the kernels' outputs too, which
    ``written_in_full`` skips outside tests: an element a kernel fails to store then shows in the comparison."""
    from fly_lightning.kernels.triton import moe_combine, moe_route, rms_norm, swiglu, topk

    with pytest.MonkeyPatch.context() as patch:
        for module in (moe_combine, moe_route, rms_norm, swiglu, topk):
            patch.setattr(module, "written_in_full", contextlib.nullcontext)
        yield
