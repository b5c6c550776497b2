"""``fly-lightning``: the command line around dispatch.

fly-lightning support                    # the support matrix, with what this machine can run
fly-lightning diff A.json B.json         # which op/shape changed backend between two dispatch manifests
fly-lightning tune [fly-finetune args]   # pre-tune: a short recipe run under select="measure", winners kept
fly-lightning tune --hf-config DIR --batch-size B --seq-len S   # pre-tune a transformers model's shapes
fly-lightning tuning show [--op OP]      # the tuning database
fly-lightning tuning prune [--all]       # drop entries of other environments (or all unpinned ones)
fly-lightning tuning pin OP KEY BACKEND  # pin a backend for one shape key (--unpin to release)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

import torch

from fly_lightning import tuning

PROG = "fly-lightning"


def _current_env() -> str:
    return tuning.environment_key(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def _db(path: str | None, read_only: bool = False) -> tuning.TuningDB:
    """The database named, else the active one; ``read_only``: a bad file is an error, never moved aside."""
    if not path:
        db = tuning.active_db()
        if db is None:
            raise SystemExit(f"{PROG}: the tuning database is off (FLY_LIGHTNING_TUNING_DB=off)")
        path = db.path
    return tuning.TuningDB(path, read_only=read_only)


def _show(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    db = _db(args.db, read_only=True)
    current = _current_env()
    rows = [e for e in db.entries() if args.op is None or e[1] == args.op]  # a bad file: main reports it
    console = Console()
    console.print(f"[bold]{db.path}[/]: {len(rows)} entries; this machine: {current}")
    envs = sorted({env for env, *_ in rows}, key=lambda e: e != current)
    for env in envs:
        table = Table(title=("(this machine) " if env == current else "") + env, title_justify="left")
        for col in ("op", "shape key", "backend", "ms"):
            table.add_column(col, overflow="fold")
        for _, op, key, entry in sorted(r for r in rows if r[0] == env):
            timings = " ".join(f"{b} {t:.3g}" for b, t in sorted(entry.get("timings_ms", {}).items()))
            pin = " (pinned)" if entry.get("pinned") else ""
            table.add_row(op, key, f"{entry['backend']}{pin}", timings or "-")
        console.print(table)
    return 0


def _prune(args: argparse.Namespace) -> int:
    db = _db(args.db)
    keep = None if args.all else _current_env()
    n = db.prune(keep_env=keep, op=args.op)
    print(f"{PROG}: dropped {n} entries" + ("" if args.all else " of other environments") + " (pinned ones kept)")
    return 0


def _pin(args: argparse.Namespace) -> int:
    from fly_lightning.registry import OPS

    if args.op not in OPS:
        raise SystemExit(f"{PROG} tuning pin: unknown op {args.op!r}; ops: {', '.join(sorted(OPS))}")
    if not args.unpin and args.backend not in OPS[args.op].impls:
        known = ", ".join(OPS[args.op].impls)
        raise SystemExit(f"{PROG} tuning pin: {args.op} has no {args.backend!r} backend; its backends: {known}")
    _db(args.db).pin(args.env or _current_env(), args.op, args.key, None if args.unpin else args.backend)
    return 0


def _support(args: argparse.Namespace) -> int:
    from fly_lightning import support

    sys.argv = [PROG] + (["--markdown"] if args.markdown else [])
    support.main()
    return 0


def _diff(args: argparse.Namespace) -> int:
    from fly_lightning.callbacks import manifest_diff

    return manifest_diff.main([args.a, args.b])


def _tune(args: argparse.Namespace, extra: list[str]) -> int:
    """A short run in a child process with measured selection on: every shape it meets is timed once and written
    to the database; a later run with ``FLY_LIGHTNING_SELECT=measure`` reads them instead of timing. The run is the
    recipe's (other arguments go to ``fly-finetune fit``) or, with ``--hf-config``, a transformers model's."""
    db = _db(args.db)
    before = {(e, o, k) for e, o, k, _ in db.entries()}
    env = dict(os.environ, FLY_LIGHTNING_SELECT="measure", FLY_LIGHTNING_TUNING_DB=str(db.path))
    # the default budget bounds what a training run spends measuring; a pre-tune run is there to measure everything
    env.setdefault("FLY_LIGHTNING_TUNING_BUDGET_S", "inf")
    if args.hf_config:
        if args.batch_size is None or args.seq_len is None:
            raise SystemExit(f"{PROG} tune: --hf-config needs --batch-size and --seq-len (the training run's)")
        if not os.path.exists(args.hf_config):
            raise SystemExit(f"{PROG} tune: --hf-config {args.hf_config}: no such directory or config.json")
        if extra:
            raise SystemExit(f"{PROG} tune: unrecognized arguments with --hf-config: {' '.join(extra)}")
        cmd = [sys.executable, "-m", "fly_lightning.pretune", args.hf_config, f"--batch-size={args.batch_size}",
               f"--seq-len={args.seq_len}", f"--steps={args.steps}", f"--precision={args.precision}"]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "fly_lightning.recipes.moe_finetune", "fit", f"--trainer.max_steps={args.steps}"]
        cmd += extra
    rc = subprocess.call(cmd, env=env)
    added = [(e, o, k) for e, o, k, _ in db.entries() if (e, o, k) not in before]
    if rc != 0:
        print(f"{PROG}: tuning run failed (exit {rc}); {len(added)} shape(s) tuned into {db.path} before it stopped")
        return rc
    print(f"{PROG}: {len(added)} shape(s) tuned into {db.path}; train with FLY_LIGHTNING_SELECT=measure to use them")
    return rc


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Dispatch tools: support matrix, manifests, tuning database.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("support", help="print the support matrix and what this machine can run")
    s.add_argument("--markdown", action="store_true", help="markdown, as in the README")
    s = sub.add_parser("diff", help="what changed backend between two dispatch manifests (exit 1 if anything did)")
    s.add_argument("a", help="the earlier run's dispatch_manifest.json")
    s.add_argument("b", help="the later run's dispatch_manifest.json")
    s = sub.add_parser("tune", help="pre-tune the recipe's shapes (other arguments go to fly-finetune fit)")
    s.add_argument("--steps", type=int, default=2, help="training steps to run (default 2)")
    s.add_argument("--db", help="database file (default: FLY_LIGHTNING_TUNING_DB or the user cache)")
    s.add_argument("--hf-config", metavar="DIR", help="a transformers model (directory or config.json) instead")
    s.add_argument("--batch-size", type=int, help="with --hf-config: the training run's batch size")
    s.add_argument("--seq-len", type=int, help="with --hf-config: the training run's sequence length")
    s.add_argument("--precision", default="bf16-true", choices=("bf16-true", "bf16-mixed", "32-true"))
    t = sub.add_parser("tuning", help="show, prune or pin the tuning database")
    tsub = t.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, help_ in (("show", "list the entries"), ("prune", "drop unpinned entries"), ("pin", "pin a backend")):
        a = tsub.add_parser(name, help=help_)
        a.add_argument("--db", help="database file (default: FLY_LIGHTNING_TUNING_DB or the user cache)")
        if name in ("show", "prune"):
            a.add_argument("--op", help="only this op")
    tsub.choices["prune"].add_argument("--all", action="store_true", help="every environment, this one too")
    pin = tsub.choices["pin"]
    pin.add_argument("op")
    pin.add_argument("key", help="the shape key, as `tuning show` prints it")
    pin.add_argument("backend", nargs="?", default="aten")
    pin.add_argument("--env", help="environment key (default: this machine's)")
    pin.add_argument("--unpin", action="store_true", help="release the pin instead")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = parser().parse_known_args(argv)
    if args.command != "tune" and extra:
        parser().error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "tune":
            return _tune(args, extra)
        if args.command == "tuning":
            return {"show": _show, "prune": _prune, "pin": _pin}[args.action](args)
        return {"support": _support, "diff": _diff}[args.command](args)
    except (OSError, ValueError) as exc:  # a database or path that cannot be used: one line, not a traceback
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
