"""GPU correctness tests: every test here is marked ``gpu`` and is skipped, at collection, without a CUDA device or
while the Triton interpreter is on (``tests/conftest.py`` turns it on unless ``TRITON_INTERPRET`` is already set).

On the GPU machine: ``TRITON_INTERPRET=0 python -m pytest tests/gpu -m gpu -q`` (``benchmarks/gpu_session.sh tests``).
"""

from __future__ import annotations

import os

import pytest
import torch


def gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "no", "off"):
        return "the Triton interpreter is on: run with TRITON_INTERPRET=0"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
