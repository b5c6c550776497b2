"""Lightning strategies: registration, single-device fit on CPU, and 2-process gloo DDP / FSDP2 runs."""

import json
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from torch import nn

import fly_lightning
from fly_lightning import DISPATCH_LOG, DispatchConfig
from fly_lightning.quant.frozen import fsdp2_shards_integer_parameters

SCRIPT = Path(__file__).parent / "scripts" / "fit.py"


def test_strategies_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    for name, cls in [
        ("flydsl", fly_lightning.FlySingleDeviceStrategy),
        ("flydsl_ddp", fly_lightning.FlyDDPStrategy),
        ("flydsl_fsdp2", fly_lightning.FlyFSDP2Strategy),
        ("flydsl_model_parallel", fly_lightning.FlyModelParallelStrategy),
    ]:
        assert name in StrategyRegistry
        assert isinstance(StrategyRegistry.get(name), cls)


def test_pytorch_lightning_gets_its_own_classes():
    pl = pytest.importorskip("pytorch_lightning")
    trainer = pl.Trainer(strategy="flydsl", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, pl.strategies.SingleDeviceStrategy)
    assert type(trainer.strategy).__name__ == "FlySingleDeviceStrategy"


def test_flydsl_rejects_several_devices_with_a_clear_message():
    with pytest.raises(ValueError, match="flydsl_ddp"):
        L.Trainer(strategy="flydsl", accelerator="cpu", devices=2)


def test_strategies_pickle_for_spawn():
    # start_method="spawn" pickles the strategy: the classes must be importable by name
    import pickle

    for cls in (fly_lightning.FlySingleDeviceStrategy, fly_lightning.FlyDDPStrategy, fly_lightning.FlyFSDP2Strategy):
        assert type(pickle.loads(pickle.dumps(cls()))) is cls


