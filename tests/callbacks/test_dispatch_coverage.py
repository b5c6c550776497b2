"""DispatchCoverage: calls counted from the fit's start, scalars on Lightning's logging steps, manifest and diff."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from unittest import mock

import pytest
import torch

import fly_lightning
from fly_lightning._files import write_text_atomic
from fly_lightning.callbacks import DispatchCoverage, _common, diff_manifests, load_manifest, validate_manifest
from fly_lightning.callbacks.manifest import canonical_signature, merge_sections
from fly_lightning.callbacks.manifest_diff import main as diff_main
from fly_lightning.registry import OPS

# the Tiny model's RMSNorm: x and weight (shape, strides, dtype, device), eps, offset, cast
SIG = "((4x8x32, (256, 32, 1), float32, cpu), (32, (1), float32, cpu), 1.1920928955078125e-07, 0.0, False)"


def test_fit_logs_coverage_and_writes_manifest(tiny, tmp_path, capsys):
    w = torch.ones(32)
    for _ in range(3):  # decisions from before the fit: one with the fit's shape, one never used in it
        fly_lightning.rms_norm(torch.randn(4, 8, 32), w)
    fly_lightning.rms_norm(torch.randn(5, 32), w)
    cb = DispatchCoverage()
    trainer, _ = tiny.fit(tmp_path, [cb], steps=4, log_every_n_steps=2)

    # scalars on Lightning's logging steps only, counted from the fit's start (4 forward calls, not 7)
    rows = [r for r in tiny.rows(trainer) if "DispatchCoverage/rms_norm/calls" in r]
    assert [int(r["step"]) for r in rows] == [1, 3]
    assert [float(r["DispatchCoverage/rms_norm/calls"]) for r in rows] == [2.0, 4.0]
    last = rows[-1]
    assert float(last["DispatchCoverage/rms_norm/share_triton"]) == 1.0
    assert float(last["DispatchCoverage/rms_norm/share_aten"]) == 0.0
    assert float(last["DispatchCoverage/rms_norm/specialised_share"]) == 1.0
    assert float(last["DispatchCoverage/rms_norm/fallback_calls"]) == 0.0
    assert float(last["DispatchCoverage/rms_norm/signatures"]) == 1.0
    assert float(last["DispatchCoverage/rms_norm/new_signatures"]) == 0.0  # decided before the fit
    assert float(last["DispatchCoverage/rms_norm/cold_start_s"]) == 0.0
    assert float(last["DispatchCoverage/rms_norm/steady_calls"]) == 4.0

    # the manifest: in the log dir, valid, the fit's signature only, stable bytes
    assert cb.manifest_path == tmp_path / "lightning_logs" / "version_0" / "dispatch_manifest.json"
    text = cb.manifest_path.read_text()
    manifest = load_manifest(cb.manifest_path)
    assert text == json.dumps(manifest, sort_keys=True, indent=2) + "\n"
    op = manifest["ops"]["rms_norm"]
    assert op["calls"] == 4 and op["by_backend"] == {"triton": 4} and op["backends"] == sorted(OPS["rms_norm"].impls)
    assert list(op["signatures"]) == [SIG]
    sig = op["signatures"][SIG]
    assert sig["backend"] == "triton" and sig["shape"] == "4x8x32, 32" and sig["dtype"] == "float32"
    assert manifest["cold_start"] == {}
    assert manifest["run"]["world_size"] == 1 and manifest["run"]["global_step"] == 4
    for name in fly_lightning.OPS:  # every registered operator is listed, called or not
        assert name in manifest["ops"]

    out = capsys.readouterr().out
    assert "dispatch coverage" in out and "triton 100%" in out and "dispatch_manifest.json" in out


def test_new_signatures_and_cold_start(tiny, tmp_path):
    cb = DispatchCoverage(dirpath=tmp_path / "out", print_table=False)
    trainer, _ = tiny.fit(tmp_path, [cb], steps=2, log_every_n_steps=1)
    row = [r for r in tiny.rows(trainer) if "DispatchCoverage/rms_norm/calls" in r][-1]
    assert float(row["DispatchCoverage/rms_norm/new_signatures"]) == 1.0
    assert float(row["DispatchCoverage/rms_norm/cold_start_s"]) > 0.0
    assert float(row["DispatchCoverage/rms_norm/steady_calls"]) == float(row["DispatchCoverage/rms_norm/calls"]) - 1
    assert cb.manifest_path == tmp_path / "out" / "dispatch_manifest.json"
    cold = cb.manifest["cold_start"]["rms_norm"][SIG]
    assert cold["backend"] == "triton" and cold["first_call_s"] > 0 and cold["first_seen_step"] == 0


def test_manifest_diff_shows_the_backend_change(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich folds cells to the width of a non-terminal (80)
    a, b = DispatchCoverage(dirpath=tmp_path / "a"), DispatchCoverage(dirpath=tmp_path / "b")
    tiny.fit(tmp_path / "run_a", [a], steps=2)
    with fly_lightning.dispatch_config(disabled_ops={"rms_norm"}):
        tiny.fit(tmp_path / "run_b", [b], steps=2)
    out = capsys.readouterr().out
    assert "op disabled by policy" in out and "4x8x32, 32" in out  # the fallback reason with its shape

    sig_b = b.manifest["ops"]["rms_norm"]["signatures"][SIG]
    assert sig_b["backend"] == "aten" and sig_b["rejected"]["triton"] == "op disabled by policy"
    assert b.manifest["ops"]["rms_norm"]["fallback_calls"] == 2
    diff = diff_manifests(a.manifest_path, b.manifest_path)
    assert diff.changed == [("rms_norm", SIG, "triton", "aten")] and not diff.added and not diff.removed
    assert not diff_manifests(a.manifest_path, a.manifest_path)

    assert diff_main([str(a.manifest_path), str(b.manifest_path)]) == 1
    assert f"rms_norm  {SIG}  triton -> aten" in capsys.readouterr().out  # piped: one line per signature
    assert diff_main([str(a.manifest_path), str(a.manifest_path)]) == 0
    assert "no backend changes" in capsys.readouterr().out
    assert diff_main([str(a.manifest_path), str(tmp_path / "missing.json")]) == 2

    cli = subprocess.run(
        [sys.executable, "-m", "fly_lightning.callbacks.manifest_diff", str(a.manifest_path), str(b.manifest_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 1, cli.stderr
    assert f"rms_norm  {SIG}  triton -> aten" in cli.stdout


def test_manifest_diff_table_on_a_terminal_and_strings_are_not_markup():
    from rich.console import Console

    from fly_lightning.callbacks.manifest import ManifestDiff

    sig = "[bold]x[/bold] 4x8, [/y]"  # from a JSON file: printed as written, never parsed as markup
    diff = ManifestDiff(changed=[("rms_norm", sig, "triton", "aten")], added=[("topk", "2x4", "triton")])
    term = Console(force_terminal=True, width=200, record=True)
    diff.print(term)
    text = term.export_text()
    row = next(line for line in text.splitlines() if "changed backend" in line)  # one table row per signature
    assert sig in row and row.index("triton") < row.index("aten"), text
    assert "only in b" in text and "topk" in text
    piped = Console(force_terminal=False, width=40, record=True)
    diff.print(piped)
    assert f"rms_norm  {sig}  triton -> aten" in piped.export_text()  # not folded at the console width


def _manifest() -> dict:
    sig = {
        "backend": "triton",
        "by_backend": {"triton": 3},
        "calls": 3,
        "shape": "2x4",
        "dtype": "float32",
        "rejected": {},
    }
    op = {
        "backends": ["aten", "triton"],
        "calls": 3,
        "by_backend": {"triton": 3},
        "fallback_calls": 0,
        "specialised_share": 1.0,
        "signatures": {"(2x4)": sig},
    }
    return {"format": "fly-lightning dispatch manifest", "version": 1, "ops": {"op": op}, "cold_start": {}, "run": {}}


@pytest.mark.parametrize(
    "breakage, where",
    [
        (lambda m: m.pop("format"), "format"),
        (lambda m: m.update(version=2), "version"),
        (lambda m: m.pop("run"), "run"),
        (lambda m: m["ops"]["op"].update(calls=4), "ops.op.calls"),
        (lambda m: m["ops"]["op"].update(specialised_share=1.5), "specialised_share"),
        (lambda m: m["ops"]["op"]["signatures"]["(2x4)"].update(calls=2), "signatures['(2x4)'].calls"),
        (lambda m: m["ops"]["op"]["signatures"]["(2x4)"].update(backend="aten"), "backend"),
        (lambda m: m["ops"]["op"]["signatures"]["(2x4)"]["by_backend"].update(triton=-1), "by_backend"),
        (lambda m: m["ops"]["op"]["signatures"]["(2x4)"].pop("shape"), "shape"),
        (lambda m: m["ops"]["op"].update(calls=True), "ops.op.calls"),
    ],
)
def test_validate_manifest_names_the_broken_field(breakage, where):
    validate_manifest(_manifest())
    broken = copy.deepcopy(_manifest())
    breakage(broken)
    with pytest.raises(ValueError, match="dispatch manifest: .*" + re.escape(where)):
        validate_manifest(broken)


def test_merge_over_ranks():
    def rank(by_backend: dict[str, int]) -> dict:
        sig = {"by_backend": by_backend, "shape": "2x4", "dtype": "float32", "rejected": {"flydsl": "no kernel"}}
        return {"ops": {"op": {"backends": ["aten", "triton"], "signatures": {"(2x4)": sig}}}, "cold_start": {}}

    merged = merge_sections([rank({"triton": 3}), rank({"triton": 2, "aten": 1})])
    op = merged["ops"]["op"]
    assert op["calls"] == 6 and op["by_backend"] == {"triton": 5, "aten": 1}
    assert op["specialised_share"] == pytest.approx(5 / 6)
    assert op["signatures"]["(2x4)"]["backend"] == "triton"
    assert op["fallback_calls"] == 1  # the one ATen call, though the signature's majority backend is Triton


def test_fallback_calls_count_every_aten_call_over_ranks():
    # ranks that measured differently: rank 0 kept ATen (Triton slower there), rank 1 took Triton
    def rank(by_backend: dict[str, int], rejected: dict[str, str]) -> dict:
        sig = {"by_backend": by_backend, "shape": "2x4", "dtype": "float32", "rejected": rejected}
        return {"ops": {"op": {"backends": ["aten", "triton"], "signatures": {"(2x4)": sig}}}, "cold_start": {}}

    slower = {"triton": "slower when measured (0.1 ms)"}
    for calls, expected in (((3, 2), 3), ((2, 3), 2)):
        merged = merge_sections([rank({"aten": calls[0]}, slower), rank({"triton": calls[1]}, {"aten": "slower"})])
        op = merged["ops"]["op"]
        assert op["fallback_calls"] == expected
        assert op["fallback_calls"] + op["specialised_share"] * op["calls"] == pytest.approx(op["calls"])


def test_canonical_signature_is_readable_and_stable():
    sig = (torch.Size([2, 3]), (3, 1), torch.bfloat16, torch.device("cpu"), None, True, frozenset({"b", "a"}))
    assert canonical_signature(sig) == "(2x3, (3, 1), bfloat16, cpu, None, True, {a, b})"
    assert canonical_signature(torch.Size([])) == "scalar"


def test_manifest_sums_over_ranks(tiny, tmp_path):
    cb = DispatchCoverage(print_table=False)
    with mock.patch.object(_common, "gather", side_effect=lambda obj: [obj, copy.deepcopy(obj)]):
        tiny.fit(tmp_path, [cb], steps=2)
    op = cb.manifest["ops"]["rms_norm"]
    assert cb.manifest["run"]["world_size"] == 2
    assert op["calls"] == 4 and op["signatures"][SIG]["by_backend"] == {"triton": 4}


def test_manifest_records_the_policy_a_strategy_set(tiny, tmp_path):
    # the strategy restores the previous policy in teardown, which Lightning runs before on_fit_end
    from fly_lightning.strategies import FlySingleDeviceStrategy

    cb = DispatchCoverage(print_table=False)
    strategy = FlySingleDeviceStrategy(device="cpu", dispatch=fly_lightning.DispatchConfig(disabled_ops={"rms_norm"}))
    tiny.fit(tmp_path, [cb], steps=2, strategy=strategy)
    assert "disabled_ops=frozenset({'rms_norm'})" in cb.manifest["run"]["policy"]
    assert cb.manifest["ops"]["rms_norm"]["by_backend"] == {"aten": cb.manifest["ops"]["rms_norm"]["calls"]}


def test_one_table_under_a_fly_strategy_with_reasons_below_it(tiny, tmp_path, capsys, monkeypatch):
    # the strategy's per-shape dispatch table repeated the coverage table: the callback stands in for it during the
    # fit, and fallback reasons are lines under the table (no column folds a word)
    monkeypatch.setenv("COLUMNS", "80")
    cb = DispatchCoverage()
    with fly_lightning.dispatch_config(disabled_ops={"rms_norm"}):
        trainer, _ = tiny.fit(tmp_path, [cb], steps=2, strategy="flydsl")
    out = capsys.readouterr().out
    assert out.count("dispatch coverage") == 1
    assert "why not a faster backend" not in out  # the strategy's table
    assert trainer.strategy.fly_report is True  # given back after the fit
    assert "rms_norm on aten:" in out and "not called:" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_outputs_that_cannot_be_written_warn_and_the_fit_completes(tiny, tmp_path):
    """The run is over when the files are written: a full disk or a bad directory is reported, never raised (a raise
    there would also skip every later on_fit_end, the model's export included)."""
    from fly_lightning.callbacks import OperatorTime

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for cb in (DispatchCoverage(dirpath=blocker / "out"), OperatorTime(every_n_steps=1, first_step=0, plot=False,
                                                                       dirpath=blocker / "out")):  # fmt: skip
        with pytest.warns(UserWarning, match="not written"):
            trainer, _ = tiny.fit(tmp_path / type(cb).__name__, [cb], steps=2)
        assert trainer.state.finished


def test_fast_dev_run_writes_no_files(tiny, tmp_path, monkeypatch):
    from fly_lightning.callbacks import OperatorTime

    monkeypatch.chdir(tmp_path)
    tiny.fit(tmp_path / "logs", [DispatchCoverage(), OperatorTime(every_n_steps=1, first_step=0, plot=False)],
             fast_dev_run=True)  # fmt: skip
    assert not list(tmp_path.rglob("*.json"))


def test_a_manifest_write_that_fails_keeps_the_previous_file(tmp_path, monkeypatch):
    """Written through a temporary file and a rename: the previous run's manifest (what ``diff`` compares against)
    survives a write that fails half-way."""
    path = tmp_path / "m.txt"
    write_text_atomic(path, "previous")
    real = type(path).write_text

    def half(self, text):
        real(self, text[:3])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(path), "write_text", half)
    with pytest.raises(OSError):
        write_text_atomic(path, "the new contents")
    monkeypatch.undo()
    assert path.read_text() == "previous" and [p.name for p in tmp_path.iterdir()] == ["m.txt"]
