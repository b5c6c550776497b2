"""The MoE fine-tuning recipe: every model family swaps and dispatches, fits through the CLI entry, fails clearly.

``main()`` re-executes itself with ``TRITON_INTERPRET=1`` on a machine without a GPU when the variable is unset;
tests/conftest.py sets it, so in-process calls run LightningCLI directly (``os.execv`` is patched to fail, so a
regression could never replace the pytest process). The re-exec itself is checked in a subprocess with a timeout.
"""

from __future__ import annotations

import csv
import importlib.util
import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import fly_lightning
from fly_lightning import DISPATCH_LOG, FlyMoE, FlyRMSNorm
from fly_lightning.callbacks import DispatchCoverage, OperatorTime, load_manifest
from fly_lightning.recipes import moe_finetune
from fly_lightning.recipes.data import LMData
from fly_lightning.recipes.moe_finetune import (
    ARCHS,
    FinetuneCLI,
    MoECausalLM,
    StepProgressBar,
    build_hf_model,
    main,
    trainer_defaults,
)

VOCAB = 32
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    num_experts=4,
    experts_per_token=2,
    expert_intermediate_size=16,
    max_seq_len=32,
)
FIT_STEPS = 8


def _hf_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and not isinstance(m, FlyRMSNorm)]


def _hf_moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]


@pytest.fixture
def no_reexec(monkeypatch):
    """In-process ``main()``: the interpreter is on, and a re-exec would fail the test instead of replacing pytest."""
    assert os.environ.get("TRITON_INTERPRET") == "1"

    def refuse(*args, **kwargs):
        raise AssertionError(f"main() tried to re-exec itself: {args}")

    monkeypatch.setattr(os, "execv", refuse)
    monkeypatch.setattr(sys, "argv", ["fly-finetune"])  # not pytest's arguments: main() gets its own


@pytest.fixture
def record_cli(monkeypatch) -> list[FinetuneCLI]:
    """The LightningCLI objects ``main()`` creates (``main`` returns nothing: it is a console entry point)."""
    made: list[FinetuneCLI] = []

    class Recording(FinetuneCLI):
        def __init__(self, *args, **kwargs):
            made.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(moe_finetune, "FinetuneCLI", Recording)
    return made


