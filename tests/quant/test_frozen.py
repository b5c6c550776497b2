"""``FlyMXConfig(frozen=True)``: weights stored in MX (uint8 data + E8M0 scales as buffers, no master, no weight
gradient) for ``nn.Linear`` and ``FlyMoE`` experts; forward equal to the training mode's (the same MX operands),
activation gradient through the dequantised weight, bytes per parameter, the master freed, state dict metadata."""

import copy
import gc
import logging
import weakref

import pytest
import torch
from torch import nn

from fly_lightning import FlyMXConfig, mx_filter
from fly_lightning.modules.moe import FlyMoE, moe_reference
from fly_lightning.quant import FlyMXFrozenExperts, FlyMXFrozenLinear, FlyMXLinear, formats
from fly_lightning.quant.frozen import fsdp2_shards_integer_parameters

logging.getLogger("torchao").setLevel(logging.ERROR)
quantize_ = pytest.importorskip("torchao.quantization").quantize_
FORMATS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1"]
# frozen MX weights become uint8 parameters for FSDP2 only where its fully_shard takes them (torch 2.12+)
needs_integer_sharding = pytest.mark.skipif(
    not fsdp2_shards_integer_parameters(), reason="this torch's fully_shard refuses integer parameters"
)
BYTES_PER_PARAM = {"mxfp8_e4m3": 1 + 1 / 32, "mxfp8_e5m2": 1 + 1 / 32, "mxfp4_e2m1": 0.5 + 1 / 32}


def _dense() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32))


