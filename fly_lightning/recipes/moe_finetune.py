"""MoE fine-tuning recipe: a Hugging Face MoE causal LM trained with ``strategy="flydsl"`` through LightningCLI.

The embedded default (``fly-finetune`` with no arguments) builds a small Qwen3-MoE from a config (no download),
trains it for a few dozen steps on the embedded Markov corpus and prints what was swapped, which kernel served which
shapes and how step time splits by operator. Everything is a LightningCLI argument::

    fly-finetune fit --model.arch mixtral --trainer.max_steps 100 --trainer.strategy flydsl_ddp --trainer.devices 2
    fly-finetune fit --model.pretrained /path/to/Qwen3-30B-A3B --data.vocab_size 151936   # real checkpoints
    fly-finetune fit --data.path corpus.jsonl --data.tokenizer bytes                      # real text
    fly-finetune fit --print_config > cfg.yaml && fly-finetune fit -c cfg.yaml           # every option
    fly-finetune test --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt         # also validate, predict

Checkpoints (last, and the best by validation loss) go to ``<log_dir>/checkpoints``; the callbacks are options too:
``--checkpoint.*`` (Lightning's ``ModelCheckpoint``), ``--dispatch_coverage.*`` and ``--op_time.*``.

On a machine without a GPU the Triton kernels run through the Triton interpreter (numerics as on a GPU, speed
meaningless); the recipe re-executes itself with ``TRITON_INTERPRET=1`` for that, since the variable must be set
before Triton kernels are defined.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Literal, get_args

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI

from fly_lightning.callbacks import DispatchCoverage, OperatorTime
from fly_lightning.recipes.data import LMData
from fly_lightning.recipes.errors import RecipeError
from fly_lightning.recipes.text import has_tokenizer

PROG = "fly-finetune"
Arch = Literal["qwen3_moe", "mixtral", "olmoe"]
Quant = Literal["none", "mxfp8", "mxfp4"]
ARCHS: tuple[str, ...] = get_args(Arch)


def build_hf_model(
    arch: str,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    num_experts: int,
    experts_per_token: int,
    expert_intermediate_size: int,
    max_seq_len: int,
):
    """A randomly initialised Hugging Face MoE causal LM of one of the supported architectures."""
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=False,
    )
    if arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **common,
            num_experts=num_experts,
            num_experts_per_tok=experts_per_token,
            moe_intermediate_size=expert_intermediate_size,
            intermediate_size=4 * expert_intermediate_size,
            head_dim=hidden_size // num_heads,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
        return tf.Qwen3MoeForCausalLM(cfg)
    if arch == "mixtral":
        cfg = tf.MixtralConfig(
            **common,
            num_local_experts=num_experts,
            num_experts_per_tok=experts_per_token,
            intermediate_size=expert_intermediate_size,
        )
        return tf.MixtralForCausalLM(cfg)
    if arch == "olmoe":
        cfg = tf.OlmoeConfig(
            **common,
            num_experts=num_experts,
            num_experts_per_tok=experts_per_token,
            intermediate_size=expert_intermediate_size,
        )
        return tf.OlmoeForCausalLM(cfg)
    raise RecipeError(f"arch must be one of {ARCHS}, got {arch!r}")


class MoECausalLM(L.LightningModule):
    """A Hugging Face MoE causal LM as a LightningModule.

    Args:
        arch: architecture of the randomly initialised model (ignored with ``pretrained``).
        pretrained: a local path or hub id for ``AutoModelForCausalLM.from_pretrained`` (fine-tune a real model).
        vocab_size / hidden_size / num_layers / num_heads / num_kv_heads: model size.
        num_experts / experts_per_token / expert_intermediate_size: the MoE layers.
        max_seq_len: position embeddings.
        lr / weight_decay / warmup_steps: AdamW with linear warm-up, then cosine decay over ``trainer.max_steps``.
        quant: ``"mxfp8"`` (E4M3 weights and activations) or ``"mxfp4"`` (E2M1) forward GEMMs for the model's
            ``nn.Linear`` layers and MoE experts but the output head and routers, through ``FlyMXConfig`` (torchao
            ``quantize_``); ``"none"``: bf16.
            ``fly-finetune test --model.quant ...`` on one checkpoint compares the eval losses.
        quant_mode: the MX scale mode, ``"floor"`` or ``"rceil"``; None: ``FlyMXConfig``'s default (rceil for MXFP8,
            floor for MXFP4).
        export_dir: at the end of ``fit``, a transformers-loadable copy of the model (``save_pretrained``: config and
            safetensors with the original parameter names, and the data's tokenizer if it has one) in this folder of
            the log directory; None: none.
    """

    def __init__(
        self,
        arch: Arch = "qwen3_moe",
        pretrained: str | None = None,
        vocab_size: int = 256,
        hidden_size: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        num_experts: int = 8,
        experts_per_token: int = 2,
        expert_intermediate_size: int = 128,
        max_seq_len: int = 512,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 5,
        quant: Quant = "none",
        quant_mode: Literal["floor", "rceil"] | None = None,
        export_dir: str | None = "hf_model",
    ) -> None:
        super().__init__()
        if pretrained:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(pretrained, torch_dtype=torch.bfloat16)
            self.model.train()  # from_pretrained returns eval mode, which Lightning keeps for training
        else:
            self.model = build_hf_model(
                arch,
                vocab_size,
                hidden_size,
                num_layers,
                num_heads,
                num_kv_heads,
                num_experts,
                experts_per_token,
                expert_intermediate_size,
                max_seq_len,
            )
        if quant != "none":
            apply_quant(self.model, quant, quant_mode)
        # with a checkpoint, its config decides the vocabulary: the unused argument must not clash with the data's
        # vocab_size when Lightning merges the hparams (``setup`` checks the real one)
        self.save_hyperparameters(ignore=["vocab_size"] if pretrained else None)

    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule
        data_vocab = getattr(getattr(datamodule, "hparams", None), "vocab_size", None)
        model_vocab = self.model.config.vocab_size
        if data_vocab is not None and data_vocab != model_vocab:
            raise RecipeError(
                f"data.vocab_size={data_vocab} does not match the model's vocabulary ({model_vocab}): "
                f"pass --data.vocab_size {model_vocab}"
            )

    def on_fit_end(self) -> None:
        if self.hparams.export_dir and self.trainer.is_global_zero:
            path = export_hf(
                self, Path(self.trainer.log_dir or self.trainer.default_root_dir) / self.hparams.export_dir
            )
            if path is not None:
                from rich.console import Console

                Console().print(f"transformers model written to {path}")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, labels=tokens).loss  # HF shifts the labels

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch[0])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(batch[0]), prog_bar=True, sync_dist=True)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self(batch[0]), sync_dist=True)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The greedy next token after every position: ``[batch, seq_len]`` token ids."""
        return self.model(input_ids=batch[0]).logits.argmax(-1)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        # the cosine spans the run: max_steps, else what the epochs and the data give (Lightning's estimate)
        total = max(
            1, self.trainer.max_steps if self.trainer.max_steps > 0 else self.trainer.estimated_stepping_batches
        )
        warm = self.hparams.warmup_steps

        def schedule(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule), "interval": "step"},
        }


