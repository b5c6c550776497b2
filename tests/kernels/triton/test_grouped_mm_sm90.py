"""The grouped GEMM kernel compiles for the H200 (sm_90) in every variant the table, tuning and MoE layer use: no
register spills, wgmma and TMA where expected, and warp specialisation taking effect where requested. Runs Triton's
compiler and bundled ptxas on the CPU (no GPU), in a subprocess without the interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="triton wheel without the NVIDIA backend's ptxas")
def test_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_compile.py"))], capture_output=True,
                          text=True, env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout)
    failed = {k: v["error"] for k, v in results.items() if not v["ok"]}
    assert not failed, failed
    for name, r in results.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert r["wgmma"] > 0, (name, r)
        assert r["specialised"] == r["ws_requested"], (name, r)
        assert r["shared"] <= 232448, (name, r)  # H100/H200: 227 KB of shared memory per block
    assert results["gather"]["tma_loads"] > 0  # the weights still come through TMA when rows are gathered
    assert results["pointer-128x128"]["tma_loads"] == 0