def _moe(layout: str = "hf") -> FlyMoE:
    torch.manual_seed(0)
    moe = FlyMoE(64, 32, 4, 2, layout=layout)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def _dequant_reference(w: torch.Tensor, fmt: str, mode: str) -> torch.Tensor:
    """The weight as MX stores it, from the reference casts (``formats``), blocks along the last dim."""
    return formats.from_mx(*formats.to_mx(w.detach(), fmt, mode), fmt, dtype=w.dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act", [None, "same"])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_frozen_linear_matches_training_mode_and_dequantised_gradient(fmt, act, mode):
    act = fmt if act == "same" else act
    train, frozen = _dense(), _dense()
    originals = [m.weight.detach().clone() for m in (frozen[0], frozen[2])]
    quantize_(train, FlyMXConfig(fmt, act, mode))
    quantize_(frozen, FlyMXConfig(fmt, act, mode, frozen=True))
    assert [type(m) for m in frozen] == [FlyMXFrozenLinear, nn.ReLU, FlyMXFrozenLinear]
    assert {n for n, _ in frozen.named_parameters()} == {"0.bias", "2.bias"}  # no weight parameter
    assert all(not b.requires_grad and b.dtype == torch.uint8 for b in frozen.buffers() if b.numel())
    x = torch.randn(2, 5, 64)
    xf, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_train = frozen(xf), train(xt)
    assert torch.equal(y, y_train)  # the same MX operands through the same mx_scaled_mm
    g = torch.randn_like(y)
    y.backward(g)
    # grad_x = grad_y @ dequant(W) layer by layer (straight through the activation cast), weights from the reference
    w0, w2 = (_dequant_reference(w, fmt, mode) for w in originals)
    h = frozen[0](x).detach()
    grad_h = (g.reshape(-1, 32) @ w2).reshape(2, 5, 96) * (h > 0)
    torch.testing.assert_close(xf.grad, (grad_h.reshape(-1, 96) @ w0).reshape(2, 5, 64))
    torch.testing.assert_close(frozen[2].bias.grad, g.reshape(-1, 32).sum(0))
    torch.testing.assert_close(frozen[0].dequantized_weight(), w0, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bytes_per_parameter_and_the_master_is_freed(fmt):
    model = _dense()
    masters = [weakref.ref(model[0].weight), weakref.ref(model[2].weight)]
    params = model[0].weight.numel() + model[2].weight.numel()
    quantize_(model, FlyMXConfig(fmt, frozen=True))
    gc.collect()
    assert all(r() is None for r in masters)  # nothing (module, closure, hook) keeps the high-precision weight
    state = model.state_dict()
    mx_bytes = sum(v.numel() * v.element_size() for k, v in state.items() if k.endswith(("_data", "_scale")))
    assert mx_bytes / params == BYTES_PER_PARAM[fmt]
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert buffer_bytes == mx_bytes  # the buffers are the MX bytes and nothing more
    # after a training step the module still holds only uint8 MX bytes and the biases
    model(torch.randn(3, 64, requires_grad=True)).sum().backward()
    floats = [k for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert floats == ["0.bias", "2.bias"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_frozen_experts_bytes_per_parameter_and_the_masters_are_freed(fmt):
    moe = _moe()
    expert_params = sum(p.numel() for p in moe.experts.parameters())
    masters = [weakref.ref(p) for p in moe.experts.parameters()]
    quantize_(moe, FlyMXConfig(fmt, frozen=True), filter_fn=mx_filter)
    gc.collect()
    assert isinstance(moe.experts, FlyMXFrozenExperts) and all(r() is None for r in masters)
    assert [n for n, _ in moe.named_parameters()] == ["gate.weight"]  # the router stays trainable
    mx_bytes = sum(b.numel() * b.element_size() for b in moe.experts.buffers())
    assert mx_bytes / expert_params == BYTES_PER_PARAM[fmt]


def test_state_dict_holds_mx_bytes_and_metadata_and_loads_checked():
    model = _dense()
    quantize_(model, FlyMXConfig("mxfp4_e2m1", None, "rceil", frozen=True))
    state = model.state_dict()
    assert set(state) == {f"{i}.{k}" for i in (0, 2) for k in ("bias", "weight_data", "weight_scale", "_extra_state")}
    assert state["0.weight_data"].shape == (96, 32) and state["0.weight_scale"].shape == (96, 2)
    assert state["0._extra_state"] == {"format": "mxfp4_e2m1", "mode": "rceil", "block_size": 32, "version": 1,
                                       "shape": [96, 64], "activation": None}  # fmt: skip
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for b in fresh.buffers():
            b.zero_()
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.buffers(), model.buffers(), strict=True))
    other = _dense()
    quantize_(other, FlyMXConfig("mxfp4_e2m1", None, "floor", frozen=True))
    with pytest.raises(ValueError, match="mode='rceil'.*mode='floor'"):
        other.load_state_dict(state)
    bad = dict(state, **{"0._extra_state": dict(state["0._extra_state"], version=99)})
    with pytest.raises(ValueError, match="version 99"):
        fresh.load_state_dict(bad)


def test_dtype_follows_module_to_and_autocast():
    model = _dense()
    quantize_(model, FlyMXConfig(frozen=True))
    model.to(torch.bfloat16)  # the uint8 buffers must survive a dtype conversion
    assert model[0].weight_data.dtype == torch.uint8 and model[0].dtype == torch.bfloat16
    x = torch.randn(4, 64)
    assert model(x.bfloat16()).dtype == torch.bfloat16
    model.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    assert y.dtype == torch.bfloat16
    ref = x.bfloat16().float() @ model[0].dequantized_weight().t()  # e4m3 activations: compare loosely
    torch.testing.assert_close(model[0](x.bfloat16().float()), ref + model[0].bias, rtol=0.1, atol=0.1)


def test_a_training_module_freezes_and_a_frozen_one_stays():
    model = _dense()
    quantize_(model, FlyMXConfig())
    assert type(model[0]) is FlyMXLinear
    x = torch.randn(3, 64)
    y = model(x)
    quantize_(model, FlyMXConfig(frozen=True))
    assert type(model[0]) is FlyMXFrozenLinear and torch.equal(model(x), y)
    first = model[0]
    quantize_(model, FlyMXConfig(frozen=True))
    assert model[0] is first


@pytest.mark.parametrize(
    "layout, config",
    [("hf", FlyMXConfig()), ("torchtitan", FlyMXConfig("mxfp4_e2m1", None, "rceil")),
     ("mixtral", FlyMXConfig("mxfp8_e5m2", "mxfp8_e5m2", "rceil")), ("hf_transposed", FlyMXConfig(activation=None))],
)  # fmt: skip
def test_frozen_experts_match_training_mode_forward_and_input_gradient(layout, config):
    train, frozen = _moe(layout), _moe(layout)
    quantize_(train, config, filter_fn=mx_filter)
    quantize_(frozen, FlyMXConfig(config.weight, config.activation, config.mode, frozen=True), filter_fn=mx_filter)
    assert frozen.mx.frozen and "frozen" in repr(frozen)
    # the same expert operands, value for value
    for w, w_frozen in zip(train.experts.projections(), frozen.experts.projections(), strict=True):
        assert (w is None and w_frozen is None) or torch.equal(train.mx.weight(w), w_frozen)
    # training passes gradients through the master and frozen experts have none: their MX values stand in for it,
    # so a training block whose masters hold those values (the cast gives them back unchanged) computes the same
    with torch.no_grad():
        for w in train.experts.projections():
            if w is not None:
                w.copy_(train.mx.weight(w))
    for w, w_frozen in zip(train.experts.projections(), frozen.experts.projections(), strict=True):
        assert (w is None and w_frozen is None) or torch.equal(train.mx.weight(w), w_frozen)
    x = torch.randn(24, 64)
    xt, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_train, y = train(xt), frozen(xf)
    # K-major masters ("hf_transposed") are cast in place, [E, K, N], while frozen experts store [E, N, K]: the GEMMs
    # read the same values in another layout, and sum in another order
    tol = 0 if layout != "hf_transposed" else 1e-5
    torch.testing.assert_close(y, y_train, rtol=tol, atol=tol)
    g = torch.randn_like(y)
    y.backward(g)
    y_train.backward(g)
    torch.testing.assert_close(xf.grad, xt.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(frozen.router_weight.grad, train.router_weight.grad, rtol=tol, atol=tol)
    # the reference (plain torch, the transform's oracle) reads the dequantised experts through projections():
    # a high-precision block holding the training mode's cast weights computes the same
    plain = _moe(layout)
    with torch.no_grad():
        for w in plain.experts.projections():
            if w is not None:
                w.copy_(train.mx.weight(w))
    torch.testing.assert_close(moe_reference(frozen, x), moe_reference(plain, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["plain", "fused"])
def test_backward_dequantises_the_experts_again_instead_of_saving_them(path, monkeypatch):
    moe = _moe()
    moe.path = path
    quantize_(moe, FlyMXConfig(frozen=True), filter_fn=mx_filter)
    calls = []
    operand = FlyMXFrozenExperts.operand
    monkeypatch.setattr(FlyMXFrozenExperts, "operand", lambda s, n, d: calls.append(n) or operand(s, n, d))
    x = torch.randn(24, 64, requires_grad=True)
    y = moe(x)
    assert sorted(calls) == ["down", "gate_up"]
    g = torch.randn_like(y)
    y.backward(g)
    assert sorted(calls[2:]) == ["down", "gate_up"]  # packed as MX by the saved-tensor hooks, rebuilt here
    assert not moe.experts._live and not moe.experts._hooks
    # under outer saved-tensor hooks (activation checkpointing's kind) ours stand aside: same gradient
    grad = x.grad.clone()
    x.grad = None
    calls.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y2 = moe(x)
    y2.backward(g)
    assert len(calls) == 2 and torch.equal(x.grad, grad)


def test_frozen_experts_under_activation_checkpointing():
    moe = _moe()
    quantize_(moe, FlyMXConfig(frozen=True), filter_fn=mx_filter)
    x = torch.randn(24, 64, requires_grad=True)
    y = moe(x)
    (gx,) = torch.autograd.grad(y.sum(), x)
    y_ckpt = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False)
    (gx_ckpt,) = torch.autograd.grad(y_ckpt.sum(), x)
    assert torch.equal(y_ckpt, y) and torch.equal(gx_ckpt, gx)


def test_quantize_a_tiny_model_with_a_moe_block_frozen():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.moe, self.lm_head = nn.Linear(64, 64), _moe(), nn.Linear(64, 16)

        def forward(self, x):
            return self.lm_head(self.moe(self.proj(x)))

    net = Net()
    quantize_(net, FlyMXConfig(frozen=True), filter_fn=mx_filter)
    assert type(net.proj) is FlyMXFrozenLinear and type(net.lm_head) is nn.Linear
    assert isinstance(net.moe.experts, FlyMXFrozenExperts)
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trainable == {"proj.bias", "moe.gate.weight", "lm_head.weight", "lm_head.bias"}
    net(torch.randn(2, 12, 64)).square().mean().backward()
    assert all(net.get_parameter(n).grad is not None for n in trainable)
    state = net.state_dict()
    assert {"moe.experts.gate_up_data", "moe.experts.down_scale", "moe.experts._extra_state"} <= set(state)
    assert state["moe.experts._extra_state"]["shape"] == {"gate_up": [4, 64, 64], "down": [4, 64, 32]}


@needs_integer_sharding
def test_frozen_as_parameters_keeps_values_state_and_dtype():
    # for FSDP2, which shards parameters only: the same tensors as parameters without gradients, once
    from fly_lightning.quant import frozen_as_parameters

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.moe = nn.Linear(64, 64), _moe()

        def forward(self, x):
            return self.moe(self.proj(x))

    net = Net()
    quantize_(net, FlyMXConfig(frozen=True), filter_fn=mx_filter)
    x = torch.randn(2, 12, 64, requires_grad=True)
    y = net(x)
    (gx,) = torch.autograd.grad(y.square().sum(), x)
    keys = list(net.state_dict())
    state = {k: v.clone() for k, v in net.state_dict().items() if isinstance(v, torch.Tensor)}
    mx = ["proj.weight_data", "proj.weight_scale"] + [f"moe.experts.{p}_{s}" for p in ("gate_up", "down")
                                                     for s in ("data", "scale")]  # fmt: skip
    assert frozen_as_parameters(net) == mx and frozen_as_parameters(net) == mx
    params = dict(net.named_parameters())
    assert all(params[n].dtype == torch.uint8 and not params[n].requires_grad for n in mx)
    assert not any(n in dict(net.named_buffers()) for n in mx)
    assert sorted(keys) == sorted(net.state_dict())
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items() if isinstance(v, torch.Tensor))
    net.to(torch.float64)  # floating tensors only: the MX bytes stay
    assert all(params[n].dtype == torch.uint8 for n in mx)
    net.to(torch.float32)
    y2 = net(x)
    (gx2,) = torch.autograd.grad(y2.square().sum(), x)
    assert torch.equal(y2, y) and torch.equal(gx2, gx)
    with pytest.raises(RuntimeError, match="floating point"):
        net.requires_grad_(True)


def test_frozen_modules_under_torch_compile():
    model = _dense()
    quantize_(model, FlyMXConfig("mxfp4_e2m1", frozen=True))
    moe = _moe()
    quantize_(moe, FlyMXConfig(frozen=True), filter_fn=mx_filter)
    for module, x, fullgraph in ((model, torch.randn(8, 64), True), (moe, torch.randn(16, 64), False)):
        x = x.requires_grad_()
        y = module(x)
        g = torch.randn_like(y)
        (gx,) = torch.autograd.grad(y, x, g)
        compiled = torch.compile(module, backend="aot_eager", fullgraph=fullgraph)
        yc = compiled(x)
        (gxc,) = torch.autograd.grad(yc, x, g)
        assert torch.equal(yc, y) and torch.equal(gxc, gx)
    assert not moe.experts._hooks  # the compiled forward entered none (they stand aside under compile)


def test_a_selected_blocks_shared_experts_are_converted_with_it():
    """``quantize_`` does not visit the children of a module its filter selected: the block's handler converts its
    shared experts' Linears itself (its gate stays high precision, as routers do)."""
    shared = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 64))
    moe = FlyMoE(64, 32, 4, 2, shared_experts=shared)
    moe.shared_expert, moe.shared_expert_gate = nn.Linear(64, 64), nn.Linear(64, 1)
    for frozen, kind in ((False, FlyMXLinear), (True, FlyMXFrozenLinear)):
        block = copy.deepcopy(moe)
        quantize_(block, FlyMXConfig(frozen=frozen), filter_fn=lambda m, fqn: isinstance(m, FlyMoE))
        assert block.mx is not None
        assert [type(m) for m in block.shared_experts] == [kind, nn.SiLU, kind]
        assert type(block.shared_expert) is kind and type(block.shared_expert_gate) is nn.Linear
        block(torch.randn(5, 64))