def apply_quant(model: torch.nn.Module, quant: str, mode: str | None = None) -> None:
    """``quantize_`` with ``FlyMXConfig`` (scale ``mode``; None: its default): the model's ``nn.Linear`` layers and
    its MoE experts (the blocks are swapped for ``FlyMoE`` first, which is what carries MX experts), the output head
    and routers excepted (``mx_filter``)."""
    from torchao.quantization import quantize_

    from fly_lightning import FlyMXConfig, mx_filter, transform

    fmt = {"mxfp8": "mxfp8_e4m3", "mxfp4": "mxfp4_e2m1"}[quant]
    head = model.get_output_embeddings()
    transform(model, ops=["moe"])
    selected = lambda m, fqn: m is not head and mx_filter(m, fqn)  # noqa: E731
    quantize_(model, FlyMXConfig(weight=fmt, activation=fmt, mode=mode), filter_fn=selected)


def export_hf(module: MoECausalLM, path: Path) -> Path | None:
    """``save_pretrained`` of the module's model (the swapped modules keep the original parameter names, so the
    folder loads with ``AutoModelForCausalLM.from_pretrained``), with the data's Hugging Face tokenizer if any. Sharded
    parameters (FSDP2, tensor parallel) are not gathered here: None, with a warning to use the Lightning checkpoint."""
    from fly_lightning.dtensor import is_dtensor

    if any(is_dtensor(p) for p in module.model.parameters()):
        warnings.warn(
            "model.export_dir: sharded parameters are not exported; use the Lightning checkpoint", stacklevel=2
        )
        return None
    module.model.save_pretrained(path)
    tokenizer = getattr(getattr(module.trainer, "datamodule", None), "tokenizer", None)
    if tokenizer is not None and tokenizer.hf is not None:
        tokenizer.hf.save_pretrained(path)
    return path