# --- the model -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_swap_and_dispatch(arch):
    torch.manual_seed(0)
    module = MoECausalLM(arch=arch, **TINY)
    tokens = torch.randint(0, VOCAB, (2, 12))
    n_norms, n_moe = len(_hf_norms(module)), len(_hf_moe_blocks(module))
    assert n_moe == TINY["num_layers"] and n_norms >= 2 * TINY["num_layers"] + 1
    state_before = {k: v.data_ptr() for k, v in module.state_dict().items()}

    with torch.no_grad():
        loss_hf = module(tokens)
    assert loss_hf.ndim == 0 and torch.isfinite(loss_hf)
    assert abs(loss_hf.item() - math.log(VOCAB)) < 1.0  # a fresh model is near uniform

    summary = fly_lightning.transform(module)
    swapped = sorted({m.split(":")[0] for _, _, m in summary.swapped})
    assert swapped == ["moe", "rms_norm"]
    assert summary.left == []
    assert sum(m.startswith("rms_norm:") for _, _, m in summary.swapped) == n_norms
    assert sum(m.startswith("moe:") for _, _, m in summary.swapped) == n_moe
    # module types: nothing of the originals left, ours in their place, the same parameters under the same names
    assert _hf_norms(module) == [] and _hf_moe_blocks(module) == []
    assert sum(isinstance(m, FlyRMSNorm) for m in module.modules()) == n_norms
    assert sum(isinstance(m, FlyMoE) for m in module.modules()) == n_moe
    assert {k: v.data_ptr() for k, v in module.state_dict().items()} == state_before

    DISPATCH_LOG.reset()
    loss_fly = module(tokens)
    assert torch.isfinite(loss_fly)
    torch.testing.assert_close(loss_fly.detach(), loss_hf, rtol=1e-5, atol=1e-5)
    loss_fly.backward()
    grads = [p.grad for p in module.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)

    # the dispatch log: every swapped module called once, on the Triton kernels (interpreter) where they apply
    summary_log = DISPATCH_LOG.summary()
    assert summary_log["rms_norm"]["calls"] == n_norms
    assert summary_log["rms_norm"]["by_backend"] == {"triton": n_norms}
    assert summary_log["moe_route"]["calls"] == n_moe
    assert summary_log["moe_route"]["by_backend"] == {"triton": n_moe}
    gemm_calls = sum(summary_log.get(op, {}).get("calls", 0) for op in ("grouped_mm", "moe_grouped_mm"))
    assert gemm_calls >= n_moe  # the experts run as grouped GEMMs (fp32 here: on ATen, with the reason recorded)
    for record in DISPATCH_LOG.records():
        assert record["op"] in fly_lightning.OPS
        assert record["calls"] >= 1
        if record["backend"] == "aten":
            assert record["fallback"] and record["reason"]


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_training_tracks_the_stock_strategy_step_by_step(arch):
    # in fp32 the swapped model follows the stock one through AdamW updates (Adam's first steps amplify any gradient
    # difference, so this catches a wrong gradient that one-step checks could miss); bf16 runs diverge chaotically
    import lightning.pytorch as L

    def fit(strategy: str) -> list[float]:
        losses: list[float] = []

        class Record(L.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                losses.append(float(outputs["loss"]))

        torch.manual_seed(0)
        model = MoECausalLM(arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=8,
                            expert_intermediate_size=48, max_seq_len=64, warmup_steps=2)  # fmt: skip
        data = LMData(seq_len=33, batch_size=4, n_train=32)
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", devices=1, max_steps=6, limit_val_batches=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
        )  # fmt: skip
        trainer.fit(model, data)
        return losses

    stock, ours = fit("auto"), fit("flydsl")
    assert len(ours) == 6 and ours[-1] < ours[0]
    torch.testing.assert_close(ours, stock, rtol=0, atol=2e-5)


def test_unknown_arch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"arch must be one of .*qwen3_moe.*mixtral.*olmoe.*got 'llama'"):
        MoECausalLM(arch="llama", **TINY)
    with pytest.raises(ValueError, match="arch must be one of"):
        build_hf_model("deepseek_v3", 32, 32, 1, 2, 1, 4, 2, 16, 32)


def test_defaults_agree_and_run_observed(tmp_path, no_reexec, capsys):
    """The embedded default run: model and data vocabularies match, strategy flydsl, checkpoints and both callbacks
    on (CLI options, not hidden trainer defaults)."""
    model_defaults = inspect.signature(MoECausalLM).parameters
    data_defaults = inspect.signature(LMData).parameters
    assert model_defaults["vocab_size"].default == data_defaults["vocab_size"].default
    assert model_defaults["arch"].default in ARCHS
    assert data_defaults["seq_len"].default <= model_defaults["max_seq_len"].default
    d = trainer_defaults()
    assert d["strategy"] == "flydsl" and d["devices"] == 1
    assert d["accelerator"] == ("gpu" if torch.cuda.is_available() else "cpu")
    assert d["enable_checkpointing"] is True and "callbacks" not in d
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--print_config"])
    assert exc.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["checkpoint"]["monitor"] == "val_loss" and config["checkpoint"]["save_last"] is True
    assert config["op_time"]["first_step"] < d["max_steps"]  # the default run does profile a step
    assert config["op_time"]["plot"] is True  # no silent skip: a missing matplotlib is said at the end of fit
    assert "print_table" in config["dispatch_coverage"]


# --- fitting through the CLI entry ---------------------------------------------------------------------------------


def _fit_args(root: Path, *extra: str, steps: int = FIT_STEPS, layers: int = 1) -> list[str]:
    model = {**TINY, "num_layers": layers}
    return [
        "fit",
        *[a for k, v in model.items() for a in (f"--model.{k}", str(v))],
        "--model.lr=1e-2",
        "--model.warmup_steps=1",
        f"--data.vocab_size={VOCAB}",
        "--data.seq_len=17",
        "--data.batch_size=8",
        "--data.n_train=96",
        "--data.n_val=16",
        f"--trainer.max_steps={steps}",
        "--trainer.val_check_interval=4",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={root}",
        *extra,
    ]