@pytest.mark.parametrize("frozen", [False, True])
def test_moe_block_in_fp16(frozen):
    """An fp16 model (``16-true``): the casts run in fp32 (fp16 is exact there), the block computes in fp16."""
    moe = _moe()
    quantize_(moe, FlyMXConfig(frozen=frozen), filter_fn=mx_filter)
    moe.half()
    y = moe(torch.randn(6, 64).half())
    assert y.dtype == torch.float16 and torch.isfinite(y).all()


def test_frozen_experts_loaded_by_assignment_into_a_meta_model():
    """Deferred init: a meta-device model, converted, then ``load_state_dict(assign=True)``. The non-persistent dtype
    marker stays on meta; the experts take their device from the loaded MX buffers."""
    src = _moe()
    quantize_(src, FlyMXConfig(frozen=True), filter_fn=mx_filter)
    with torch.device("meta"):
        dst = FlyMoE(64, 32, 4, 2)
    quantize_(dst, FlyMXConfig(frozen=True), filter_fn=mx_filter)
    dst.load_state_dict(src.state_dict(), assign=True)
    x = torch.randn(5, 64)
    torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)


@pytest.mark.parametrize("frozen", [False, True])
def test_input_gradient_under_torch_func_grad(frozen):
    """``torch.func.grad`` through the MX Linears (their autograd functions keep ``setup_context`` apart)."""
    model = _dense()
    quantize_(model, FlyMXConfig(frozen=frozen))
    x = torch.randn(3, 64)
    g = torch.func.grad(lambda t: model(t).square().sum())(x)
    xl = x.clone().requires_grad_()
    model(xl).square().sum().backward()
    torch.testing.assert_close(g, xl.grad)


