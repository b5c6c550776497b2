"""Packaging: one installed namespace mapped onto the repo's top-level folders, no bare top-level packages."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import fly_lightning

ROOT = Path(fly_lightning.__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "name, folder", [("kernels", "kernels"), ("quant", "quant"), ("callbacks", "callbacks"), ("recipes", "recipes")]
)
def test_subpackages_resolve_to_repo_folders(name, folder):
    mod = importlib.import_module(f"fly_lightning.{name}")
    assert Path(mod.__file__).resolve().parent == ROOT / folder


def _run(code: str, cwd: Path) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_no_bare_top_level_packages_installed(tmp_path):
    code = (
        "import importlib.util as u; print([n for n in ('kernels', 'callbacks', 'recipes', 'quant') if u.find_spec(n)])"
    )
    assert _run(code, tmp_path) == "[]"


def test_transformers_does_not_mistake_our_kernels_for_hf_kernels():
    pytest.importorskip("transformers")
    # from the repo root, where the folder `kernels/` sits on sys.path[0]
    code = "from transformers.utils import is_kernels_available; print(is_kernels_available())"
    assert _run(code, ROOT) == "False"


def test_distribution_metadata():
    from importlib.metadata import distribution

    dist = distribution("fly-lightning")
    assert dist.version == fly_lightning.__version__
    import re

    # requirement names (before any version or marker), so "torch" is not found inside "torchao"
    names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in dist.requires or [] if "extra ==" not in r}
    assert {"torch", "lightning", "torchao", "safetensors", "rich"} <= names, names