def _metric(log_dir: Path, name: str) -> list[float]:
    with (log_dir / "metrics.csv").open() as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


@pytest.mark.parametrize("arch", ARCHS)
def test_cli_fit_swaps_learns_and_writes_outputs(arch, tmp_path, no_reexec, record_cli, capsys):
    main(_fit_args(tmp_path, f"--model.arch={arch}"))
    (cli,) = record_cli
    trainer, module = cli.trainer, cli.model
    assert trainer.global_step == FIT_STEPS
    assert type(trainer.strategy).__name__ == "FlySingleDeviceStrategy"
    assert module.hparams.arch == arch

    # swapped by the strategy: the summary, and the module types in the trained model
    summary = trainer.strategy.transform_summary
    assert {m.split(":")[0] for _, _, m in summary.swapped} == {"rms_norm", "moe"}
    assert summary.left == []
    assert _hf_norms(module) == [] and _hf_moe_blocks(module) == []
    assert sum(isinstance(m, FlyMoE) for m in module.modules()) == 1
    n_norms = sum(isinstance(m, FlyRMSNorm) for m in module.modules())
    assert n_norms == sum(m.startswith("rms_norm:") for _, _, m in summary.swapped)

    # it learns: training and validation loss fall from about log(vocab)
    log_dir = Path(trainer.log_dir)
    train_loss, val_loss = _metric(log_dir, "train_loss"), _metric(log_dir, "val_loss")
    assert len(train_loss) == FIT_STEPS and len(val_loss) == 2
    assert all(math.isfinite(v) for v in train_loss + val_loss)
    assert abs(train_loss[0] - math.log(VOCAB)) < 0.5
    assert train_loss[-1] < train_loss[0] - 0.3
    assert val_loss[-1] < val_loss[0]

    # the default callbacks ran and wrote their outputs into the run's log dir
    cov = next(c for c in trainer.callbacks if isinstance(c, DispatchCoverage))
    op_time = next(c for c in trainer.callbacks if isinstance(c, OperatorTime))
    assert cov.manifest_path == log_dir / "dispatch_manifest.json"
    manifest = load_manifest(cov.manifest_path)  # validates the structure
    assert set(fly_lightning.OPS) <= set(manifest["ops"])
    assert manifest["run"]["global_step"] == FIT_STEPS
    ops = manifest["ops"]
    assert ops["rms_norm"]["by_backend"] == {"triton": ops["rms_norm"]["calls"]}
    assert ops["rms_norm"]["calls"] >= FIT_STEPS * n_norms
    assert ops["moe_route"]["by_backend"] == {"triton": ops["moe_route"]["calls"]}
    assert ops["moe_route"]["calls"] >= FIT_STEPS
    assert ops["grouped_mm"]["calls"] + ops["moe_grouped_mm"]["calls"] >= FIT_STEPS

    assert op_time.json_path == log_dir / "op_time.json"
    breakdown = json.loads(op_time.json_path.read_text())
    assert len(breakdown["steps"]) == 1  # one profiled step (first_step=5) in an 8-step run
    parts = breakdown["mean"]["parts_ms"]
    assert parts["rms_norm/triton"] > 0 and parts["moe_route/triton"] > 0
    assert 0 < breakdown["mean"]["coverage"] <= 1
    if importlib.util.find_spec("matplotlib") is not None:
        assert op_time.png_path == log_dir / "op_time.png" and op_time.png_path.stat().st_size > 0
    assert f"arch: {arch}" in (log_dir / "config.yaml").read_text()
    # checkpointing is on by default: the last step and the best by validation loss
    assert (log_dir / "checkpoints" / "last.ckpt").is_file()
    assert [p.name for p in (log_dir / "checkpoints").glob("best-*.ckpt")] == [
        Path(trainer.checkpoint_callback.best_model_path).name
    ]

    # and said so on the console
    captured = capsys.readouterr()
    out = captured.out
    assert "fly-finetune: no GPU" in captured.err and "no GPU" not in out  # stdout stays for --print_config
    for title in ("fly-lightning transform", "fly-lightning dispatch", "time by operator"):
        assert title in out, title