@needs_integer_sharding
def test_frozen_as_parameters_leaves_modules_fully_shard_already_holds():
    # fully_shard fixed their parameter set: they keep buffers (a one-process gloo group, in a subprocess)
    import subprocess
    import sys

    code = """
import os, torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchao.quantization import quantize_
from fly_lightning import FlyMXConfig
from fly_lightning.quant import frozen_as_parameters
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
m = nn.Sequential(nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 64)))
quantize_(m, FlyMXConfig(frozen=True))
mesh = init_device_mesh("cpu", (1,))
fully_shard(m[1], mesh=mesh)
print(frozen_as_parameters(m), sorted(n for n, _ in m.named_buffers() if "weight" in n))
fully_shard(m, mesh=mesh)
print(tuple(m(torch.randn(3, 64)).shape))
dist.destroy_process_group()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-2] == "['0.weight_data', '0.weight_scale'] ['1.0.weight_data', '1.0.weight_scale']"
    assert lines[-1] == "(3, 64)"


_TWO_RANKS = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn

def build(seed=0):
    from torchao.quantization import quantize_
    from fly_lightning import FlyMXConfig, mx_filter
    from fly_lightning.modules.moe import FlyMoE
    torch.manual_seed(seed)
    moe = FlyMoE(64, 32, 4, 2, layout="hf")
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    quantize_(moe, FlyMXConfig(frozen=True), filter_fn=mx_filter)
    return moe

def shard(moe, mesh):
    from torch.distributed.fsdp import fully_shard
    from fly_lightning.quant import frozen_as_parameters
    names = frozen_as_parameters(moe)
    fully_shard(moe, mesh=mesh)
    return fully_shard(nn.Sequential(moe), mesh=mesh), names

def say(rank, *values):  # one write per line: two processes share the pipe, print's writes can interleave
    os.write(1, (f"rank {rank}: " + " ".join(map(str, values)) + "\\n").encode())

def main(rank, port, arg):
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    from torch.distributed.device_mesh import init_device_mesh
    run(rank, init_device_mesh("cpu", (2,)), arg)
    dist.barrier()  # neither rank tears gloo down while the other still talks to it
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
"""


