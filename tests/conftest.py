"""Test setup: Triton kernels run on CPU through the interpreter; dispatch state is reset between tests."""

import os

# must be set before any @triton.jit decorator runs
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import fly_lightning  # noqa: E402
from fly_lightning.registry import reset_availability  # noqa: E402

reset_availability()


@pytest.fixture(autouse=True)
def _clean_dispatch_state(tmp_path, monkeypatch):
    """Each test starts with an empty dispatch log, the default policy, its own (empty) tuning database and the whole
    tuning budget."""
    from fly_lightning import tuning

    monkeypatch.setenv("FLY_LIGHTNING_TUNING_DB", str(tmp_path / "tuning.json"))
    tuning.reset_budget()
    previous = fly_lightning.set_dispatch_config(fly_lightning.DispatchConfig())
    fly_lightning.DISPATCH_LOG.reset()
    torch.manual_seed(0)
    yield
    fly_lightning.set_dispatch_config(previous)
    fly_lightning.DISPATCH_LOG.reset()


@pytest.fixture(scope="session", autouse=True)
def poisoned_outputs():
    """Every kernel output is poisoned for the whole session (``fly_lightning.kernels.outputs.POISON``): filled with
    NaN / the largest integer, with or without deterministic algorithms, so an element a kernel fails to store shows
    in the comparison. Autouse, so no test can forget it; a test of the production allocation switches it off with
    ``monkeypatch.setattr(outputs, "POISON", False)``."""
    from fly_lightning.kernels import outputs

    previous, outputs.POISON = outputs.POISON, True
    yield
    outputs.POISON = previous