def _pretrained_fit_args(root: Path, ckpt: Path, *data: str) -> list[str]:
    """Two steps of fine-tuning the checkpoint ``ckpt`` on ``data`` options, logging to ``root``."""
    return [
        "fit",
        f"--model.pretrained={ckpt}",
        *data,
        "--data.seq_len=9",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={root}",
    ]


def test_cli_fine_tunes_a_pretrained_checkpoint(tmp_path, no_reexec, record_cli):
    """``--model.pretrained`` with only ``--data.vocab_size`` (as the module docstring shows) must run."""
    ckpt = tmp_path / "ckpt"
    build_hf_model("mixtral", VOCAB, 32, 1, 2, 1, 4, 2, 16, 32).save_pretrained(ckpt)
    main(_pretrained_fit_args(tmp_path, ckpt, f"--data.vocab_size={VOCAB}", "--data.n_train=16", "--data.n_val=8"))
    (cli,) = record_cli
    assert cli.trainer.global_step == 2
    assert type(cli.model.model).__name__ == "MixtralForCausalLM"
    assert cli.model.model.config.vocab_size == VOCAB
    assert "vocab_size" not in cli.model.hparams  # the checkpoint decides it, not the unused argument
    # from_pretrained returns a model in eval mode: fine-tuning must train it in train mode (dropout, router jitter)
    assert all(m.training for m in cli.model.modules())
    assert {m.split(":")[0] for _, _, m in cli.trainer.strategy.transform_summary.swapped} == {"rms_norm", "moe"}
    val_loss = _metric(Path(cli.trainer.log_dir), "val_loss")
    assert val_loss and all(math.isfinite(v) for v in val_loss)


# --- invalid configurations ----------------------------------------------------------------------------------------


def _one_line_error(capsys, exc: pytest.ExceptionInfo, message: str) -> None:
    """``main()`` stopped on a configuration or data error: status 2, one line naming it, no traceback."""
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert re.search(rf"fly-finetune: error: .*{message}", err), err
    assert "Traceback" not in err


@pytest.mark.parametrize("source", ["config", "pretrained"])
def test_cli_vocab_mismatch_is_a_clear_error(source, tmp_path, no_reexec, record_cli, capsys):
    # data and model vocabularies differ: named as such, before any step (not an index or hparams-merge error)
    model_args = ["--model.arch=mixtral"]
    if source == "pretrained":
        build_hf_model("mixtral", VOCAB, 32, 1, 2, 1, 4, 2, 16, 32).save_pretrained(tmp_path / "ckpt")
        model_args = [f"--model.pretrained={tmp_path / 'ckpt'}"]
    args = _fit_args(tmp_path, *model_args)
    args[args.index(f"--data.vocab_size={VOCAB}")] = f"--data.vocab_size={2 * VOCAB}"
    message = rf"data.vocab_size={2 * VOCAB} does not match the model's vocabulary \({VOCAB}\)"
    with pytest.raises(SystemExit) as exc:
        main(args)
    _one_line_error(capsys, exc, message)
    assert record_cli[0].trainer.global_step == 0


@pytest.mark.parametrize("case", ["missing", "empty", "bad_jsonl"])
def test_cli_bad_data_is_a_one_line_error(case, tmp_path, no_reexec, record_cli, capsys):
    # found when the data is read (setup), before any step: the message names the option and the file
    path = {"missing": tmp_path / "nothing.txt", "empty": tmp_path / "empty", "bad_jsonl": tmp_path / "d.jsonl"}[case]
    if case == "empty":
        path.mkdir()
    if case == "bad_jsonl":
        path.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(SystemExit) as exc:
        main(_fit_args(tmp_path, f"--data.path={path}", "--data.vocab_size=256", "--model.vocab_size=256"))
    message = {
        "missing": "data.path: .* does not exist",
        "empty": "data.path: no documents",
        "bad_jsonl": ":2: not JSON",
    }
    _one_line_error(capsys, exc, message[case])
    assert record_cli[0].trainer.global_step == 0


