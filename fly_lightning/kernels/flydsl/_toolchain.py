"""Compile FlyDSL kernels for AMD gfx950 on a machine without an AMD GPU.

FlyDSL can lower a kernel all the way to gfx950 assembly on a CPU-only host,
but *launching* one without the HIP runtime aborts the whole Python process
(SIGABRT, uncatchable). So every compile here runs in a child process with an
environment that makes a launch impossible:

* ``COMPILE_ONLY=1``: ``flyc.compile`` traces + compiles and returns ``None``;
* ``FLYDSL_GPU_ARCH=gfx950``: without it FlyDSL silently targets gfx942;
* ``ARCH`` removed: FlyDSL reads that generic name as a target override;
* ``ROCM_PATH``: a temporary folder holding ``llvm/bin/ld.lld``, the only
  ROCm piece the code-object link needs;
* ``FLYDSL_DEBUG_DUMP_ASM=1`` (or ``FLYDSL_DUMP_IR=1`` for every stage) with
  ``FLYDSL_DUMP_DIR``: writes the final ``.s`` we inspect.

A child that dies (abort, segfault, timeout) becomes ``{"ok": False, ...}``
with a reason instead of killing the caller.

Usage: ``run_compile_in_subprocess("rms_norm.py", "_compile_here", {...})``.
The named function runs inside the child, must return a JSON-able dict, and
normally ends by calling :func:`compile_and_collect`.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TARGET_ARCH = "gfx950"
_RESULT_MARK = "FLYDSL_FACTS_JSON:"
_HERE = Path(__file__).resolve().parent


def find_ld_lld() -> str | None:
    """Return a path to an ``ld.lld`` that can link AMDGPU code objects, or None.

    Order: $FLYDSL_LD_LLD, an existing ROCm install, ``ld.lld-NN`` / ``ld.lld``
    on PATH, Debian/Ubuntu ``/usr/lib/llvm-NN/bin/ld.lld`` (newest first), then
    the LLD inside the ``ziglang`` wheel (the ``flydsl`` extra installs it), so
    ``pip install`` alone gives a working toolchain.
    """
    candidates = [os.environ.get("FLYDSL_LD_LLD")]
    for root in (os.environ.get("ROCM_PATH"), "/opt/rocm"):
        if root:
            candidates.append(os.path.join(root, "llvm", "bin", "ld.lld"))
    candidates += [shutil.which(f"ld.lld-{v}") for v in range(22, 16, -1)]
    candidates.append(shutil.which("ld.lld"))

    def _llvm_version(path: str) -> int:
        m = re.search(r"llvm-(\d+)", path)
        return int(m.group(1)) if m else 0

    candidates += sorted(glob.glob("/usr/lib/llvm-*/bin/ld.lld"), key=_llvm_version, reverse=True)
    for cand in candidates:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            # Not realpath: ld.lld is usually a link to the multi-call `lld`, which picks
            # its flavour from the name it is called by.
            return os.path.abspath(cand)
    return _zig_ld_lld()


def _zig_ld_lld() -> str | None:
    """An ``ld.lld`` wrapper around ``python -m ziglang ld.lld`` (LLD built with the AMDGPU target)."""
    if importlib.util.find_spec("ziglang") is None:
        return None
    wrapper = Path(tempfile.gettempdir()) / f"fly_lightning_zig_{os.getuid()}" / "ld.lld"
    text = f'#!/bin/sh\nexec "{sys.executable}" -m ziglang ld.lld "$@"\n'
    if not wrapper.exists() or wrapper.read_text() != text:
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        tmp = wrapper.with_suffix(f".{os.getpid()}")
        tmp.write_text(text)
        tmp.chmod(0o755)
        tmp.replace(wrapper)  # atomic: concurrent compiles never see a half-written script
    return str(wrapper)


def flydsl_version() -> str | None:
    """Installed FlyDSL version without importing it (import loads ~270 MB of libs)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - py<3.8
        return None
    try:
        return version("flydsl")
    except PackageNotFoundError:
        return None


def flydsl_installed() -> bool:
    return importlib.util.find_spec("flydsl") is not None


def toolchain_problem() -> str | None:
    """Why a gfx950 compile cannot run here, or None when it can."""
    if not flydsl_installed():
        return "flydsl is not installed (pip install flydsl==0.5.0)"
    if find_ld_lld() is None:
        return "no ld.lld found (pip install ziglang, apt-get install lld-19, or set FLYDSL_LD_LLD)"
    return None