def _two_ranks(tmp_path, body: str, arg: str = "") -> list[str]:
    """Runs ``run(rank, mesh, arg)`` (``body``, with ``build`` / ``shard`` / ``say`` of ``_TWO_RANKS`` in scope) in
    two gloo processes; the lines they ``say``, sorted."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "two_ranks.py"  # a file: spawned processes import their target from it
    script.write_text(body + _TWO_RANKS)
    proc = subprocess.run([sys.executable, str(script), str(port), arg], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sorted(line for line in proc.stdout.splitlines() if line.startswith("rank"))


@needs_integer_sharding
def test_frozen_experts_sharded_by_fsdp2_match_the_unsharded_block(tmp_path):
    # the block's MX experts as parameters, sharded (half the bytes per rank) and resharded after forward, so
    # backward gathers them again; output and input gradient equal the unsharded block's
    body = """
def run(rank, mesh, arg):
    from fly_lightning.quant import FlyMXFrozenExperts
    ref = build()
    root, names = shard(build(), mesh)
    moe = root[0]
    assert isinstance(moe.experts, FlyMXFrozenExperts)
    local = sum(p.to_local().numel() for n, p in moe.named_parameters() if n in names)
    full = sum(b.numel() for n, b in ref.named_buffers() if n in names)
    torch.manual_seed(1 + rank)
    x = torch.randn(16, 64)
    outs = []
    for m in (ref, root):
        xi = x.clone().requires_grad_()
        y = m(xi)
        outs.append((y.detach(), torch.autograd.grad(y.square().sum(), xi)[0]))
    same = all(torch.equal(a, b) for a, b in zip(*outs))
    say(rank, len(names), 2 * local == full, same)
