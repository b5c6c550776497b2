"""Writing files that other processes read (the tuning database, dispatch manifests, operator times)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``text`` to ``path`` through a temporary file in its directory and one rename: a reader (or a crash, or a full
    disk half-way) sees the old file or the new one, never a truncated one; no temporary file is left behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
