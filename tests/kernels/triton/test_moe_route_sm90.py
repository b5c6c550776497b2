"""The routing and top-k kernels compile for the H200 (sm_90) with the constexprs their launchers use (bf16/fp32
logits, softmax/sigmoid, bias, expert groups, the permutation variant, E not a power of two), without register
spills. Runs Triton's compiler and bundled ptxas on the CPU (no GPU), in a subprocess without the interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="triton wheel without the NVIDIA backend's ptxas")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("moe_route_sm90_compile.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout)
    failed = {k: v["error"] for k, v in results.items() if not v["ok"]}
    assert not failed, failed
    for name, r in results.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert r["shared"] <= 232448, (name, r)