def test_an_old_pytorch_lightning_does_not_break_the_import():
    pytest.importorskip("pytorch_lightning")
    code = (
        "import warnings, pytorch_lightning.strategies as s\n"
        "del s.ModelParallelStrategy  # as before pytorch_lightning 2.4\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import fly_lightning\n"
        "assert fly_lightning.FlyFSDP2Strategy is not None\n"
        "print([str(x.message) for x in w if 'fly_lightning: strategies not registered' in str(x.message)])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "not registered for the installed pytorch_lightning" in proc.stdout


def _run(strategy: str, devices: int, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"{strategy}{''.join('-' + e for e in extra)}.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), strategy, str(devices), str(out), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_single_device_fit_matches_stock_and_swaps(tmp_path):
    ours, stock = _run("flydsl", 1, tmp_path), _run("auto", 1, tmp_path)
    assert ours["strategy"] == "FlySingleDeviceStrategy"
    assert len(ours["swapped"]) == 3  # two block norms and the final norm
    assert ours["dispatch"]["rms_norm"]["by_backend"] == {"triton": 3 * 4}
    assert stock["dispatch"] == {}
    torch.testing.assert_close(ours["losses"], stock["losses"], rtol=1e-4, atol=1e-5)


def test_ddp_two_processes_gloo(tmp_path):
    ours, stock = _run("flydsl_ddp", 2, tmp_path), _run("ddp", 2, tmp_path)
    assert ours["strategy"] == "FlyDDPStrategy"
    assert ours["dispatch"]["rms_norm"]["by_backend"]["triton"] > 0
    torch.testing.assert_close(ours["losses"], stock["losses"], rtol=1e-4, atol=1e-5)


def test_fsdp2_two_processes_gloo(tmp_path):
    ours, stock = _run("flydsl_fsdp2", 2, tmp_path), _run("stock_fsdp2", 2, tmp_path)
    assert ours["strategy"] == "FlyFSDP2Strategy"
    assert ours["dispatch"]["rms_norm"]["by_backend"]["triton"] > 0
    assert ours["left"] == []
    torch.testing.assert_close(ours["losses"], stock["losses"], rtol=1e-4, atol=1e-5)
    # validate after fit with the same Trainer: the automatic sharding must not shard twice
    assert ours["val_losses"] and len(ours["val_losses"]) == len(stock["val_losses"])
    torch.testing.assert_close(ours["val_losses"], stock["val_losses"], rtol=1e-4, atol=1e-5)


def test_mx_training_converted_before_fsdp2_sharding_matches_ddp(tmp_path):
    # FlyMXConfig through the strategy: Linears become FlyMXLinear before FSDP2 shards them; each forward casts the
    # gathered weight, so the losses equal DDP's (which never shards) on the same data split
    fsdp2, ddp = _run("flydsl_fsdp2", 2, tmp_path, "mx"), _run("flydsl_ddp", 2, tmp_path, "mx")
    assert "FlyMXLinear" in fsdp2["modules"] and "FlyMXLinear" in ddp["modules"]
    for out in (fsdp2, ddp):
        assert out["dispatch"]["mx_fake_quantize"]["calls"] > 0  # auto's emulated form on the CPU
    torch.testing.assert_close(fsdp2["losses"], ddp["losses"], rtol=1e-4, atol=1e-5)


def test_ddp_sends_frozen_mx_weights_once(tmp_path):
    # frozen MX weights are buffers: DDP would send them from rank 0 before every forward. The strategy sends them
    # once at setup (the ranks start from different weights here, so that shows) and leaves them out of the per-step
    # sync
    out = _run("flydsl_ddp", 2, tmp_path, "frozen")
    assert "FlyMXFrozenLinear" in out["modules"]
    ranks = [json.loads((tmp_path / f"flydsl_ddp-frozen.json.rank{r}").read_text()) for r in (0, 1)]
    assert ranks[0]["names"] and ranks[0] == ranks[1]
    assert ranks[0]["local_bytes"] == ranks[0]["full_bytes"] and ranks[0]["parameters"] == 0  # buffers, replicated
    assert out["ddp_buffer_bytes"] == 0


@pytest.mark.skipif(not fsdp2_shards_integer_parameters(), reason="this torch's fully_shard refuses integer parameters")
def test_fsdp2_shards_frozen_mx_weights(tmp_path):
    # FSDP2 shards parameters, never buffers: the strategy makes the frozen MX weights parameters without gradients,
    # so each of the two ranks holds half of their bytes; training through them matches DDP, which holds them whole
    fsdp2, ddp = _run("flydsl_fsdp2", 2, tmp_path, "frozen"), _run("flydsl_ddp", 2, tmp_path, "frozen")
    assert "FlyMXFrozenLinear" in fsdp2["modules"]
    ranks = [json.loads((tmp_path / f"flydsl_fsdp2-frozen.json.rank{r}").read_text()) for r in (0, 1)]
    ddp0 = json.loads((tmp_path / "flydsl_ddp-frozen.json.rank0").read_text())
    assert ranks[0]["parameters"] == len(ranks[0]["names"]) > 0
    for r in ranks:
        assert (r["names"], r["checksum"], r["full_bytes"]) == (ddp0["names"], ddp0["checksum"], ddp0["full_bytes"])
    assert ranks[0]["local_bytes"] + ranks[1]["local_bytes"] == ddp0["full_bytes"]
    assert 0.4 * ddp0["full_bytes"] < ranks[0]["local_bytes"] < 0.6 * ddp0["full_bytes"]
    torch.testing.assert_close(fsdp2["losses"], ddp["losses"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("flavour", ["ddp", "fsdp2"])
def test_moe_model_two_processes_gloo_matches_stock(flavour, tmp_path):
    # a transformers Qwen3-MoE: 4 norms and a MoE block per layer plus the final norm swapped, then wrapped (DDP) or
    # sharded (FSDP2)
    stock_name = {"ddp": "ddp", "fsdp2": "stock_fsdp2"}[flavour]
    ours, stock = _run(f"flydsl_{flavour}", 2, tmp_path, "moe"), _run(stock_name, 2, tmp_path, "moe")
    kinds = sorted({matcher for _, _, matcher in ours["swapped"]})
    assert kinds == ["moe:hf_v5", "rms_norm:llama"] and len(ours["swapped"]) == 2 * (4 + 1) + 1, ours["swapped"]
    assert ours["left"] == []
    for op in ("rms_norm", "moe_route"):
        assert set(ours["dispatch"][op]["by_backend"]) == {"triton"}, (op, ours["dispatch"][op])
    # fp32 expert GEMMs are outside the Triton kernel's support: ATen, with the reason recorded per shape
    gmm = ours["dispatch"]["grouped_mm"]
    assert set(gmm["by_backend"]) == {"aten"} and all("torch.float32" in r for r in gmm["fallback_reasons"]), gmm
    torch.testing.assert_close(ours["losses"], stock["losses"], rtol=1e-4, atol=1e-5)


def _fsdp2_case(case: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{case}.json"
    script = SCRIPT.with_name("fsdp2_cases.py")
    proc = subprocess.run(
        [sys.executable, str(script), case, str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_fsdp2_auto_sharding_serves_a_step_that_calls_the_inner_model(tmp_path):
    # training_step calls self.model(...): the LightningModule's own forward (the root's all-gather) never runs, so
    # the step methods are registered as forwards of the root; the head is tied to the embedding (one parameter, one
    # FSDP group); the blocks hold lists of their own (inner lists sharded before their blocks)
    out = _fsdp2_case("inner_call", tmp_path)
    assert out["sharded"] and len(out["losses"]) == 4
    assert all(torch.isfinite(torch.tensor(out["losses"]))) and out["losses"][-1] < out["losses"][0]


def test_fsdp2_shards_what_a_configure_model_only_builds(tmp_path):
    # a configure_model that only builds layers: left unsharded, the ranks would train apart with nothing averaging
    assert _fsdp2_case("builds_only", tmp_path)["sharded"]


@pytest.mark.parametrize("case", ["full_checkpoint", "sharded_checkpoint"])
def test_fsdp2_checkpoint_of_restacked_experts_resumes(case, tmp_path):
    # save_distributed_checkpoint=False writes one file in the original (per-expert) layout, True a sharded
    # torch.distributed.checkpoint folder; resuming restacks the weights and the AdamW state: the resumed run starts
    # from exactly what the first one ended with
    out = _fsdp2_case(case, tmp_path)
    assert out["sharded"] and len(out["losses"]) == 1 and "net.1.experts.gate_up_proj" in out["saved"]
    assert out["loaded"].keys() == out["saved"].keys()
    for name, (weight, exp_avg, exp_avg_sq, step) in out["saved"].items():
        assert step == 2.0 and out["loaded"][name][3] == step
        for got, want in zip(out["loaded"][name][:3], (weight, exp_avg, exp_avg_sq), strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=0, msg=name)


def test_model_parallel_tensor_parallel_two_processes_gloo(tmp_path):
    # the transform runs before the user's configure_model; the sequence-parallel norms then see DTensor inputs
    # sharded on the sequence dim and run on their local shards (no fallback)
    ours, stock = _run("flydsl_tp", 2, tmp_path), _run("stock_tp", 2, tmp_path)
    assert ours["strategy"] == "FlyModelParallelStrategy"
    assert len(ours["swapped"]) == 3 and ours["left"] == []
    rms = ours["dispatch"]["rms_norm"]
    assert rms["by_backend"] == {"triton": 3 * 4}, rms
    torch.testing.assert_close(ours["losses"], stock["losses"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["mx", "frozen"])
def test_mx_under_tensor_parallelism(mode, tmp_path):
    # a user TP plan over the model: the training form (FlyMXLinear is an nn.Linear) is sharded by the plan and its
    # DTensor ops run the reference (recorded); frozen Linears are no nn.Linear for ColwiseParallel, so they wait
    # for the pass after configure_model, where the plan sharded them: left unquantized with the reason, no crash
    ours, plain = _run("flydsl_tp", 2, tmp_path, mode), _run("flydsl_tp", 2, tmp_path)
    if mode == "mx":
        assert "FlyMXLinear" in ours["modules"] and ours["left"] == []
        assert ours["dispatch"]["mx_fake_quantize"]["by_backend"] == {"aten": 40}
        torch.testing.assert_close(ours["losses"], plain["losses"], rtol=1e-2, atol=1e-2)  # MXFP8 numerics
    else:
        assert "FlyMXFrozenLinear" not in ours["modules"]
        left = {path: reason for path, _, reason in ours["left"]}
        assert sorted(left) == ["head", "layers.0.ff.0", "layers.0.ff.2", "layers.1.ff.0", "layers.1.ff.2"], left
        assert all("converted after configure_model under tensor parallelism" in r for r in left.values())
        torch.testing.assert_close(ours["losses"], plain["losses"], rtol=0, atol=0)


def test_frozen_linears_wait_for_configure_model_under_tensor_parallelism():
    # the two passes of a tensor-parallel strategy: before configure_model frozen Linears are left alone (not marked
    # seen) while experts convert; after it, Linears the plan did not shard convert
    from fly_lightning import FlyMXConfig
    from fly_lightning.modules.moe import FlyMoE
    from fly_lightning.quant import FlyMXFrozenExperts, FlyMXFrozenLinear

    strategy = fly_lightning.FlyModelParallelStrategy(quantization=FlyMXConfig(frozen=True), tensor_parallel_size=2)
    assert strategy._fly_tensor_parallel()
    model = nn.Sequential(nn.Linear(64, 64), FlyMoE(64, 32, 4, 2, layout="hf"))
    strategy._fly_quantize(model, before_configure_model=True)
    assert type(model[0]) is nn.Linear and isinstance(model[1].experts, FlyMXFrozenExperts)
    strategy._fly_quantize(model)
    assert isinstance(model[0], FlyMXFrozenLinear)
    assert not fly_lightning.FlyModelParallelStrategy(tensor_parallel_size=1)._fly_tensor_parallel()


class _Dense(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.RMSNorm(16), nn.Linear(16, 1))

    def training_step(self, batch, _):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        self.norm_type_at_configure_optimizers = type(self.net[1]).__name__
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(strategy, steps=2, model=None):
    data = torch.utils.data.TensorDataset(torch.randn(16, 16), torch.randn(16, 1))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = model if model is not None else _Dense()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    return trainer, model


def test_strategy_options_ops_and_dispatch_policy():
    trainer, model = _fit(fly_lightning.FlySingleDeviceStrategy(ops=(), report=False))
    assert isinstance(model.net[1], nn.RMSNorm)  # nothing swapped
    trainer, model = _fit(fly_lightning.FlySingleDeviceStrategy(dispatch=DispatchConfig(backends=("aten",))))
    assert type(model.net[1]).__name__ == "FlyRMSNorm"
    rec = DISPATCH_LOG.records("rms_norm")[-1]
    assert rec["backend"] == "aten"
    assert fly_lightning.get_dispatch_config() == DispatchConfig()  # restored after fit


def test_optimizer_sees_swapped_parameters():
    # the swap happens before configure_optimizers: the norm is already ours there (the weight itself is shared, so
    # only the module type tells whether the optimizer was built before or after the swap)
    trainer, model = _fit("flydsl")
    assert model.norm_type_at_configure_optimizers == "FlyRMSNorm"
    params = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert id(model.net[1].weight) in params


def test_quantization_slot_applies_a_torchao_config():
    from dataclasses import dataclass

    from torchao.core.config import AOBaseConfig
    from torchao.quantization.transform_module import register_quantize_module_handler

    @dataclass
    class _MarkLinear(AOBaseConfig):
        tag: str = "marked"

    @register_quantize_module_handler(_MarkLinear)
    def _handler(module, config):
        module.fly_test_tag = config.tag
        return module

    trainer, model = _fit(
        fly_lightning.FlySingleDeviceStrategy(
            quantization=_MarkLinear(), quantization_filter=lambda m, fqn: fqn == "net.0"
        )
    )
    assert getattr(model.net[0], "fly_test_tag", None) == "marked"
    assert not hasattr(model.net[2], "fly_test_tag")


class _DenseLate(_Dense):
    """Builds one layer in ``configure_model`` (after the strategy's first pass)."""

    def configure_model(self):
        if not hasattr(self, "late"):
            self.late = nn.Linear(1, 1)

    def training_step(self, batch, _):
        return nn.functional.mse_loss(self.late(self.net(batch[0])), batch[1])


def test_quantization_reaches_modules_built_in_configure_model_once():
    from dataclasses import dataclass

    from torchao.core.config import AOBaseConfig
    from torchao.quantization.transform_module import register_quantize_module_handler

    @dataclass
    class _CountLinear(AOBaseConfig):
        pass

    @register_quantize_module_handler(_CountLinear)
    def _handler(module, config):
        module.fly_test_count = getattr(module, "fly_test_count", 0) + 1
        return module

    strategy = fly_lightning.FlySingleDeviceStrategy(quantization=_CountLinear(), report=False)
    _, model = _fit(strategy, model=_DenseLate())
    counts = {name: getattr(m, "fly_test_count", 0) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert counts == {"net.0": 1, "net.2": 1, "late": 1}


class _ListMoEModule(L.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def training_step(self, batch, _):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_checkpoints_resume_across_strategies_with_restacked_experts(list_moe_model, tmp_path):
    # per-expert Linear lists are restacked by the swap; the optimizer state in the checkpoint stays in the original
    # layout, so a stock checkpoint resumes under "flydsl" and a "flydsl" one under the stock strategy
    torch.manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(16, list_moe_model.H), torch.randn(16, 1))

    def fit(strategy, steps, ckpt_in=None, ckpt_out=None):
        module = _ListMoEModule(list_moe_model())
        flags = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, **flags)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=ckpt_in)
        if ckpt_out:
            trainer.save_checkpoint(ckpt_out)
        return {k: v.detach().clone() for k, v in module.net.state_dict().items()}

    fit("auto", 2, ckpt_out=tmp_path / "stock.ckpt")
    fit("flydsl", 2, ckpt_out=tmp_path / "fly.ckpt")
    saved = torch.load(tmp_path / "fly.ckpt", weights_only=False)["optimizer_states"][0]
    assert len(saved["state"]) == 2 + 1 + 3 * list_moe_model.E + 2  # per-expert pieces, as the stock model has
    reference = fit("auto", 4, ckpt_in=tmp_path / "stock.ckpt")
    for ckpt, strategy in (("stock.ckpt", "flydsl"), ("fly.ckpt", "auto"), ("fly.ckpt", "flydsl")):
        resumed = fit(strategy, 4, ckpt_in=tmp_path / ckpt)
        assert resumed.keys() == reference.keys()
        for k in reference:
            torch.testing.assert_close(resumed[k], reference[k], rtol=1e-4, atol=1e-5, msg=f"{ckpt} -> {strategy}: {k}")


def test_quantization_reports_the_experts_it_cannot_reach(list_moe_model):
    from dataclasses import dataclass

    from torchao.core.config import AOBaseConfig
    from torchao.quantization.transform_module import register_quantize_module_handler

    @dataclass
    class _TagLinear(AOBaseConfig):
        pass

    @register_quantize_module_handler(_TagLinear)
    def _handler(module, config):
        module.fly_test_tag = True
        return module

    strategy = fly_lightning.FlySingleDeviceStrategy(quantization=_TagLinear(), report=False)
    torch.manual_seed(0)
    module = _ListMoEModule(list_moe_model())
    data = torch.utils.data.TensorDataset(torch.randn(8, list_moe_model.H), torch.randn(8, 1))
    flags = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, **flags).fit(
        module, torch.utils.data.DataLoader(data, batch_size=8)
    )
    tagged = sorted(n for n, m in module.named_modules() if getattr(m, "fly_test_tag", False))
    assert tagged == ["net.0", "net.2"]  # the dense Linears; the experts are no longer Linear modules
    (entry,) = [e for e in strategy.transform_summary.left if e[2].startswith("quantization:")]
    assert entry[:2] == ("net.1", "FlyMoE") and "stacked [E, ...] tensors" in entry[2]


def test_left_reason_survives_the_pass_after_sharding(monkeypatch):
    from fly_lightning import strategies
    from fly_lightning.transform import TransformSummary
    from fly_lightning.transform.core import SHARDED

    passes = iter(
        [
            TransformSummary(left=[("net.1", "CenteredNorm", "probe: no variant reproduces the original")]),
            TransformSummary(left=[("net.1", "CenteredNorm", SHARDED), ("late", "FancyNorm", SHARDED)]),
        ]
    )
    monkeypatch.setattr(strategies, "transform", lambda model, ops=None: next(passes))
    strategy = fly_lightning.FlySingleDeviceStrategy(report=False)
    strategy._fly_apply(nn.Linear(1, 1))
    strategy._fly_apply(nn.Linear(1, 1))  # setup(), after FSDP2 sharded what the first pass left
    assert strategy.transform_summary.left == [
        ("net.1", "CenteredNorm", "probe: no variant reproduces the original"),
        ("late", "FancyNorm", SHARDED),  # first seen sharded: that is its reason
    ]


def test_ops_given_as_a_string_is_an_error():
    with pytest.raises(TypeError, match=r"ops=\['rms_norm'\]"):
        fly_lightning.FlySingleDeviceStrategy(ops="rms_norm")


def test_quantization_reports_what_the_mx_handler_left_with_its_reason():
    """Layers ``FlyMXConfig`` selects but cannot convert are in ``transform_summary.left`` with the handler's reason
    (torchao's own MX conversion recognised, not quantized twice; dims off the MX blocks), not only warned about."""
    mx = pytest.importorskip("torchao.prototype.mx_formats")
    from torchao.quantization import quantize_

    from fly_lightning import FlyMoE

    model = nn.Sequential(
        nn.Linear(64, 64, dtype=torch.bfloat16), nn.Linear(64, 40), nn.Linear(40, 8), FlyMoE(48, 40, 4, 2)
    )
    quantize_(model, mx.MXDynamicActivationMXWeightConfig(), filter_fn=lambda m, fqn: fqn == "0")
    strategy = fly_lightning.FlySingleDeviceStrategy(quantization=fly_lightning.FlyMXConfig(), report=False)
    with pytest.warns(UserWarning, match="FlyMXConfig"):
        strategy._fly_apply(model)
    assert type(model[1]).__name__ == "FlyMXLinear" and type(model[2]) is nn.Linear and model[3].mx is None
    left = {path: (cls, reason) for path, cls, reason in strategy.transform_summary.left}
    assert left["0"] == ("Linear", "quantization: already quantized by torchao (MXTensor)")
    assert left["2"] == ("Linear", "quantization: in_features is not a multiple of 32")
    assert left["3"] == ("FlyMoE", "quantization: experts left in high precision: hidden 48 and intermediate 40 "
                         "not a multiple of 32 (MX blocks)")  # fmt: skip
    left_attr = fly_lightning.quant.config.LEFT_ATTR
    assert "1" not in left and not any(hasattr(m, left_attr) for m in model.modules())  # popped once reported