def _child_env(rocm_root: str, dump_dir: str, all_stages: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("ARCH", None)  # FlyDSL treats a generic ARCH as its target override
    for key in ("FLYDSL_DUMP_IR", "FLYDSL_DEBUG_DUMP_ASM", "FLYDSL_RUNTIME_RUN_ONLY"):
        env.pop(key, None)
    env.update(
        FLYDSL_GPU_ARCH=TARGET_ARCH,
        COMPILE_ONLY="1",
        ROCM_PATH=rocm_root,
        FLYDSL_DUMP_DIR=dump_dir,
        # A private cache: never reuse or pollute ~/.flydsl across experiments.
        FLYDSL_RUNTIME_CACHE_DIR=os.path.join(rocm_root, "cache"),
        # No device: keep torch from probing for one.
        HIP_VISIBLE_DEVICES="",
        CUDA_VISIBLE_DEVICES="",
    )
    env["FLYDSL_DUMP_IR" if all_stages else "FLYDSL_DEBUG_DUMP_ASM"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_HERE), env.get("PYTHONPATH")) if p)
    return env


def run_compile_in_subprocess(
    module_file: str,
    func_name: str,
    kwargs: dict[str, Any],
    *,
    out_dir: str | None = None,
    all_stages: bool = False,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Run ``module_file:func_name(**kwargs)`` in a child set up for gfx950 compiles.

    ``kwargs`` must be JSON-able; ``out_dir`` (created if missing) receives the
    dumps and exports. Returns the child's dict, or ``{"ok": False, "reason": ...}``.
    """
    problem = toolchain_problem()
    if problem:
        return {"ok": False, "reason": problem, "toolchain_missing": True}
    module_path = Path(module_file)
    if not module_path.is_absolute():
        module_path = _HERE / module_path
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="flydsl_out_"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flydsl_rocm_") as rocm_root:
        os.makedirs(os.path.join(rocm_root, "llvm", "bin"))
        os.symlink(find_ld_lld(), os.path.join(rocm_root, "llvm", "bin", "ld.lld"))
        dump_dir = str(out / "dump")
        shutil.rmtree(dump_dir, ignore_errors=True)  # stale .s files would fake success
        worker = [str(Path(__file__).resolve()), "--worker", str(module_path), func_name, json.dumps(kwargs)]
        cmd = [sys.executable, *worker]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd,
                env=_child_env(rocm_root, dump_dir, all_stages),
                cwd=str(out),
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "reason": f"compile timed out after {timeout_s:.0f}s", "out_dir": str(out)}
        wall = time.perf_counter() - t0
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_RESULT_MARK):
            facts = json.loads(line[len(_RESULT_MARK) :])
            facts["subprocess_wall_s"] = round(wall, 3)
            if not facts.get("ok") and proc.stderr:
                facts["stderr_tail"] = proc.stderr[-3000:]
            facts.setdefault("out_dir", str(out))
            return facts
    if proc.returncode < 0:
        why = f"compile process killed by {signal.Signals(-proc.returncode).name}"
    else:
        why = f"compile process exited with code {proc.returncode} without a result"
    tail = (proc.stderr or proc.stdout)[-3000:]
    return {"ok": False, "reason": why, "stderr_tail": tail, "out_dir": str(out)}


# --------------------------------------------------------------------------
# Inside the child.
# --------------------------------------------------------------------------

_ASM_INT_FIELDS = {
    "vgpr_count": r"\.vgpr_count:\s+(\d+)",
    "agpr_count": r"\.agpr_count:\s+(\d+)",
    "sgpr_count": r"\.sgpr_count:\s+(\d+)",
    "vgpr_spill_count": r"\.vgpr_spill_count:\s+(\d+)",
    "sgpr_spill_count": r"\.sgpr_spill_count:\s+(\d+)",
    "lds_bytes": r"\.group_segment_fixed_size:\s+(\d+)",
    "scratch_bytes": r"\.private_segment_fixed_size:\s+(\d+)",
    "kernarg_bytes": r"\.kernarg_segment_size:\s+(\d+)",
    "max_flat_workgroup_size": r"\.max_flat_workgroup_size:\s+(\d+)",
    "wavefront_size": r"\.wavefront_size:\s+(\d+)",
}


def parse_asm_facts(asm: str) -> dict[str, Any]:
    """Target, kernel symbols and resource usage from an AMDGPU ``.s`` file."""
    facts: dict[str, Any] = {}
    m = re.search(r'\.amdgcn_target\s+"([^"]+)"', asm)
    facts["amdgcn_target"] = m.group(1) if m else None
    facts["kernel_symbols"] = re.findall(r"^\s*\.amdhsa_kernel\s+(\S+)", asm, re.M)
    for key, pat in _ASM_INT_FIELDS.items():
        m = re.search(pat, asm)
        facts[key] = int(m.group(1)) if m else None
    facts["num_instructions"] = sum(
        1 for line in asm.splitlines() if re.match(r"^\s+[sv]_|^\s+(buffer|global|ds|flat)_", line)
    )
    return facts


def placeholders_are_safe(args: tuple) -> None:
    """Refuse to compile with anything FlyDSL could launch on (a device tensor)."""
    import torch

    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type != "cpu":
            raise RuntimeError(f"compile placeholder on {a.device}: would launch")


def compile_and_collect(jit_fn: Callable, args: tuple, *, export_name: str | None) -> dict[str, Any]:
    """Compile ``jit_fn(*args)`` for gfx950 without launching; return the facts.

    ``args`` are CPU tensors / Python scalars (FlyDSL treats CPU tensors as
    compile placeholders). With ``export_name`` the specialization is also
    exported with ``CompiledFunction.export_to_c`` (.o + .h in the cwd).
    """
    if os.environ.get("COMPILE_ONLY") != "1" or os.environ.get("FLYDSL_GPU_ARCH") != TARGET_ARCH:
        raise RuntimeError("compile_and_collect must run under compile_check's child environment")
    placeholders_are_safe(args)
    import flydsl.compiler as flyc

    t0 = time.perf_counter()
    if flyc.compile(jit_fn, *args) is not None:  # COMPILE_ONLY returns None: compiled, nothing launched
        raise RuntimeError("flyc.compile returned a callable under COMPILE_ONLY=1")
    compile_s = time.perf_counter() - t0

    dump_dir = Path(os.environ["FLYDSL_DUMP_DIR"])
    asm_files = sorted(dump_dir.glob("*/*final_isa.s"))
    facts: dict[str, Any] = {
        "ok": bool(asm_files),
        "arch": TARGET_ARCH,
        "flydsl_version": flydsl_version(),
        "compile_s": round(compile_s, 3),
        "asm_path": str(asm_files[-1]) if asm_files else None,
    }
    if not asm_files:
        facts["reason"] = f"FlyDSL produced no *final_isa.s under {dump_dir}"
        return facts
    facts.update(parse_asm_facts(asm_files[-1].read_text()))
    facts["kernel_name"] = facts["kernel_symbols"][0] if facts["kernel_symbols"] else None

    if export_name:
        # export_to_c needs a CompiledFunction, which COMPILE_ONLY never returns.
        # With COMPILE_ONLY off, CPU-tensor placeholders still make flyc.compile
        # skip the launch (checked above), and the in-memory cache means nothing
        # is recompiled. We are in a throwaway child process either way.
        os.environ["COMPILE_ONLY"] = "0"
        try:
            t1 = time.perf_counter()
            compiled = flyc.compile(jit_fn, *args)
            compiled.export_to_c(os.getcwd(), export_name)
            facts["export_s"] = round(time.perf_counter() - t1, 3)
            facts["object_path"] = os.path.join(os.getcwd(), export_name + ".o")
            facts["header_path"] = os.path.join(os.getcwd(), export_name + ".h")
        except Exception as exc:  # noqa: BLE001 - report, the .s is still valid
            facts["export_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            os.environ["COMPILE_ONLY"] = "1"
    return facts


def outputs_module():
    """``kernels/outputs.py``, the kernels' output allocator, loaded by its path for kernel modules that were
    themselves loaded by path (the compile child imports no fly_lightning code). One module object per process."""
    name = "_fly_lightning_kernel_outputs"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, _HERE.parent / "outputs.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def _worker(module_path: str, func_name: str, kwargs_json: str) -> int:
    try:
        name = Path(module_path).stem
        spec = importlib.util.spec_from_file_location(name, module_path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and FlyDSL look the module up by name
        spec.loader.exec_module(module)
        facts = getattr(module, func_name)(**json.loads(kwargs_json))
    except Exception as exc:  # noqa: BLE001 - the parent wants a reason, not a traceback
        import traceback

        traceback.print_exc()
        facts = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}
    sys.stdout.flush()
    print(_RESULT_MARK + json.dumps(facts), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        sys.exit(_worker(*sys.argv[2:]))
    print(json.dumps({"ld_lld": find_ld_lld(), "flydsl": flydsl_version(), "problem": toolchain_problem()}))