"""
    assert _two_ranks(tmp_path, body) == ["rank 0: 4 True True", "rank 1: 4 True True"]


@needs_integer_sharding
def test_fsdp2_checkpoints_of_frozen_mx_experts_round_trip(tmp_path):
    # the ways a sharded model is saved and restored (Lightning's ModelParallelStrategy uses them): the full state
    # dict gathered (the uint8 bytes and the format's extra state equal the unsharded block's), loaded into a
    # differently seeded sharded model from rank 0 only, and a sharded torch.distributed.checkpoint save / load;
    # each restored model's forward equals the unsharded block's
    body = """
def run(rank, mesh, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    ref = build()
    root, names = shard(build(), mesh)
    full = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    want = {"0." + k: v for k, v in ref.state_dict().items()}
    same_sd = full.keys() == want.keys() and all(
        torch.equal(v, want[k]) if isinstance(v, torch.Tensor) else v == want[k] for k, v in full.items()
    ) and all(full[f"0.{n}"].dtype == torch.uint8 for n in names)
    same_sd = same_sd if rank == 0 else full == {}  # cpu_offload: the full dict on rank 0 only
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    y = ref(x)
    other, _ = shard(build(5), mesh)
    before = torch.equal(other(x), y)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(other, full if rank == 0 else {}, options=opts)
    dcp.save(get_model_state_dict(root), checkpoint_id=path)
    third, _ = shard(build(7), mesh)
    sd = get_model_state_dict(third)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(third, sd)
    say(rank, same_sd, before, torch.equal(other(x), y), torch.equal(third(x), y))
"""
    lines = _two_ranks(tmp_path, body, str(tmp_path / "dcp"))
    assert lines == ["rank 0: True False True True", "rank 1: True False True True"]


@pytest.mark.parametrize("mode", [pytest.param("frozen", marks=needs_integer_sharding), "training"])
def test_mx_under_fsdp2_mixed_precision_compute_in_param_dtype(mode, tmp_path):
    # MixedPrecisionPolicy(param_dtype=bf16) casts the inputs and floating weights, never the MX bytes: frozen layers
    # follow their activations' dtype, so the sharded model equals the unsharded one moved to bf16 (as the training
    # form, whose masters it casts, does). torch 2.11 also casts the uint8 parameters in its all-gather (emulated
    # here by its init_dtype_attrs): the bytes come back exactly, with a warning
    body = """
def run(rank, mesh, arg):
    import warnings
    from torchao.quantization import quantize_
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from fly_lightning import FlyMXConfig, mx_filter
    from fly_lightning.modules.moe import FlyMoE
    from fly_lightning.quant import frozen_as_parameters

    def model():
        torch.manual_seed(0)
        m = nn.Sequential(FlyMoE(64, 32, 4, 2, layout="hf"), nn.Linear(64, 64))
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.3)
        quantize_(m, FlyMXConfig(frozen=arg == "frozen"), filter_fn=mx_filter)
        return m

    def unclamped(self, mp_policy):  # torch 2.11's: integer parameters are cast too
        self.orig_dtype = self.sharded_param.dtype
        self.param_dtype = None if mp_policy.param_dtype == self.orig_dtype else mp_policy.param_dtype
        self.reduce_dtype = None if mp_policy.reduce_dtype == mp_policy.param_dtype else mp_policy.reduce_dtype

    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3 + rank))
    ref = model().to(torch.bfloat16)
    xr = x.clone().requires_grad_()
    yr = ref(xr.to(torch.bfloat16))
    gr = torch.autograd.grad(yr.float().square().sum(), xr)[0]
    mpp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    res = []
    for clamp in (True, False):
        m = model()
        frozen_as_parameters(m)
        orig = FSDPParam.init_dtype_attrs
        if not clamp:  # through the first forward: the root's lazy init reads the policy again
            FSDPParam.init_dtype_attrs = unclamped
        try:
            fully_shard(m[0], mesh=mesh, mp_policy=mpp)
            fully_shard(m, mesh=mesh, mp_policy=mpp)
            xi = x.clone().requires_grad_()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                y = m(xi)
                g = torch.autograd.grad(y.float().square().sum(), xi)[0]
        finally:
            FSDPParam.init_dtype_attrs = orig
        warned = any("converted back to their bytes" in str(w.message) for w in caught)
        res += [y.dtype == torch.bfloat16 and torch.equal(y, yr) and torch.equal(g, gr), warned]
    say(rank, res[0], *res[2:])  # whether this torch's own policy warns depends on its version
