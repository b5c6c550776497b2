"""The RMSNorm kernels compile for the H200 (sm_90) in the variants the launcher uses, without register spills and with
16-byte vector loads and stores (the point of the aligned-rows and aligned-interior designs). Runs Triton's compiler
and bundled ptxas on the CPU (no GPU), in a subprocess without the interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="triton wheel without the NVIDIA backend's ptxas")
def test_kernels_compile_for_sm90_with_vector_memory_access():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("rms_norm_sm90_compile.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout)
    failed = {k: v["error"] for k, v in results.items() if not v["ok"]}
    assert not failed, failed
    for name, r in results.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert r["vector_loads"] > 0 and r["vector_stores"] > 0, (name, r)
        if name.startswith("rows"):
            assert r["scalar_loads"] == 0, (name, r)  # aligned rows: every x and weight load is a vector
