"""``fly-lightning``: the tuning database commands, the support matrix, the manifest diff and pre-tuning."""

import subprocess

import pytest
import torch

from fly_lightning import cli, support, tuning
from fly_lightning.callbacks import manifest_diff


@pytest.fixture
def db(tmp_path):
    d = tuning.TuningDB(tmp_path / "t.json")
    here = tuning.environment_key(torch.device("cpu"))
    d.put(here, "grouped_mm", "8192x2048 bfloat16 c | None", "triton", {"triton": 0.5, "aten": 0.6})
    d.put("old GPU | torch 2.0", "rms_norm", "16x8 float32 c | 1e-06", "aten", {"aten": 0.01})
    return d


def test_show_lists_this_machine_first(db, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["tuning", "show", "--db", str(db.path)]) == 0
    out = capsys.readouterr().out
    assert "2 entries" in out and out.index("(this machine)") < out.index("old GPU")
    assert "grouped_mm" in out and "triton" in out and "aten 0.6 triton 0.5" in out


def test_prune_drops_other_environments_and_pin_holds(db, capsys):
    cli.main(["tuning", "pin", "rms_norm", "16x8 float32 c | 1e-06", "triton", "--env", "old GPU | torch 2.0",
              "--db", str(db.path)])  # fmt: skip
    assert cli.main(["tuning", "prune", "--db", str(db.path)]) == 0
    assert "dropped 0 entries" in capsys.readouterr().out  # the old environment's only entry is pinned
    cli.main(["tuning", "pin", "rms_norm", "16x8 float32 c | 1e-06", "--unpin", "--env", "old GPU | torch 2.0",
              "--db", str(db.path)])  # fmt: skip
    cli.main(["tuning", "prune", "--db", str(db.path)])
    assert [op for _, op, _, _ in tuning.TuningDB(db.path).entries()] == ["grouped_mm"]
    cli.main(["tuning", "prune", "--all", "--db", str(db.path)])
    assert list(tuning.TuningDB(db.path).entries()) == []


def test_support_markdown_is_the_readme_matrix(capsys):
    assert cli.main(["support", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == support.markdown()


def test_diff_is_the_manifest_diff(monkeypatch):
    seen = []
    monkeypatch.setattr(manifest_diff, "main", lambda argv: seen.append(argv) or 1)
    assert cli.main(["diff", "a.json", "b.json"]) == 1 and seen == [["a.json", "b.json"]]


def test_tune_runs_the_recipe_with_measured_selection(db, monkeypatch, capsys):
    calls = []

    def fake_call(cmd, env):
        calls.append((cmd, env))
        tuning.TuningDB(env["FLY_LIGHTNING_TUNING_DB"]).put("cpu", "swiglu", "k", "triton", {"triton": 1.0})
        return 0

    monkeypatch.setattr(subprocess, "call", fake_call)
    monkeypatch.delenv("FLY_LIGHTNING_TUNING_BUDGET_S", raising=False)
    assert cli.main(["tune", "--steps", "1", "--db", str(db.path), "--model.hidden_size", "64"]) == 0
    ((cmd, env),) = calls
    assert env["FLY_LIGHTNING_SELECT"] == "measure" and cmd[-2:] == ["--model.hidden_size", "64"]
    assert env["FLY_LIGHTNING_TUNING_BUDGET_S"] == "inf"  # a training run's budget would stop a pre-tune part-way
    assert "--trainer.max_steps=1" in cmd
    assert "1 shape(s) tuned" in capsys.readouterr().out


def test_unknown_arguments_are_errors():
    with pytest.raises(SystemExit):
        cli.main(["tuning", "show", "--bogus"])


def test_tune_a_transformers_model_stores_its_shapes(db, tmp_path, capsys):
    """The real child process: a tiny Qwen3-MoE config, swapped and run under measured selection on CPU; its shapes
    land in the database, and a second tune of the same shapes adds none (the file answers)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    cfg.save_pretrained(tmp_path / "model")
    argv = ["tune", "--db", str(db.path), "--hf-config", str(tmp_path / "model"), "--batch-size", "2"]
    argv += ["--seq-len", "8", "--steps", "1", "--precision", "32-true"]
    assert cli.main(argv) == 0
    ops = {op for _, op, _, _ in db.entries()}
    assert {"rms_norm", "moe_route"} <= ops, ops
    assert "0 shape(s)" not in capsys.readouterr().out
    assert cli.main(argv) == 0
    assert "0 shape(s) tuned" in capsys.readouterr().out


def test_tune_a_transformers_model_needs_the_run_shape(db):
    with pytest.raises(SystemExit, match="--batch-size and --seq-len"):
        cli.main(["tune", "--db", str(db.path), "--hf-config", "x"])


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"format": "fly-lightning tuning db", "version": 1, "environments": {', "Expecting"),
        ('{"format": "fly-lightning tuning db", "version": 1, "environments": {"cpu": []}}', "malformed entries"),
        (
            '{"format": "fly-lightning tuning db", "version": 1, "environments": {"cpu": {"op": {"k": {}}}}}',
            "malformed",
        ),
    ],
)
def test_show_reports_a_bad_database_and_leaves_it_where_it_is(tmp_path, capsys, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert cli.main(["tuning", "show", "--db", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"fly-lightning: {path}" in err and match in err and "Traceback" not in err
    assert path.read_text() == content and sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]
    assert cli.main(["tuning", "show", "--db", str(tmp_path)]) == 2  # a directory
    assert "cannot be read" in capsys.readouterr().err


def test_pin_refuses_unknown_ops_and_backends(db):
    with pytest.raises(SystemExit, match="unknown op 'no_such_op'"):
        cli.main(["tuning", "pin", "no_such_op", "k", "triton", "--db", str(db.path)])
    with pytest.raises(SystemExit, match="rms_norm has no 'trition' backend"):
        cli.main(["tuning", "pin", "rms_norm", "k", "trition", "--db", str(db.path)])
    assert len(list(tuning.TuningDB(db.path).entries())) == 2  # nothing written


def test_tune_refuses_a_missing_model_and_says_when_the_run_failed(db, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit, match="no such directory or config.json"):
        cli.main(["tune", "--hf-config", str(tmp_path / "nope"), "--batch-size=1", "--seq-len=8", "--db", str(db.path)])
    monkeypatch.setattr(subprocess, "call", lambda cmd, env: 3)
    assert cli.main(["tune", "--steps", "1", "--db", str(db.path)]) == 3
    assert "tuning run failed (exit 3)" in capsys.readouterr().out
