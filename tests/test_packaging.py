"""Packaging: one installed namespace in one folder, and no bare top-level package, installed or in the checkout."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import fly_lightning

ROOT = Path(fly_lightning.__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["kernels", "quant", "callbacks", "recipes"])
def test_subpackages_live_in_the_package_folder(name):
    mod = importlib.import_module(f"fly_lightning.{name}")
    assert Path(mod.__file__).resolve().parent == ROOT / "fly_lightning" / name
    assert not (ROOT / name).exists()  # a top-level folder of that name would shadow packages from the repo root


def _run(code: str, cwd: Path) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("where", ["elsewhere", "repo root"])
def test_no_bare_top_level_packages(tmp_path, where):
    """Neither installed nor importable from the checkout's root (``python -m ...`` puts the cwd on sys.path: the
    recipe re-executes itself that way, and transformers imports a ``kernels`` it finds)."""
    code = (
        "import importlib.util as u; "
        "print([s.origin for n in ('kernels', 'callbacks', 'recipes', 'quant') if (s := u.find_spec(n))])"
    )
    found = eval(_run(code, tmp_path if where == "elsewhere" else ROOT))  # a list of paths, printed by us
    # another distribution may install one (Hugging Face's `kernels`): none may be a folder of this checkout
    assert all(Path(origin).resolve().parents[1] != ROOT for origin in found), found


def test_transformers_builds_a_model_from_the_repo_root():
    """transformers (5.25+) imports Hugging Face's ``kernels`` when it finds one: from the checkout's root a folder of
    ours by that name was found first and the import failed (``cannot import name 'CUDAProperties'``)."""
    pytest.importorskip("transformers")
    code = (
        "import transformers as t; "
        "cfg = t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, "
        "num_attention_heads=2, num_key_value_heads=1); "
        "print(type(t.AutoModelForCausalLM.from_config(cfg)).__name__)"
    )
    assert _run(code, ROOT) == "LlamaForCausalLM"
