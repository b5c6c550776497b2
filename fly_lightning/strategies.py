"""Lightning strategies that transform the model, apply a dispatch policy and report what ran.

``import fly_lightning`` registers, in ``lightning.pytorch`` (and in ``pytorch_lightning`` when it is installed, with
its own classes, since the two packages' Trainers accept only their own Strategy subclasses):

- ``"flydsl"``: single device (the device comes from the Trainer's accelerator/devices).
- ``"flydsl_ddp"``: DDP.
- ``"flydsl_fsdp2"``: FSDP2 (``fully_shard``) on a 1-D data-parallel mesh; shards each block of the model's
  ``nn.ModuleList``s and the root (its step methods gathering like its forward), unless a ``configure_model`` of the
  LightningModule's shards the model itself.
- ``"flydsl_model_parallel"``: Lightning's ModelParallelStrategy (FSDP2 + tensor parallel on a 2-D device mesh); the
  user parallelises in ``configure_model`` as usual.

When the model is transformed: in ``connect()``, the first strategy hook of ``fit``, before ``configure_model`` (so
before any user sharding) and before optimizers exist; again in ``setup()`` for modules created in ``configure_model``
(single device and DDP; sharded modules are left with the reason, see ``fly_lightning.transform``).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fly_lightning import tuning
from fly_lightning.dispatch_log import DISPATCH_LOG
from fly_lightning.policy import DispatchConfig, set_dispatch_config
from fly_lightning.transform import TransformSummary, transform
from fly_lightning.transform.core import SHARDED
from fly_lightning.transform.optimizer_state import from_original_layout, to_original_layout


class _FlyStrategyMixin:
    """Options shared by every fly-lightning strategy.

    Args:
        ops: module families to swap (``"rms_norm"``, ``"moe"``); ``None`` means all; ``()`` swaps nothing.
        dispatch: backend policy in force while this strategy runs (default: the current one).
        quantization: a torchao ``AOBaseConfig`` applied with ``torchao.quantization.quantize_`` after the swap, before
            sharding and optimizers (e.g. torchao's MXFP8 training config on hardware that has it). Modules created
            in ``configure_model`` are quantized in ``setup()``, unless their parameters are already sharded then
            (listed as left, with the reason: quantize before ``fully_shard`` / ``parallelize_module`` yourself).
        quantization_filter: ``filter_fn(module, fqn)`` passed to ``quantize_``.
        report: print the transform summary and the dispatch table at the end (rank 0).
    """

    _fly_shards_parameters = False  # FSDP2 strategies: frozen MX weights become parameters, which it shards

    def _fly_tensor_parallel(self) -> bool:
        """Whether the user's ``configure_model`` may apply a tensor-parallel plan (model parallel, TP size > 1)."""
        return False

    def __init__(
        self,
        *args: Any,
        ops: Iterable[str] | None = None,
        dispatch: DispatchConfig | None = None,
        quantization: Any = None,
        quantization_filter: Callable[[nn.Module, str], bool] | None = None,
        report: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(ops, str):  # tuple("rms_norm") would be its letters
            raise TypeError(f"ops must be a collection of op family names, e.g. ops=[{ops!r}], not a string")
        self.fly_ops = None if ops is None else tuple(ops)
        self.fly_dispatch = dispatch
        self.fly_quantization = quantization
        self.fly_quantization_filter = quantization_filter
        self.fly_report = report
        self.transform_summary = TransformSummary()
        self._fly_previous_config: DispatchConfig | None = None
        self._fly_quantization_left: list[tuple[str, str, str]] = []  # what quantize_ could not reach, once each
        self._fly_batches = 0

    def connect(self, model: Any) -> None:
        super().connect(model)
        self._fly_apply(model, before_configure_model=True)

    def setup_environment(self) -> None:
        if self.fly_dispatch is not None and self._fly_previous_config is None:
            self._fly_previous_config = set_dispatch_config(self.fly_dispatch)
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        self._fly_apply(self.lightning_module)
        super().setup(trainer)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before steps 2, 3, 5, 9, ... (``tuning.agreement_due``): the ranks adopt one choice per measured shape
        (``tuning.agree_across_ranks``). Every rank reaches this hook with the same count, so the collective matches."""
        self._fly_batches += 1
        if self.world_size > 1 and tuning.agreement_due(self._fly_batches):
            tuning.agree_across_ranks()
        super().on_train_batch_start(batch, batch_idx)

    def teardown(self) -> None:
        if self.fly_report and self.global_rank == 0:
            if self.transform_summary.swapped or self.transform_summary.left:
                self.transform_summary.print()
            if DISPATCH_LOG.decisions:
                DISPATCH_LOG.print()
        if self._fly_previous_config is not None:
            set_dispatch_config(self._fly_previous_config)
            self._fly_previous_config = None
        super().teardown()

    def optimizer_state(self, optimizer: Any) -> dict:
        """The optimizer's state_dict in the original model's layout (see ``transform.optimizer_state``), so a
        checkpoint written here resumes under Lightning's own strategies too."""
        state = super().optimizer_state(optimizer)
        if self.lightning_module is None or not _index_based(state):
            return state  # a distributed checkpoint's (FSDP2 / model parallel): keyed by name, left as it is
        return to_original_layout(self.lightning_module, getattr(optimizer, "_optimizer", optimizer), state)

    def load_optimizer_state_dict(self, checkpoint: dict) -> None:
        """Accepts optimizer states in the original model's layout (any checkpoint of it) or in the swapped one."""
        states = checkpoint.get("optimizer_states")
        if states is not None and self.lightning_module is not None:
            checkpoint["optimizer_states"] = [
                from_original_layout(self.lightning_module, opt, st) if _index_based(st) else st
                for opt, st in zip(self.optimizers, states, strict=False)
            ] + list(states[len(self.optimizers) :])
        super().load_optimizer_state_dict(checkpoint)

    def _fly_apply(self, model: nn.Module | None, before_configure_model: bool = False) -> None:
        if model is None:
            return
        s = transform(model, ops=self.fly_ops)
        self.transform_summary.swapped += s.swapped
        # the latest pass knows what is still left; a module it finds sharded (the pass in setup(), after FSDP2 or
        # TP sharded it) keeps the reason an earlier pass gave, which is why it was not swapped before sharding
        earlier = {path: reason for path, _, reason in self.transform_summary.left}
        left = [(path, cls, earlier.get(path, reason) if reason == SHARDED else reason) for path, cls, reason in s.left]
        self.transform_summary.unrecognised = s.unrecognised
        if self.fly_quantization is not None:
            self._fly_quantize(model, before_configure_model)
        self.transform_summary.left = left + self._fly_quantization_left

    def _fly_quantize(self, model: nn.Module, before_configure_model: bool = False) -> None:
        """``quantize_`` on the modules no earlier pass has seen (each module is quantized at most once: a pass marks
        every module it saw, on the module itself, so a later Trainer does not quantize it again either).

        Frozen MX Linears are no ``nn.Linear``, and tensor-parallel plans (``ColwiseParallel``, ``RowwiseParallel``)
        take nothing else: under a tensor-parallel strategy they are converted after ``configure_model`` instead, and
        those its plan sharded stay as they are, with the reason."""
        from torchao.quantization import quantize_

        from fly_lightning.dtensor import is_dtensor
        from fly_lightning.quant.config import LEFT_ATTR, FlyMXConfig, mx_filter

        user_filter = self.fly_quantization_filter
        # ours: Linears and MoE experts, head and routers kept; another config: torchao's own default filter
        ours = isinstance(self.fly_quantization, FlyMXConfig)
        default = mx_filter if ours else lambda m, fqn: isinstance(m, nn.Linear)  # noqa: E731
        heads = _output_heads(model) if ours and user_filter is None else set()  # kept whatever their names
        sharded: list[tuple[str, str, str]] = []
        defer = ours and self.fly_quantization.frozen and self._fly_tensor_parallel()
        deferred: set[int] = set()  # frozen Linears left for the pass after configure_model

        def wanted(module: nn.Module, fqn: str) -> bool:
            if getattr(module, "_fly_quantize_seen", False) or not (user_filter or default)(module, fqn):
                return False
            if id(module) in heads:
                return False
            if defer and before_configure_model and isinstance(module, nn.Linear):
                deferred.add(id(module))
                return False
            if any(is_dtensor(p) for p in module.parameters(recurse=False)):
                why = "quantization: parameters already sharded (quantize before fully_shard / parallelize_module)"
                if defer and isinstance(module, nn.Linear):
                    why = ("quantization: frozen MX Linears are converted after configure_model under tensor "
                           "parallelism (its plans take nn.Linear only), and this one was sharded there")  # fmt: skip
                sharded.append((fqn, type(module).__name__, why))
                return False
            return True

        quantize_(model, self.fly_quantization, filter_fn=wanted)
        # what the handler selected but left (already quantized by torchao, dims off the MX blocks, ...), with its why
        handler_left = [
            (fqn, type(m).__name__, f"quantization: {m.__dict__.pop(LEFT_ATTR)}")
            for fqn, m in model.named_modules()
            if LEFT_ATTR in m.__dict__
        ]
        # swapped MoE blocks hold their experts as stacked [E, ...] tensors: no nn.Linear for quantize_ to reach
        from fly_lightning.modules.moe import FlyMoE

        reported = {fqn for fqn, _, _ in handler_left}
        experts = [
            (fqn, "FlyMoE", "quantization: experts are stacked [E, ...] tensors, not nn.Linear; this config does not "
             "reach them (they run unquantized; FlyMXConfig does)" if not ours else
             "quantization: experts not selected by the filter")
            for fqn, m in model.named_modules()
            if isinstance(m, FlyMoE) and not getattr(m, "_fly_quantize_seen", False) and m.mx is None
            and fqn not in reported
        ]  # fmt: skip
        for m in model.modules():
            if id(m) not in deferred:
                m._fly_quantize_seen = True
        self._fly_quantization_left += sharded + handler_left + experts
        if self._fly_shards_parameters:  # FSDP2 shards parameters only: frozen MX weights must be some
            from fly_lightning.quant.frozen import frozen_as_parameters

            frozen_as_parameters(model)


def _load_full_checkpoint(strategy: Any, path: Any, weights_only: bool | None) -> dict[str, Any] | None:
    """A full (single-file) checkpoint under FSDP2 / model parallel, for a model with restacked per-expert lists
    (``ExpertList``), or None to leave it to Lightning. Lightning's loader matches the file's keys to parameters by
    name through ``set_model_state_dict``, which sees the stacked parameters where the file (written in the original
    layout, like every checkpoint here) has per-expert keys: the keys and the optimizer states are converted first,
    then loaded as Lightning loads them."""
    from pathlib import Path

    from lightning.fabric.strategies.model_parallel import (
        _is_full_checkpoint,
        _load_raw_module_state,
        _rekey_optimizer_state_if_needed,
    )
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from fly_lightning.modules.moe_layout import ExpertList, stack_expert_lists

    module = strategy.lightning_module
    path = Path(strategy.broadcast(path))
    if not _is_full_checkpoint(path) or not any(isinstance(m, ExpertList) for m in strategy.model.modules()):
        return None
    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    # rank 0's values are broadcast (as Lightning loads): the other ranks never read the experts from the file
    state_dict = stack_expert_lists(strategy.model, checkpoint.pop("state_dict"), read=strategy.global_rank == 0)
    _load_raw_module_state(state_dict, strategy.model, strict=module.strict_loading)
    options = StateDictOptions(broadcast_from_rank0=True, full_state_dict=True, strict=module.strict_loading)
    for opt, state in zip(strategy.optimizers, checkpoint.get("optimizer_states", []), strict=False):
        if _index_based(state):
            state = from_original_layout(module, opt, state)
        state = _rekey_optimizer_state_if_needed(state, strategy.model)
        set_optimizer_state_dict(strategy.model, opt, optim_state_dict=state, options=options)
    return checkpoint


def _index_based(state: Any) -> bool:
    """A ``torch.optim`` state_dict that lists parameters by position (not a distributed checkpoint's names)."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    return isinstance(groups, list) and all(isinstance(i, int) for g in groups for i in g.get("params", ()))


def _auto_fully_shard(strategy: Any, model: nn.Module) -> None:
    """Default FSDP2 wrapping: each block of every ``nn.ModuleList`` (not per-expert lists; inner lists before the
    blocks holding them), then the root, whose step methods count as forwards.

    The step methods: a ``training_step`` that calls ``self.model(...)`` never runs the LightningModule's own
    forward, whose hook gathers the root's parameters (embeddings, head); registered, they gather them around the
    step (sharding the children instead would split tied weights and gather them again in backward). Modules built in
    ``setup()`` are transformed first (sharded modules can no longer be swapped); already sharded ones are skipped, so
    a second ``fit`` / ``validate`` on the same model works.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    if hasattr(strategy, "_fly_apply"):  # also used with Lightning's own strategy (the stock baseline in the tests)
        strategy._fly_apply(model)
    mesh = strategy.device_mesh["data_parallel"]
    # pre-order reversed: every module comes after its descendants (a block is sharded after the lists inside it)
    for name, module in reversed(list(model.named_modules())):
        # experts that get no tokens on one rank would skip their all-gather: per-expert lists stay in their block
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] != "experts":
            for block in module:
                if not isinstance(block, FSDPModule):
                    fully_shard(block, mesh=mesh)
    if not isinstance(model, FSDPModule):
        fully_shard(model, mesh=mesh)
        for step in ("training_step", "validation_step", "test_step", "predict_step"):
            if callable(getattr(model, step, None)):
                register_fsdp_forward_method(model, step)


def _output_heads(model: nn.Module) -> set[int]:
    """The ids of the output heads the model's modules name (transformers' ``get_output_embeddings()``)."""
    heads = set()
    for m in model.modules():
        get = getattr(m, "get_output_embeddings", None)
        if callable(get):
            try:
                head = get()
            except (NotImplementedError, AttributeError):  # a base class without a head
                continue
            if isinstance(head, nn.Module):
                heads.add(id(head))
    return heads


def _shards_anything(module: nn.Module) -> bool:
    from fly_lightning.dtensor import is_dtensor

    return any(is_dtensor(p) for p in module.parameters())


def _build(pl: Any) -> dict[str, type]:
    """Strategy classes for one Lightning package (``lightning.pytorch`` or ``pytorch_lightning``)."""
    strategies = importlib.import_module(f"{pl.__name__}.strategies")
    model_helpers = importlib.import_module(f"{pl.__name__}.utilities.model_helpers")

    class FlySingleDeviceStrategy(_FlyStrategyMixin, strategies.SingleDeviceStrategy):
        """Single device, taken from the Trainer: ``Trainer(strategy="flydsl", accelerator="gpu", devices=[1])``."""

        strategy_name = "flydsl"

        def __init__(self, device: torch.device | str | int | None = None, **kwargs: Any) -> None:
            super().__init__(device=device if device is not None else "cpu", **kwargs)
            self._device_given = device is not None

        # Lightning's connector hands the devices it resolved to strategies that expose `parallel_devices`
        @property
        def parallel_devices(self) -> list[torch.device]:
            return [self.root_device] if self._device_given else []

        @parallel_devices.setter
        def parallel_devices(self, devices: list[torch.device]) -> None:
            if len(devices) != 1:
                raise ValueError(
                    f"strategy 'flydsl' runs on one device, got {len(devices)}; use 'flydsl_ddp', 'flydsl_fsdp2' or "
                    "'flydsl_model_parallel' for several"
                )
            self._root_device = torch.device(devices[0]) if not isinstance(devices[0], torch.device) else devices[0]
            self._device_given = True

    class FlyDDPStrategy(_FlyStrategyMixin, strategies.DDPStrategy):
        strategy_name = "flydsl_ddp"

        def _setup_model(self, model: nn.Module) -> Any:
            # frozen MX weights are buffers, which DDP would send from rank 0 before every forward (the whole frozen
            # model, each step): they are constants, sent once here instead
            from fly_lightning.quant.frozen import frozen_buffer_names

            names = frozen_buffer_names(model)
            if not names:
                return super()._setup_model(model)
            ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
            model._ddp_params_and_buffers_to_ignore = sorted(ignored | set(names))
            wrapped = super()._setup_model(model)
            for name in names:
                torch.distributed.broadcast(model.get_buffer(name), src=0)
            return wrapped

    class _FullCheckpoints:
        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
            loaded = _load_full_checkpoint(self, checkpoint_path, weights_only)
            return loaded if loaded is not None else super().load_checkpoint(checkpoint_path, weights_only)

    class FlyModelParallelStrategy(_FlyStrategyMixin, _FullCheckpoints, strategies.ModelParallelStrategy):
        strategy_name = "flydsl_model_parallel"
        _fly_shards_parameters = True

        def _fly_tensor_parallel(self) -> bool:
            size = self._tensor_parallel_size
            return (self.num_processes if size == "auto" else size) > 1  # Lightning's "auto": the devices per node

    class FlyFSDP2Strategy(_FlyStrategyMixin, _FullCheckpoints, strategies.ModelParallelStrategy):
        """FSDP2 on a 1-D mesh. Unless a user ``configure_model`` shards the model, blocks of ``nn.ModuleList``s and
        the root are sharded with ``fully_shard``."""

        strategy_name = "flydsl_fsdp2"
        _fly_shards_parameters = True

        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("tensor_parallel_size", 1)
            super().__init__(**kwargs)

        def setup_environment(self) -> None:
            if self._data_parallel_size == "auto":  # Lightning's "auto" is one replica per node: FSDP2 spans all
                self._data_parallel_size = self.world_size
            super().setup_environment()
            module = self.lightning_module
            if module is None:
                return
            ours = module.__dict__.get("configure_model")
            if getattr(ours, "_fly_auto", False):  # a later Trainer replaces ours (it holds this strategy's mesh)
                user = ours._fly_user
            else:
                user = module.configure_model if model_helpers.is_overridden("configure_model", module) else None

            # an instance attribute counts as an override for Lightning, and runs at the usual hook point. A user's
            # configure_model runs first; one that shards nothing (it only builds layers) gets the default wrapping:
            # unsharded, the ranks would train apart (nothing here averages their gradients)
            def auto_shard() -> None:
                if user is not None:
                    user()
                if user is None or not _shards_anything(module):
                    _auto_fully_shard(self, module)

            auto_shard._fly_auto, auto_shard._fly_user = True, user
            module.configure_model = auto_shard

    classes = [FlySingleDeviceStrategy, FlyDDPStrategy, FlyFSDP2Strategy, FlyModelParallelStrategy]
    return {cls.strategy_name: cls for cls in classes}


def register(package: str = "lightning.pytorch") -> dict[str, type]:
    """Register the strategies in one Lightning package's ``StrategyRegistry``; returns the classes by name."""
    pl = importlib.import_module(package)
    registry = importlib.import_module(f"{package}.strategies").StrategyRegistry
    classes = _build(pl)
    prefix = "" if package == "lightning.pytorch" else package.title().replace("_", "")
    for name, cls in classes.items():
        # module-level names, so pickle finds the classes (start_method="spawn" pickles the strategy)
        cls.__module__, cls.__qualname__ = __name__, prefix + cls.__name__
        globals()[cls.__qualname__] = cls
        registry.register(name, cls, description=(cls.__doc__ or name).split("\n")[0], override=True)
    return classes


_LIGHTNING = register("lightning.pytorch")
FlySingleDeviceStrategy = _LIGHTNING["flydsl"]
FlyDDPStrategy = _LIGHTNING["flydsl_ddp"]
FlyFSDP2Strategy = _LIGHTNING["flydsl_fsdp2"]
FlyModelParallelStrategy = _LIGHTNING["flydsl_model_parallel"]

if importlib.util.find_spec("pytorch_lightning") is not None:
    try:
        PYTORCH_LIGHTNING_STRATEGIES = register("pytorch_lightning")
    except (ImportError, AttributeError) as exc:  # e.g. a pytorch_lightning before 2.4 (no ModelParallelStrategy)
        import warnings

        warnings.warn(
            f"fly_lightning: strategies not registered for the installed pytorch_lightning ({exc}); "
            "`lightning.pytorch` has them",
            stacklevel=2,
        )
