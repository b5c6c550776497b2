"""Shared by the ``*sm90_compile.py`` scripts: compile a Triton kernel for sm_90 on the CPU (no GPU) with Triton's
compiler and bundled ptxas, and report variants as JSON on stdout.

The scripts run in a process without TRITON_INTERPRET (under the interpreter ``@triton.jit`` gives interpreted
functions that cannot be compiled); ``compiled_variants`` in this folder's conftest launches them.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _ptxas() -> str:
    """The ptxas Triton itself picks for sm_90: the PTX version it emits follows that one (Triton 3.9 emits PTX 9.x,
    which the older bundled ``ptxas`` rejects)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except (ImportError, AttributeError, TypeError):  # older Triton: one bundled ptxas
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


NO_LOOP = dict(loop_instructions=0, loop_opcodes={}, loop_shared_stores=0, loop_ldsm=0, loop_barriers=0,
               loop_async_copies=0)  # fmt: skip


def sass_loop(kernel, innermost_mma: bool = False) -> dict:
    """The kernel's main loop (its longest backward branch; with ``innermost_mma`` the shortest one holding an MMA,
    the K loop inside a persistent kernel's tile loop) in the SASS of the cubin Triton built: instruction count and
    the most frequent opcodes. Static counts, per thread and loop iteration."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        cuobjdump = os.path.join(os.path.dirname(_ptxas()), "cuobjdump")
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
    ins = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", sass)]
    branches = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\S*\s+(?:`\()?\S*?0x([0-9a-f]+)", sass)
    loops = [(int(t, 16), int(a, 16)) for a, t in branches if int(t, 16) < int(a, 16)]
    if not loops:
        return dict(NO_LOOP)
    if innermost_mma:
        loops = [(a, b) for a, b in loops if any(a <= x <= b and op.startswith(("HGMMA", "HMMA")) for x, op in ins)]
        if not loops:
            return dict(NO_LOOP)
    lo, hi = (min if innermost_mma else max)(loops, key=lambda b: b[1] - b[0])
    body = [op.split(".")[0] for a, op in ins if lo <= a <= hi]
    ops = Counter(body)
    return dict(
        loop_instructions=len(body),
        loop_opcodes=dict(ops.most_common(12)),
        # register data through shared memory (stores, matrix loads back) and the block barriers around it
        loop_shared_stores=ops["STS"] + ops["STSM"],
        loop_ldsm=ops["LDSM"],
        loop_barriers=ops["BAR"],
        loop_async_copies=ops["LDGSTS"],  # global -> shared copies issued per iteration: fewer when wider
    )


def compile_sm90(fn, sig: dict, const: dict, aligned: tuple[str, ...], **options):
    """``(compiled kernel, spill bytes, registers per thread)``: ``sig`` types the runtime arguments, ``aligned`` are
    16-divisible ones."""
    sig = {a: "constexpr" if a in const else sig[a] for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned if a not in const}
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        proc = subprocess.run(
            [_ptxas(), "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")], capture_output=True, text=True
        )
    # a failed or silent ptxas must fail the check, not read as "no spills"
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed: {proc.stderr[-1000:]}")
    spills = [int(m) for m in re.findall(r"(\d+) bytes spill stores", proc.stderr)]
    if not spills:
        raise RuntimeError(f"ptxas -v printed no spill line: {proc.stderr[-1000:]}")
    registers = [int(m) for m in re.findall(r"Used (\d+) registers", proc.stderr)]
    if not registers:
        raise RuntimeError(f"ptxas -v printed no register line: {proc.stderr[-1000:]}")
    return kernel, max(spills), max(registers)


def report(variants: dict[str, Callable[[], dict]]) -> None:
    """Build every variant; a failure is reported with its error rather than stopping the others."""
    out = {}
    for name, build in variants.items():
        try:
            out[name] = dict(ok=True, **build())
        except Exception as exc:  # noqa: BLE001 (reported per variant)
            out[name] = dict(ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
    json.dump(out, sys.stdout)