def test_cli_unknown_option_exits_nonzero_naming_it(tmp_path, no_reexec, capsys):
    with pytest.raises(SystemExit) as exc:
        main(_fit_args(tmp_path, "--model.num_expertz=4"))
    assert exc.value.code not in (0, None)
    assert "num_expertz" in capsys.readouterr().err


def test_cli_unknown_arch_is_rejected_by_the_parser_with_the_choices(tmp_path, no_reexec, record_cli, capsys):
    with pytest.raises(SystemExit) as exc:
        main(_fit_args(tmp_path, "--model.arch=gpt2"))
    assert exc.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "gpt2" in err and all(arch in err for arch in ARCHS)


@pytest.mark.parametrize("case", ["missing", "file", "no_config"])
def test_cli_bad_pretrained_path_is_a_parser_error(case, tmp_path, no_reexec, capsys, monkeypatch):
    import transformers

    def no_load(*args, **kwargs):
        raise AssertionError("from_pretrained must not be reached")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    path = {"missing": tmp_path / "does" / "not" / "exist", "file": tmp_path / "f", "no_config": tmp_path / "d"}[case]
    if case == "file":
        path.write_text("x")
    if case == "no_config":
        path.mkdir()
    with pytest.raises(SystemExit) as exc:
        main(_fit_args(tmp_path, f"--model.pretrained={path}"))
    assert exc.value.code not in (0, None)
    expected = {"missing": "does not exist", "file": "is not a directory", "no_config": "no config.json"}[case]
    err = capsys.readouterr().err
    assert f"model.pretrained: {path}" in err and expected in err
    assert "Traceback" not in err and "Repo id" not in err


def test_print_config_round_trips_and_shows_the_callbacks(tmp_path, no_reexec, record_cli, capsys):
    """``fly-finetune fit --print_config > cfg.yaml && fly-finetune fit -c cfg.yaml``: stdout is the YAML alone."""
    with pytest.raises(SystemExit) as exc:
        main([*_fit_args(tmp_path, "--op_time.every_n_steps=3", "--checkpoint.save_top_k=2"), "--print_config"])
    assert exc.value.code in (0, None)
    text = capsys.readouterr().out
    config = yaml.safe_load(text)  # the interpreter banner went to stderr
    assert isinstance(config, dict) and config["op_time"]["every_n_steps"] == 3
    assert config["checkpoint"]["save_top_k"] == 2
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text)
    main(["fit", "-c", str(cfg)])
    (_, cli) = record_cli
    trainer = cli.trainer
    assert trainer.global_step == FIT_STEPS
    op_time = next(c for c in trainer.callbacks if isinstance(c, OperatorTime))
    assert op_time.every_n_steps == 3
    assert sum(isinstance(c, DispatchCoverage) for c in trainer.callbacks) == 1
    ckpt = trainer.checkpoint_callback
    assert ckpt.monitor == "val_loss" and ckpt.save_top_k == 2
    assert Path(ckpt.last_model_path).name == "last.ckpt" and Path(ckpt.best_model_path).name.startswith("best-")


@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_cli_evaluation_subcommands_run(subcommand, tmp_path, no_reexec, record_cli):
    args = _fit_args(tmp_path)
    args[0] = subcommand
    main(args)
    (cli,) = record_cli
    if subcommand == "predict":  # greedy next tokens, one [batch, seq_len] tensor per validation batch
        preds = cli.trainer.predict_loop.predictions
        assert [p.shape for p in preds] == [(8, 17), (8, 17)]
        assert all(int(p.min()) >= 0 and int(p.max()) < VOCAB for p in preds)
        return
    metric = {"validate": "val_loss", "test": "test_loss"}[subcommand]
    assert math.isfinite(float(cli.trainer.callback_metrics[metric]))


