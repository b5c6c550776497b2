import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.fixture(autouse=True)
def gpu_row_blocks(monkeypatch):
    """The kernels' GPU launch plans under the interpreter too (not its larger row blocks): the tests here cross
    program boundaries as a GPU launch does."""
    from fly_lightning.kernels.triton import _support

    monkeypatch.setattr(_support, "INTERPRETER_ROWS", 0)


@pytest.fixture
def compiled_variants():
    """``compiled_variants("x_sm90_compile.py")``: run that script without the interpreter and return its per-variant
    results, after checking that every variant compiled."""

    def run(script: str, needs_ptxas: bool = True) -> dict:
        if needs_ptxas and not PTXAS.exists():
            pytest.skip("triton wheel without the NVIDIA backend's ptxas")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        path = Path(__file__).with_name(script)
        proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr[-2000:]
        results = json.loads(proc.stdout)
        failed = {k: v["error"] for k, v in results.items() if not v["ok"]}
        assert not failed, failed
        return results

    return run


@pytest.fixture
def shared_step():
    """``shared_step(cb) -> (top, a, b)``: ``b`` the next fp32 above ``a``, both far below ``top``, where the relative
    keys of a row with ``cb`` columns compress them into one step (their order by value is then unknown to the keys)."""
    import torch

    from fly_lightning.kernels.triton._select import relative_distance

    def pair(cb: int) -> tuple[float, float, float]:
        top, a = torch.tensor(1e30), torch.tensor(1.0)
        while True:
            b = torch.nextafter(a, torch.tensor(2.0))
            d = relative_distance(torch.stack([top, a, b]), cb)
            if d[1] == d[2]:
                return top.item(), a.item(), b.item()
            a = b

    return pair
