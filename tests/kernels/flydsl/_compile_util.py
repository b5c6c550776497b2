"""Shared checks of the FlyDSL GEMM compile tests: the batch compile fixture body, the ISA facts every gfx950 kernel
must show, the runtime K loop, the stand-in for a ROCm tensor and the launch-tracing child."""

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fly_lightning.kernels.flydsl import _toolchain as compile_check

GFX950_TARGET = re.compile(r'^\s*\.amdgcn_target\s+"amdgcn-amd-amdhsa-[a-z]*-gfx950"', re.MULTILINE)


def require_toolchain() -> None:
    problem = compile_check.toolchain_problem()
    if problem:
        pytest.skip(f"FlyDSL compile checks cannot run: {problem}")


def compile_cases(compile_many: Callable[..., dict], cases: list[dict], out_dir: Path) -> list[dict]:
    """``compile_many`` (a kernel's ``compile_*_many``) on ``cases`` less their ``case`` name: one facts dict each."""
    require_toolchain()
    specs = [{k: v for k, v in s.items() if k != "case"} for s in cases]
    facts = compile_many(specs, out_dir=str(out_dir))
    assert "results" in facts, facts.get("reason", "") + facts.get("stderr_tail", "")
    assert len(facts["results"]) == len(cases)
    return facts["results"]


def ops(asm: str, prefix: str) -> list[str]:
    """Every instruction starting with ``prefix``, in order (repeats kept)."""
    return re.findall(rf"^\s+({prefix}\S*)", asm, re.MULTILINE)


def check_gfx950_facts(facts: dict[str, Any], kernel_name: str) -> str:
    """The facts every specialisation must show (gfx950, one wave64 block of 256, no scratch, no spills, within the
    256 VGPR + AGPR budget); returns the assembly."""
    assert facts["ok"], facts.get("reason", "")
    asm = Path(facts["asm_path"]).read_text()
    assert GFX950_TARGET.search(asm) and "gfx942" not in asm
    assert facts["kernel_name"].startswith(kernel_name)
    assert facts["wavefront_size"] == 64 and facts["max_flat_workgroup_size"] == 256
    assert facts["scratch_bytes"] == 0 and facts["vgpr_spill_count"] == 0 and facts["sgpr_spill_count"] == 0
    assert facts["vgpr_count"] + facts["agpr_count"] <= 256
    return asm


def print_isa_summary(cases: list[dict], compiled: list[dict], extra: Callable[[dict, str], str]) -> None:
    """One line per specialisation (shown with -s): register, LDS and scratch use, then ``extra(facts, asm)``."""
    for spec, f in zip(cases, compiled, strict=True):
        assert f["ok"]
        asm = Path(f["asm_path"]).read_text()
        print(
            f"{spec['case']:<34} vgpr={f['vgpr_count']} agpr={f['agpr_count']} sgpr={f['sgpr_count']} "
            f"lds={f['lds_bytes']} scratch={f['scratch_bytes']} {extra(f, asm)} compile_s={f['compile_s']}"
        )


def backward_branches(asm: str) -> list[re.Match]:
    """Conditional branches to an earlier label: a runtime loop (code size independent of its trip count)."""
    labels = {m.group(1): m.start() for m in re.finditer(r"^(\.LBB\d+_\d+):", asm, re.MULTILINE)}
    return [
        m for m in re.finditer(r"s_cbranch_\w+\s+(\.LBB\d+_\d+)", asm) if labels.get(m.group(1), 1 << 62) < m.start()
    ]


class OnRocm:
    """A CPU tensor standing in for one on a ROCm GPU (none here): what the registered predicate reads."""

    def __init__(self, t):
        self._t = t
        self.device = torch.device("cuda", 0)

    def __getattr__(self, name):
        return getattr(self._t, name)


def check_refuses_other_amd_arch(monkeypatch, backend, args: tuple) -> None:
    """``backend._supports(*args)`` (operands it accepts on gfx950) refuses gfx942, and a CUDA build before that."""
    monkeypatch.setattr(torch.version, "hip", "7.0")
    monkeypatch.setattr(backend, "device_arch", lambda device: "gfx942")
    assert "gfx942" in backend._supports(*args)
    monkeypatch.setattr(torch.version, "hip", None)  # a CUDA build: refused before the arch is looked at
    assert backend._supports(*args) == "tensor not on a ROCm device"


def trace_launches(tmp_path: Path, module_source: str) -> dict[str, Any]:
    """Run ``trace_launches()`` of ``module_source`` in a compile child with ``tmp_path`` as its output folder."""
    require_toolchain()
    (tmp_path / "launch_mod.py").write_text(module_source)
    facts = compile_check.run_compile_in_subprocess(
        str(tmp_path / "launch_mod.py"), "trace_launches", {}, out_dir=str(tmp_path)
    )
    assert facts["ok"], facts.get("reason", "") + facts.get("stderr_tail", "")
    return facts
