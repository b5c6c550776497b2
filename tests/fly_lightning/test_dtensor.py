"""DTensor inputs (fly_lightning/dtensor.py): local shards where exact, the reference with a recorded reason otherwise.

One process, a gloo process group of world size 1 on a CPU mesh: placements are real DTensor placements, each local
shard is the whole tensor, so the numerics can be compared with the plain reference.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import fly_lightning
from fly_lightning import DISPATCH_LOG
from fly_lightning.ops.rms_norm import rms_norm_reference

H = 32
EPS = 1e-5


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _inputs():
    g = torch.Generator().manual_seed(5)
    return torch.randn(4, 6, H, generator=g), torch.randn(H, generator=g), torch.randn(4, 6, H, generator=g)


def _make(kind, w, mesh):
    if kind == "replicated":
        return distribute_tensor(w, mesh, [Replicate()])
    return w if kind == "plain" else None


def _reference(x, w, grad_out):
    """Plain-tensor output and gradients."""
    xr = x.detach().clone().requires_grad_()
    wr = None if w is None else w.detach().clone().requires_grad_()
    y = rms_norm_reference(xr, wr, EPS)[0]
    (y * grad_out).sum().backward()
    return y.detach(), xr.grad, None if wr is None else wr.grad


def _run(x_dt, w_arg, grad_out):
    x_dt.requires_grad_()
    if w_arg is not None:
        w_arg.requires_grad_()
    y = fly_lightning.rms_norm(x_dt, w_arg, EPS)
    grad = distribute_tensor(grad_out, x_dt.device_mesh, x_dt.placements)
    (y * grad).sum().backward()
    return y


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("weight", ["replicated", "plain", "none"])
@pytest.mark.parametrize("placement", [Replicate(), Shard(0), Shard(1)], ids=str)
def test_replicate_or_leading_dim_shard_runs_on_local_shards(mesh, placement, weight):
    x, w, grad_out = _inputs()
    w_arg = _make(weight, w, mesh)
    x_dt = distribute_tensor(x, mesh, [placement])
    y = _run(x_dt, w_arg, grad_out)
    assert isinstance(y, DTensor) and y.placements == (placement,)
    y_ref, gx_ref, _ = _reference(x, None if weight == "none" else w, grad_out)
    torch.testing.assert_close(y.full_tensor(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_dt.grad.full_tensor(), gx_ref, rtol=1e-4, atol=1e-5)
    # the dispatcher saw the local shard (a plain tensor) and chose a kernel: no fallback
    (rec,) = DISPATCH_LOG.records("rms_norm")
    assert rec["backend"] == "triton" and not rec["fallback"] and rec["calls"] == 1
    assert rec["shape"].startswith("4x6x32")


@pytest.mark.parametrize("placement", [Replicate(), Shard(0), Shard(1)], ids=str)
def test_local_shard_gradients(mesh, placement):
    x, w, grad_out = _inputs()
    x_dt = distribute_tensor(x, mesh, [placement])
    w_dt = distribute_tensor(w, mesh, [Replicate()])
    _run(x_dt, w_dt, grad_out)
    _, gx_ref, gw_ref = _reference(x, w, grad_out)
    assert x_dt.grad.placements == (placement,)
    torch.testing.assert_close(x_dt.grad.full_tensor(), gx_ref, rtol=1e-4, atol=1e-5)
    # each shard contributes to the replicated weight's gradient: a partial sum when x is sharded (as native DTensor
    # ops give); labelling it Replicate would drop the other ranks' contributions
    expected = (Partial(),) if isinstance(placement, Shard) else (Replicate(),)
    assert w_dt.grad.placements == expected
    torch.testing.assert_close(w_dt.grad.full_tensor(), gw_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("weight", ["replicated", "plain", "none"])
@pytest.mark.parametrize("dim", [2, -1])
def test_shard_on_the_normalised_dim_falls_back_with_reason(mesh, dim, weight):
    x, w, grad_out = _inputs()
    x_dt = distribute_tensor(x, mesh, [Shard(dim)])
    w_arg = _make(weight, w, mesh)
    y = _run(x_dt, w_arg, grad_out)
    y_ref, gx_ref, gw_ref = _reference(x, None if weight == "none" else w, grad_out)
    assert isinstance(y, DTensor)
    torch.testing.assert_close(y.full_tensor(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_full(x_dt.grad), gx_ref, rtol=1e-4, atol=1e-5)
    if w_arg is not None:
        torch.testing.assert_close(_full(w_arg.grad), gw_ref, rtol=1e-4, atol=1e-5)
    (rec,) = DISPATCH_LOG.records("rms_norm")
    assert rec["backend"] == "aten" and rec["fallback"]
    assert "DTensor sharded along reduced dim 2" in rec["reason"]
    # a second call is counted on the same record
    fly_lightning.rms_norm(x_dt.detach(), w_arg.detach() if w_arg is not None else None, EPS)
    assert [r["calls"] for r in DISPATCH_LOG.records("rms_norm")] == [2]


def test_sharded_weight_falls_back_with_reason(mesh):
    x, w, _ = _inputs()
    y = fly_lightning.rms_norm(distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(w, mesh, [Shard(0)]), EPS)
    torch.testing.assert_close(y.full_tensor(), rms_norm_reference(x, w, EPS)[0], rtol=1e-5, atol=1e-5)
    (rec,) = DISPATCH_LOG.records("rms_norm")
    assert rec["fallback"] and "DTensor argument with placements (Shard(dim=0),)" in rec["reason"]


def test_plain_input_with_dtensor_weight_falls_back_with_reason(mesh):
    x, w, _ = _inputs()
    y = fly_lightning.rms_norm(x, distribute_tensor(w, mesh, [Replicate()]), EPS)
    torch.testing.assert_close(_full(y), rms_norm_reference(x, w, EPS)[0], rtol=1e-5, atol=1e-5)
    (rec,) = DISPATCH_LOG.records("rms_norm")
    assert rec["fallback"] and "x is a plain tensor but another argument is a DTensor" in rec["reason"]


def test_fly_rmsnorm_module_on_sequence_sharded_activations(mesh):
    # tensor-parallel style: activations sharded along the sequence, the norm's weight replicated
    norm = nn.RMSNorm(H, eps=EPS)
    with torch.no_grad():
        norm.weight.normal_()
    fly = fly_lightning.FlyRMSNorm.from_module(norm, eps=EPS)
    x, _, _ = _inputs()
    fly.weight = nn.Parameter(distribute_tensor(norm.weight.detach(), mesh, [Replicate()]))
    y = fly(distribute_tensor(x, mesh, [Shard(1)]))
    torch.testing.assert_close(y.full_tensor(), norm(x), rtol=1e-5, atol=1e-5)
    assert [r["backend"] for r in DISPATCH_LOG.records("rms_norm")] == ["triton"]


# --- the transform leaves already-sharded modules -------------------------------------------------------------------


def _replicate_parameters(module, mesh):
    for name, p in list(module.named_parameters(recurse=False)):
        setattr(module, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
    for child in module.children():
        _replicate_parameters(child, mesh)


def test_transform_leaves_modules_with_dtensor_parameters(mesh):
    sharded, plain = nn.RMSNorm(H), nn.RMSNorm(H)
    model = nn.Sequential(sharded, nn.Linear(H, H), plain)
    _replicate_parameters(sharded, mesh)
    summary = fly_lightning.transform(model)
    assert summary.swapped == [("2", "RMSNorm", "rms_norm:torch")]
    assert summary.left == [
        ("0", "RMSNorm", "parameters already sharded (DTensor): transform before fully_shard / parallelize_module")
    ]
    assert model[0] is sharded


def test_transform_leaves_moe_blocks_with_dtensor_parameters(mesh):
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
    blocks = nn.ModuleList([MixtralSparseMoeBlock(cfg), MixtralSparseMoeBlock(cfg)])
    _replicate_parameters(blocks[0], mesh)
    summary = fly_lightning.transform(blocks)
    assert [(p, m) for p, _, m in summary.swapped] == [("1", "moe:hf_v5")]
    assert [(p, c) for p, c, _ in summary.left] == [("0", "MixtralSparseMoeBlock")]
    assert "already sharded (DTensor)" in summary.left[0][2]


def test_two_ranks_gradients_match_the_plain_reference(tmp_path):
    """Sharded over two real ranks: each weight gradient (plain or replicated) is summed over the ranks, on the local
    path (leading dims) and on the reference path (the normalised dim). World size 1 cannot tell a partial sum from a
    total."""
    out = tmp_path / "out.json"
    script = Path(__file__).parent / "scripts" / "dtensor_grads.py"
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results.pop("backends") == ["aten", "triton"]  # both paths ran
    assert {case: r for case, r in results.items() if not all(r.values())} == {}
    assert len(results) == 8


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)], ids=str)
def test_invalid_arguments_raise_on_either_path(mesh, placement):
    x, w, _ = _inputs()
    x_dt = distribute_tensor(x, mesh, [placement])
    with pytest.raises(ValueError, match="weight must have shape"):
        fly_lightning.rms_norm(x_dt, w[:1], EPS)
    with pytest.raises(ValueError, match="eps must be finite"):
        fly_lightning.rms_norm(x_dt, w, -1.0)
    assert DISPATCH_LOG.records("rms_norm") == []


def test_op_without_local_shard_rule_runs_the_reference_recorded(mesh):
    from fly_lightning.ops.swiglu import swiglu_reference

    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    y = fly_lightning.ops.swiglu(distribute_tensor(gate, mesh, [Shard(0)]), distribute_tensor(up, mesh, [Shard(0)]))
    assert isinstance(y, DTensor)
    torch.testing.assert_close(y.full_tensor(), swiglu_reference(gate, up))
    mixed = fly_lightning.ops.swiglu(distribute_tensor(gate, mesh, [Replicate()]), up)  # a plain tensor beside it
    torch.testing.assert_close(mixed.full_tensor(), swiglu_reference(gate, up))
    (rec,) = DISPATCH_LOG.records("swiglu")
    assert rec["backend"] == "aten" and rec["fallback"] and "no local-shard rule" in rec["reason"]


def test_mx_linear_auto_takes_the_emulated_form_on_dtensors(mesh):
    """``FlyMXLinear(kernel_preference="auto")`` on a tensor-parallel weight at few rows: the emulated form (the fake
    quantisation runs on DTensors; the MX cast and GEMM have no sharding rule), equal to the plain module's."""
    from fly_lightning.quant.linear import FlyMXLinear, MXSpec

    torch.manual_seed(0)
    lin = FlyMXLinear(128, 64, bias=False, spec=MXSpec())
    x = torch.randn(16, 128)
    want = lin(x)
    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
    y = lin(distribute_tensor(x, mesh, [Replicate()]))
    torch.testing.assert_close(_full(y), want)