def test_cli_checkpointing_can_be_turned_off(tmp_path, no_reexec, record_cli):
    main(_fit_args(tmp_path, "--trainer.enable_checkpointing=false", steps=2))
    (cli,) = record_cli
    assert cli.trainer.checkpoint_callback is None
    assert not list(tmp_path.rglob("*.ckpt"))


def test_progress_bar_counts_steps_when_only_max_steps_bounds_the_run(tmp_path):
    import lightning.pytorch as L

    seen: list[str] = []

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(trainer.progress_bar_callback._get_train_description(trainer.current_epoch))

    model = MoECausalLM(**TINY)
    data = LMData(vocab_size=VOCAB, seq_len=9, batch_size=4, n_train=40, n_val=4)  # 10 batches an epoch
    trainer = L.Trainer(
        max_steps=13,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        callbacks=[StepProgressBar(), Look()],
    )
    trainer.fit(model, data)
    assert trainer.max_epochs == -1  # Lightning's own bar shows "Epoch 0/-2" here
    assert seen[0] == "Epoch 0, step limit 13" and seen[-1] == "Epoch 1, step limit 13"
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", logger=False, callbacks=[StepProgressBar()])
    bar = trainer.progress_bar_callback
    bar.setup(trainer, model, "fit")
    assert bar._get_train_description(1).strip() == "Epoch 1/2"  # bounded by epochs: Lightning's own


def test_quiet_libraries_silences_only_library_noise():
    import logging
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moe_finetune.quiet_libraries()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", stacklevel=1)
        warnings.warn("Starting from v1.9.0, `tensorboardX` has been removed as a dependency of ...", stacklevel=1)
        warnings.warn("data.vocab_size does not match", stacklevel=1)  # anything else still shows
    assert [str(w.message) for w in caught] == ["data.vocab_size does not match"]
    assert not logging.getLogger("torchao").isEnabledFor(logging.WARNING)  # "Failed to load ..." probes
    assert not logging.getLogger("torch.utils._pytree").isEnabledFor(logging.WARNING)
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    tip = logging.LogRecord(rank_zero.name, logging.INFO, "", 0, "Tip: try installing [litlogger](...)", None, None)
    info = logging.LogRecord(rank_zero.name, logging.INFO, "", 0, "GPU available: False, used: False", None, None)
    assert not rank_zero.filter(tip) and rank_zero.filter(info)
    moe_finetune.quiet_libraries()  # idempotent: main() may run more than once in a process
    assert rank_zero.filters.count(moe_finetune._drop_tips) == 1


# --- the console entry ----------------------------------------------------------------------------------------------


