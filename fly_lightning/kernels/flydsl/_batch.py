"""Compile one FlyDSL kernel's specializations, one or many, in a compile child (see ``_toolchain``).

A kernel module provides ``build(plan)`` (the ``@flyc.jit`` launcher), ``example_args(plan)`` (CPU placeholders) and
``_compile_here(plan: dict, export: bool)``, which calls :func:`compile_plan_here` with them. :func:`compile_many`
then compiles a whole list of specializations in ONE child process (one import of torch + FlyDSL, about 1 s a
compile instead of several), each failure being that plan's result rather than the end of the batch.
"""

import importlib
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

try:  # inside the package
    from . import _toolchain as compile_check
except ImportError:  # loaded by file path in the compile child (keeps the child free of fly_lightning imports)
    import _toolchain as compile_check


def compile_plan_here(
    build: Callable[[Any], Callable], example_args: Callable[[Any], tuple], plan: Any, *, export_name: str | None
) -> dict[str, Any]:
    """Inside the compile child: compile ``build(plan)`` with ``example_args(plan)``; the facts name the plan."""
    facts = compile_check.compile_and_collect(build(plan), example_args(plan), export_name=export_name)
    facts["plan"] = asdict(plan)
    return facts


def compile_one(module_file: str, plan: Any, *, out_dir: str | None, export: bool, all_stages: bool) -> dict[str, Any]:
    """Compile one (supported) plan of the kernel in ``module_file`` in a child process with its ``_compile_here``."""
    facts = compile_check.run_compile_in_subprocess(
        module_file, "_compile_here", {"plan": asdict(plan), "export": export}, out_dir=out_dir, all_stages=all_stages
    )
    facts["supported"] = True
    return facts


def compile_many(
    module_file: str, spec_plan: Callable[[dict[str, Any]], Any], specs: list[dict[str, Any]], out_dir: str | None
) -> dict[str, Any]:
    """Compile several specializations of the kernel in ``module_file`` in one child process.

    ``spec_plan`` turns one spec into the kernel's plan dataclass, raising ``ValueError`` for an unsupported one
    (before anything compiles). Returns ``{"ok", "results"}``, one facts dict per spec, in order.
    """
    plans = [asdict(spec_plan(s)) for s in specs]
    return compile_check.run_compile_in_subprocess(
        __file__, "_compile_many_here", {"module_path": str(module_file), "plans": plans}, out_dir=out_dir
    )


def _compile_many_here(module_path: str, plans: list[dict]) -> dict[str, Any]:
    """Runs inside compile_check's child: ``_compile_here`` of the kernel module for each plan.

    Every compile dumps into the same kernel folder, so each one starts from an empty dump folder and its ``.s`` is
    moved to ``<cwd>/<index>.s`` before the next.
    """
    # The kernel's folder is on the child's path; imported under its file name, as the worker would load it.
    compile_here = importlib.import_module(Path(module_path).stem)._compile_here
    dump_dir = Path(os.environ["FLYDSL_DUMP_DIR"])
    results = []
    for i, plan in enumerate(plans):
        shutil.rmtree(dump_dir, ignore_errors=True)
        try:
            facts = compile_here(plan, export=False)
        except Exception as exc:  # noqa: BLE001 - one failed plan is a result, not a crash of the batch
            facts = {"ok": False, "reason": f"{type(exc).__name__}: {exc}", "plan": plan}
        if facts.get("asm_path"):
            kept = Path(os.getcwd()) / f"{i}.s"
            shutil.move(facts["asm_path"], kept)
            facts["asm_path"] = str(kept)
        results.append(facts)
    return {"ok": all(r["ok"] for r in results), "results": results}