def check_pretrained(pretrained: str | None) -> str | None:
    """Why ``pretrained`` cannot be loaded, when that is visible without the network, else None.

    A hub id is ``name`` or ``org/name``; anything else that looks like a path (absolute, ``./``, ``~``, more than one
    ``/``, or an existing entry) must be a directory holding a ``config.json``.
    """
    if not pretrained:
        return None
    path = Path(pretrained).expanduser()
    windows_path = os.sep != "/" and os.sep in pretrained  # on POSIX, "org/name" is a hub id
    looks_local = path.is_absolute() or pretrained.startswith((".", "~")) or pretrained.count("/") > 1 or windows_path
    if path.exists() or looks_local:
        if not path.exists():
            return f"model.pretrained: {pretrained} does not exist"
        if not path.is_dir():
            return f"model.pretrained: {pretrained} is not a directory (expected a saved model directory)"
        if not (path / "config.json").is_file():
            return f"model.pretrained: {pretrained} is not a model directory (no config.json in it)"
    return None


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, with a sensible description when the run is bounded by ``max_steps`` alone
    (Lightning's own shows ``Epoch 0/-2`` for ``max_epochs=-1``)."""

    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        if trainer.max_epochs is not None and trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return f"Epoch {current_epoch}, step limit {trainer.max_steps}"
        return f"Epoch {current_epoch}"


class FinetuneCLI(LightningCLI):
    """LightningCLI with the recipe's callbacks as first-class options (``--checkpoint.*``, ``--dispatch_coverage.*``,
    ``--op_time.*``, shown by ``--print_config``), a clear error for a missing checkpoint directory, and a progress
    bar that counts steps."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val_loss",
                "checkpoint.mode": "min",
                "checkpoint.save_top_k": 1,
                "checkpoint.save_last": True,
                "checkpoint.filename": "best-{step}",
            }
        )
        parser.add_lightning_class_args(DispatchCoverage, "dispatch_coverage")
        parser.add_lightning_class_args(OperatorTime, "op_time")
        parser.set_defaults({"op_time.every_n_steps": 10, "op_time.first_step": 5})

    EVAL_OPTIONS = ("quant", "quant_mode")
    """Model options the command line keeps over a checkpoint's hyperparameters: the numerics one checkpoint is
    evaluated in (bf16, MXFP8, MXFP4, either scale mode). The others describe the checkpoint's model: its own win."""

    def _parse_ckpt_path(self) -> None:
        """LightningCLI lets a checkpoint's hyperparameters override the command line; ``EVAL_OPTIONS`` given on the
        command line win here."""
        sub = self.config.get("subcommand")
        ckpt = self.config[sub].get("ckpt_path") if sub else None
        if ckpt and ckpt not in ("last", "best", "hpc", "registry") and not Path(ckpt).expanduser().is_file():
            self._parser(sub).error(f"ckpt_path: {ckpt} is not a file")  # before a model is built for nothing
        kept = {name: self.config[sub].model[name] for name in self.EVAL_OPTIONS} if sub else {}
        super()._parse_ckpt_path()
        raw = self._raw_args if self._raw_args is not None else sys.argv[1:]
        for name, value in kept.items():
            if any(a == f"--model.{name}" or a.startswith(f"--model.{name}=") for a in raw):
                self.config[sub].model[name] = value

    def parse_arguments(self, parser, args) -> None:
        self._raw_args = None if args is None else list(args)
        super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        problem = check_pretrained(config.model.pretrained)
        if problem:
            self._parser(self.subcommand).error(problem)
        if config.data.tokenizer is None:  # real text with a checkpoint: its own tokenizer (if it has one), else bytes
            pretrained = config.model.pretrained
            own = pretrained and (not Path(pretrained).expanduser().is_dir() or has_tokenizer(pretrained))
            config.data.tokenizer = pretrained if config.data.path and own else "bytes"

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list) -> L.Trainer:
        if config.get("enable_checkpointing") is False:  # --trainer.enable_checkpointing=false turns checkpoints off
            callbacks = [c for c in callbacks if not isinstance(c, ModelCheckpoint)]
        given = [*(config.get("callbacks") or []), *callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
            callbacks = [*callbacks, StepProgressBar()]
        return super()._instantiate_trainer(config, callbacks)


def trainer_defaults() -> dict:
    """The embedded default run: short, observed, on whatever device is there. The callbacks (checkpoints: last and
    best by validation loss; dispatch coverage; operator time) are options of ``FinetuneCLI``."""
    cuda = torch.cuda.is_available()
    return {
        "strategy": "flydsl",
        "accelerator": "gpu" if cuda else "cpu",
        "devices": 1,
        "precision": "bf16-mixed" if cuda else "32-true",
        "max_steps": 30,
        "val_check_interval": 15,
        "limit_val_batches": 4,
        "log_every_n_steps": 5,
        "enable_checkpointing": True,
        "enable_model_summary": False,
    }


def _drop_tips(record: logging.LogRecord) -> bool:
    return "litlogger" not in record.getMessage()


def quiet_libraries() -> None:
    """Silence what libraries print that a user of the CLI cannot act on (the CLI only: importing this module changes
    nothing): torchao's CUDA extension probes ("Failed to load ..."), torch's pytree deprecation notices, Lightning's
    own deprecations and advertising tips."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    for name in ("lightning.pytorch.utilities.rank_zero", "pytorch_lightning.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if _drop_tips not in logger.filters:
            logger.addFilter(_drop_tips)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    warnings.filterwarnings("ignore", message=r".*`tensorboardX` has been removed")


def main(args: list[str] | None = None) -> None:
    """Console entry point ``fly-finetune``: LightningCLI with ``fit`` and the embedded default."""
    args = sys.argv[1:] if args is None else args
    runs = not any(a in ("-h", "--help") or a.startswith("--print_config") for a in args)  # help runs no kernel
    if runs and not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede any Triton kernel definition: start afresh
        os.execv(sys.executable, [sys.executable, "-m", "fly_lightning.recipes.moe_finetune", *args])
    if runs and os.environ.get("TRITON_INTERPRET") == "1":
        from rich.console import Console

        Console(stderr=True).print(  # stderr: stdout carries --print_config's YAML
            "fly-finetune: no GPU, Triton kernels run through the interpreter (numerics as on GPU, speed meaningless)"
        )
    import fly_lightning  # noqa: F401  (registers the strategies)

    quiet_libraries()

    cli_args = args or ["fit"]
    try:
        FinetuneCLI(
            MoECausalLM,
            LMData,
            trainer_defaults=trainer_defaults(),
            seed_everything_default=0,
            # None: LightningCLI reads sys.argv itself (given both, it warns on every command-line run)
            args=None if cli_args == sys.argv[1:] else cli_args,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": PROG},
        )
    except RecipeError as exc:  # the user's to fix: one line, as the parser reports a bad option
        from rich.console import Console

        # soft wrap: the terminal folds the line, paths in it stay whole for copying
        Console(stderr=True).print(f"{PROG}: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