def _env(**overrides: str | None) -> dict[str, str]:
    env = {**os.environ, "COLUMNS": "200"}
    for k, v in overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def test_module_fit_help_lists_the_options(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fly_lightning.recipes.moe_finetune", "fit", "--help"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=_env(TRITON_INTERPRET="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for option in [f"--model.{k}" for k in ("arch", "pretrained", *TINY, "lr", "warmup_steps")] + [
        "--data.vocab_size",
        "--data.seq_len",
        "--data.batch_size",
        "--trainer.max_steps",
        "--trainer.strategy",
    ]:
        assert option in proc.stdout, option
    assert "LightningCLI's args parameter" not in proc.stderr  # main() must not pass sys.argv twice
    assert proc.stdout.startswith("usage: fly-finetune ") and "moe_finetune" not in proc.stdout
    arch_help = proc.stdout[proc.stdout.index("--model.arch") :][:400]
    assert all(arch in arch_help for arch in ARCHS)  # the choices are listed
    for option in ("--checkpoint.monitor", "--dispatch_coverage.print_table", "--op_time.every_n_steps"):
        assert option in proc.stdout, option


def test_console_script_help_does_not_reexec(tmp_path):
    """``fly-finetune --help`` with TRITON_INTERPRET unset: exit 0 without the re-exec (which doubles the start-up
    time and is needed only to run kernels), named ``fly-finetune``."""
    script = shutil.which("fly-finetune", path=str(Path(sys.executable).parent))
    assert script is not None, "console script fly-finetune not installed next to this python"
    proc = subprocess.run(
        [script, "--help"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=_env(TRITON_INTERPRET=None),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fit" in proc.stdout and "--config" in proc.stdout
    assert proc.stdout.startswith("usage: fly-finetune ")
    assert "no GPU" not in proc.stdout + proc.stderr  # no re-exec, no banner


def test_console_script_reexecs_once_without_gpu_and_keeps_stdout_clean(tmp_path):
    """A run (here one that fails at parse time, after the re-exec) re-executes once; the banner goes to stderr."""
    script = shutil.which("fly-finetune", path=str(Path(sys.executable).parent))
    proc = subprocess.run(
        [script, "fit", "--model.arch=gpt2"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=_env(TRITON_INTERPRET=None),
    )
    assert proc.returncode not in (0, None)
    assert proc.stderr.count("fly-finetune: no GPU") == (0 if torch.cuda.is_available() else 1)
    assert "no GPU" not in proc.stdout and "gpt2" in proc.stderr


def test_cli_fine_tunes_a_checkpoint_on_chat_jsonl_and_exports_a_transformers_folder(
    tmp_path, no_reexec, record_cli, tiny_tokenizer
):
    """Real data and real checkpoints: a local model directory with its tokenizer, chat JSONL rendered with the
    tokenizer's template, and at the end a folder that ``from_pretrained`` loads with the original parameter names."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = tmp_path / "ckpt"
    build_hf_model("qwen3_moe", 16, 32, 1, 2, 1, 4, 2, 16, 32).save_pretrained(ckpt, max_shard_size="20KB")
    assert len(list(ckpt.glob("*.safetensors"))) > 1  # sharded, with an index, as real checkpoints are
    tiny_tokenizer(ckpt)  # the tokenizer lives in the model directory, as on the hub
    rows = [{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the cat sat"}]},
            {"text": "a dog ran on the mat"}] * 20  # fmt: skip
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    main(
        _pretrained_fit_args(
            tmp_path, ckpt, f"--data.path={tmp_path / 'chat.jsonl'}", "--data.vocab_size=16", "--data.val_fraction=0.2"
        )
    )
    (cli,) = record_cli
    assert cli.trainer.global_step == 2
    assert cli.datamodule.hparams.tokenizer == str(ckpt)  # defaulted to the checkpoint's own tokenizer
    out = Path(cli.trainer.log_dir) / "hf_model"
    tensors = lambda d: {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}  # noqa: E731
    saved, original = tensors(out), tensors(ckpt)
    assert saved.keys() == original.keys()  # the original names, whatever module replaced them in training
    assert any(not torch.equal(saved[k], original[k]) for k in saved)  # and the fine-tuned values
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    trained = {k: v.detach() for k, v in cli.model.model.state_dict().items()}
    assert all(torch.equal(v.to(trained[k].dtype), trained[k]) for k, v in reloaded.state_dict().items())
    assert AutoTokenizer.from_pretrained(out).eos_token == "[EOS]"


@pytest.mark.parametrize("quant, fmt", [("mxfp8", "mxfp8_e4m3"), ("mxfp4", "mxfp4_e2m1")])
def test_cli_quant_trains_with_mx_linears_and_experts_and_evaluates(quant, fmt, tmp_path, no_reexec, record_cli):
    from fly_lightning.modules.moe import FlyMoE
    from fly_lightning.quant.linear import FlyMXLinear

    wide = "--model.expert_intermediate_size=32"  # whole MX blocks along the experts' intermediate dim
    main(_fit_args(tmp_path, f"--model.quant={quant}", wide, steps=2))
    (cli,) = record_cli
    mx = [m for m in cli.model.modules() if isinstance(m, FlyMXLinear)]
    assert mx and all(m.spec.weight == fmt and m.spec.activation == fmt for m in mx)
    assert not isinstance(cli.model.model.get_output_embeddings(), FlyMXLinear)  # the head stays in bf16
    moes = [m for m in cli.model.modules() if isinstance(m, FlyMoE)]
    assert moes and all(m.mx is not None and m.mx.weight_fmt == m.mx.act_fmt == fmt for m in moes)  # experts too
    assert all(math.isfinite(v) for v in _metric(Path(cli.trainer.log_dir), "train_loss"))
    # the Linears' weights went through MX (the emulated form: fake-quantised as [out, in] rows), not only the experts'
    shapes = {r["shape"] for r in fly_lightning.DISPATCH_LOG.records("mx_fake_quantize")}
    assert {f"{m.out_features}x{m.in_features}" for m in mx} <= shapes, shapes
    # the quality comparison: the same checkpoint evaluated with and without MX
    ckpt = Path(cli.trainer.log_dir) / "checkpoints" / "last.ckpt"
    losses = {}
    for q in ("none", quant):
        record_cli.clear()
        test_args = [
            a for a in _fit_args(tmp_path / q, f"--model.quant={q}", wide) if not a.startswith("--trainer.max_steps")
        ]
        mode = ["--model.quant_mode=floor"] if q != "none" else []  # kept over the checkpoint's, as quant is
        main(["test", *test_args[1:], *mode, f"--ckpt_path={ckpt}"])
        losses[q] = record_cli[0].trainer.callback_metrics["test_loss"].item()
        assert record_cli[0].config["test"].model.quant_mode == ("floor" if mode else None)
    assert all(math.isfinite(v) for v in losses.values()) and losses["none"] != losses[quant]


def test_a_resumed_run_reaches_the_losses_of_an_uninterrupted_one(tmp_path, no_reexec, record_cli):
    """Stopped at step 4 (mid-epoch: 12 batches an epoch) and resumed to step 16 (into the second epoch): the same
    batches in the same order, so the same training losses as the run that never stopped."""
    ckpt = ["--checkpoint.every_n_train_steps=4", "--checkpoint.save_top_k=-1", "--checkpoint.monitor=null",
            "--checkpoint.filename={step}", "--trainer.val_check_interval=null",
            "--trainer.check_val_every_n_epoch=100"]  # fmt: skip
    main(_fit_args(tmp_path / "whole", *ckpt, steps=16))
    whole = _metric(Path(record_cli[0].trainer.log_dir), "train_loss")
    stop = Path(record_cli[0].trainer.log_dir) / "checkpoints" / "step=4.ckpt"
    record_cli.clear()
    main([*_fit_args(tmp_path / "resumed", *ckpt, steps=16), f"--ckpt_path={stop}"])
    resumed = _metric(Path(record_cli[0].trainer.log_dir), "train_loss")
    assert len(whole) == 16 and len(resumed) == 12
    assert resumed == whole[4:]


def test_hub_ids_are_not_taken_for_local_paths():
    from fly_lightning.recipes.moe_finetune import check_pretrained

    assert check_pretrained("Qwen/Qwen3-30B-A3B") is None and check_pretrained("gpt2") is None
    assert "does not exist" in check_pretrained("./models/qwen") and "does not exist" in check_pretrained("a/b/c")


def test_the_cosine_spans_an_epoch_bounded_run():
    """Without max_steps the schedule runs over Lightning's estimate of the run's steps, not a fixed 1000."""
    from types import SimpleNamespace

    from fly_lightning.recipes.moe_finetune import MoECausalLM

    module = MoECausalLM(warmup_steps=10)
    module._trainer = SimpleNamespace(max_steps=-1, estimated_stepping_batches=5000)
    config = module.configure_optimizers()
    scheduler = config["lr_scheduler"]["scheduler"]
    factors = {step: scheduler.lr_lambdas[0](step) for step in (1000, 2500, 4999)}
    assert factors[1000] > 0.5 and 0.0 < factors[2500] < factors[1000] and factors[4999] < 1e-3


def test_a_missing_checkpoint_is_a_parser_error(tmp_path, no_reexec, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["test", *_fit_args(tmp_path)[1:], f"--ckpt_path={tmp_path / 'missing.ckpt'}"])
    assert exc.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "missing.ckpt is not a file" in err and "Traceback" not in err