"""
    lines = _two_ranks(tmp_path, body, mode)
    warned = mode == "frozen"
    assert lines == [f"rank 0: True True {warned}", f"rank 1: True True {warned}"]


def test_frozen_layers_compute_in_their_inputs_dtype():
    # MX weights have no floating dtype: outside autocast a frozen layer follows its input, as the same layer moved
    # to that dtype does (what FSDP2's MixedPrecisionPolicy relies on)
    x = torch.randn(8, 64)
    for model in (_dense(), nn.Sequential(_moe())):
        quantize_(model, FlyMXConfig(frozen=True), filter_fn=mx_filter)
        assert model(x).dtype == torch.float32
        if isinstance(model[0], FlyMoE):
            model[0].gate.to(torch.bfloat16)  # the router's own weights: the rest is MX
        y = model(x.to(torch.bfloat16))
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, copy.deepcopy(model).to(torch.bfloat16)(x.to(torch.bfloat16)))


def test_frozen_bytes_cast_to_a_float_come_back_exactly_or_are_refused():
    from fly_lightning.quant.frozen import _as_bytes

    b = torch.arange(256, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        with pytest.warns(UserWarning, match="converted back to their bytes exactly"):
            assert torch.equal(_as_bytes(b.to(dtype)), b)
    assert _as_bytes(b) is b
    with pytest.raises(TypeError, match="cannot hold their bytes exactly"):
        _as_bytes(b.to(torch.float8_e4m3fn))


def test_frozen_weights_stay_buffers_where_fsdp2_cannot_shard_integer_parameters(monkeypatch):
    import fly_lightning.quant.frozen as frozen

    monkeypatch.setattr(frozen, "fsdp2_shards_integer_parameters", lambda: False)
    net = _dense()
    quantize_(net, FlyMXConfig(frozen=True), filter_fn=mx_filter)
    before = dict(net.named_buffers())
    with pytest.warns(UserWarning, match="FSDP2 cannot shard integer parameters"):
        assert frozen.frozen_as_parameters(net) == []
    assert dict(net.named_buffers()) == before and not any(p.dtype == torch.uint8 for p in net.parameters())
