"""MX checkpoints (``fly_lightning.quant.checkpoint``): safetensors export/import of MX weights and scales with
metadata, bit-exact round trips across formats and between training and frozen mode, clear errors for mismatched
and corrupted files, atomic writes."""

import copy
import json
import logging
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from fly_lightning import FlyMXConfig, mx_filter
from fly_lightning.modules.moe import FlyMoE
from fly_lightning.quant import MXCheckpointError, formats, load_mx_checkpoint, save_mx_checkpoint
from fly_lightning.quant import checkpoint as ckpt

logging.getLogger("torchao").setLevel(logging.ERROR)
quantize_ = pytest.importorskip("torchao.quantization").quantize_
FORMATS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1"]


class Net(nn.Module):
    def __init__(self, hidden: int = 64, layout: str = "hf"):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.moe = FlyMoE(hidden, 32, 4, 2, layout=layout)
        self.lm_head = nn.Linear(hidden, 16)

    def forward(self, x):
        return self.lm_head(self.moe(self.proj(x)))


def _net(seed: int, config: FlyMXConfig | None, **kw) -> Net:
    torch.manual_seed(seed)
    net = Net(**kw)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3)
        net.proj.weight[0, :32] = 0.0  # a zero block and a subnormal one: the smallest scale
        net.proj.weight[1, :32] = 1e-40
    if config is not None:
        quantize_(net, config, filter_fn=mx_filter)
    return net


def _tensors(path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.mark.parametrize("fmt", FORMATS)
def test_training_export_frozen_import_is_bit_exact(fmt, tmp_path):
    train = _net(0, FlyMXConfig(fmt, fmt, "rceil" if fmt == "mxfp8_e5m2" else "floor"))
    config = FlyMXConfig(fmt, fmt, train.proj.spec.mode, frozen=True)
    frozen = _net(1, config)  # other weights: everything must come from the file
    path = tmp_path / "mx.safetensors"
    keys = save_mx_checkpoint(train, path)
    assert keys == ["proj.weight", "moe.experts.gate_up", "moe.experts.down"]
    tensors, meta = _tensors(path)
    # the file holds exactly the training forward's casts (the reference cast of the masters), as uint8
    data, scale = formats.to_mx(train.proj.weight.detach(), fmt, train.proj.spec.mode)
    assert torch.equal(tensors["proj.weight.data"], data.view(torch.uint8))
    assert torch.equal(tensors["proj.weight.scale"], scale.view(torch.uint8))
    assert all(t.dtype == torch.uint8 for t in tensors.values())
    entry = json.loads(meta["fly_lightning.mx.weights"])["moe.experts.gate_up"]
    assert (entry["format"], entry["shape"], entry["kind"]) == (fmt, [4, 64, 64], "experts")
    assert meta["fly_lightning.mx.version"] == "1" and meta["fly_lightning.mx.block_size"] == "32"
    result = load_mx_checkpoint(frozen, path)
    assert result.loaded == keys and not result.missing and not result.unexpected
    assert torch.equal(frozen.proj.weight_data, tensors["proj.weight.data"])
    assert torch.equal(frozen.moe.experts.down_scale, tensors["moe.experts.down.scale"])
    # the same network: frozen and training forwards agree exactly; routers and head were not in the file
    frozen.moe.gate.weight.data.copy_(train.moe.gate.weight)
    frozen.lm_head.load_state_dict(train.lm_head.state_dict())
    frozen.proj.bias.data.copy_(train.proj.bias)
    x = torch.randn(2, 6, 64)
    assert torch.equal(frozen(x), train(x))
    # and back: the frozen model's export holds the same bytes
    save_mx_checkpoint(frozen, tmp_path / "again.safetensors")
    again, _ = _tensors(tmp_path / "again.safetensors")
    assert again.keys() == tensors.keys() and all(torch.equal(again[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["hf", "torchtitan"])
def test_training_import_sets_masters_that_cast_to_the_same_bytes(fmt, layout, tmp_path):
    src = _net(0, FlyMXConfig(fmt), layout=layout)
    dst = _net(1, FlyMXConfig(fmt), layout=layout)
    save_mx_checkpoint(src, tmp_path / "a.safetensors")
    load_mx_checkpoint(dst, tmp_path / "a.safetensors")
    save_mx_checkpoint(dst, tmp_path / "b.safetensors")
    a, _ = _tensors(tmp_path / "a.safetensors")
    b, _ = _tensors(tmp_path / "b.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(a) == (8 if layout == "torchtitan" else 6)  # gate, up and down apart in torchtitan's layout
    # the masters now hold the dequantised MX values: a forward on them sees what the source's forward saw
    x = torch.randn(5, 64)
    torch.testing.assert_close(dst.proj(x), src.proj(x) - src.proj.bias + dst.proj.bias, rtol=1e-5, atol=1e-5)


def test_frozen_round_trip_mxfp4_weight_only(tmp_path):
    a = _net(0, FlyMXConfig("mxfp4_e2m1", None, "rceil", frozen=True))
    b = _net(1, FlyMXConfig("mxfp4_e2m1", None, "rceil", frozen=True))
    save_mx_checkpoint(a, tmp_path / "a.safetensors")
    load_mx_checkpoint(b, tmp_path / "a.safetensors")
    mx_a = {k: v for k, v in a.state_dict().items() if k.endswith(("_data", "_scale"))}
    mx_b = {k: v for k, v in b.state_dict().items() if k.endswith(("_data", "_scale"))}
    assert mx_a.keys() == mx_b.keys() and all(torch.equal(mx_a[k], mx_b[k]) for k in mx_a)


def _state(net: nn.Module) -> dict:
    return {k: v.clone() for k, v in net.state_dict().items() if isinstance(v, torch.Tensor)}


def _unchanged(net: nn.Module, before: dict) -> bool:
    after = _state(net)
    return after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_mismatched_files_raise_and_leave_the_model_untouched(tmp_path):
    path = tmp_path / "mx.safetensors"
    save_mx_checkpoint(_net(0, FlyMXConfig("mxfp8_e4m3", frozen=True)), path)
    cases = [
        (_net(1, FlyMXConfig("mxfp4_e2m1", frozen=True)), r"proj.weight has format 'mxfp8_e4m3' in the file, "
         r"'mxfp4_e2m1' in the model"),
        (_net(1, FlyMXConfig("mxfp8_e4m3", mode="floor", frozen=True)), "has mode 'rceil' in the file, 'floor'"),
        (_net(1, FlyMXConfig("mxfp8_e4m3", frozen=True), hidden=96), r"has shape \[64, 64\] in the file, \[96, 96\]"),
    ]  # fmt: skip
    for net, match in cases:
        before = _state(net)
        with pytest.raises(MXCheckpointError, match=match):
            load_mx_checkpoint(net, path)
        assert _unchanged(net, before)
    # keys: a model with one more converted Linear, or one fewer
    bigger = _net(1, None)
    bigger.extra = nn.Linear(64, 32)
    quantize_(bigger, FlyMXConfig(frozen=True), filter_fn=mx_filter)
    with pytest.raises(MXCheckpointError, match=r"missing from the file \['extra.weight'\]"):
        load_mx_checkpoint(bigger, path)
    assert load_mx_checkpoint(bigger, path, strict=False).missing == ["extra.weight"]
    smaller = _net(1, FlyMXConfig(frozen=True), layout="hf")
    smaller.proj = nn.Linear(64, 64)  # no longer converted
    with pytest.raises(MXCheckpointError, match=r"not in the model \['proj.weight'\]"):
        load_mx_checkpoint(smaller, path)


def _rewrite(path, out, *, meta=None, tensors=None):
    t, m = _tensors(path)
    t.update(tensors or {})
    m.update(meta or {})
    save_file(t, str(out), metadata=m)


def test_wrong_version_block_size_metadata_or_tensor_raise(tmp_path):
    path = tmp_path / "mx.safetensors"
    net = _net(0, FlyMXConfig(frozen=True))
    save_mx_checkpoint(net, path)
    _, meta = _tensors(path)
    weights = json.loads(meta["fly_lightning.mx.weights"])
    cases = {
        "version 2; this code reads version 1": dict(meta={"fly_lightning.mx.version": "2"}),
        "block size 16": dict(meta={"fly_lightning.mx.block_size": "16"}),
        "unreadable 'fly_lightning.mx.weights'": dict(meta={"fly_lightning.mx.weights": "{not json"}),
        r"tensor proj.weight.data is U8 \[64, 32\], expected U8 \[64, 64\]": dict(
            tensors={"proj.weight.data": torch.zeros(64, 32, dtype=torch.uint8)}
        ),
        r"tensor proj.weight.scale is F8_E8M0 \[64, 2\]": dict(
            tensors={"proj.weight.scale": torch.ones(64, 2, dtype=torch.float8_e8m0fnu)}
        ),
        "kind 'linear' in the file, 'experts'": dict(
            meta={
                "fly_lightning.mx.weights": json.dumps(
                    dict(weights, **{"moe.experts.down": dict(weights["moe.experts.down"], kind="linear")})
                )
            }
        ),  # fmt: skip
    }
    for i, (match, change) in enumerate(cases.items()):
        out = tmp_path / f"bad{i}.safetensors"
        _rewrite(path, out, **change)
        with pytest.raises(MXCheckpointError, match=match):
            load_mx_checkpoint(net, out)
    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, str(plain))
    with pytest.raises(MXCheckpointError, match="not an MX checkpoint"):
        load_mx_checkpoint(net, plain)
    with pytest.raises(MXCheckpointError, match="no such file"):
        load_mx_checkpoint(net, tmp_path / "absent.safetensors")


def test_corrupted_files_raise(tmp_path):
    path = tmp_path / "mx.safetensors"
    net = _net(0, FlyMXConfig(frozen=True))
    save_mx_checkpoint(net, path)
    raw = path.read_bytes()
    at = 8 + int.from_bytes(raw[:8], "little") + 5  # a byte inside the first tensor's data
    corruptions = {
        "truncated": raw[: len(raw) - 100],
        "header length": (10**9).to_bytes(8, "little") + raw[8:],
        "header json": raw[:8] + b"[" + raw[9:],
        "empty": b"",
        "flipped data byte": raw[:at] + bytes([raw[at] ^ 0x10]) + raw[at + 1 :],
    }  # fmt: skip
    for name, blob in corruptions.items():
        bad = tmp_path / f"{name.replace(' ', '_')}.safetensors"
        bad.write_bytes(blob)
        match = "CRC-32" if name == "flipped data byte" else "corrupted or not a safetensors file"
        with pytest.raises(MXCheckpointError, match=match):
            load_mx_checkpoint(net, bad)


def test_a_corrupted_last_tensor_leaves_every_weight_untouched(tmp_path):
    path = tmp_path / "mx.safetensors"
    save_mx_checkpoint(_net(0, FlyMXConfig(frozen=True)), path)
    raw = path.read_bytes()
    net = _net(1, FlyMXConfig(frozen=True))
    last = list(ckpt.mx_targets(net))[-1]  # the key loaded last
    n = int.from_bytes(raw[:8], "little")
    at = 8 + n + json.loads(raw[8 : 8 + n])[f"{last}.data"]["data_offsets"][0]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw[:at] + bytes([raw[at] ^ 0x10]) + raw[at + 1 :])
    before = {k: v.clone() for k, v in net.state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(MXCheckpointError, match="CRC-32"):
        load_mx_checkpoint(net, bad)
    after = net.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the keys before it were not written either


def test_atomic_write_keeps_the_old_file_on_failure_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "mx.safetensors"
    net = _net(0, FlyMXConfig(frozen=True))
    save_mx_checkpoint(net, path)
    good = path.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["mx.safetensors"]

    def half_written(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", half_written)
    with pytest.raises(OSError, match="disk full"):
        save_mx_checkpoint(_net(1, FlyMXConfig(frozen=True)), path)
    assert path.read_bytes() == good and sorted(os.listdir(tmp_path)) == ["mx.safetensors"]
    monkeypatch.undo()
    save_mx_checkpoint(_net(1, FlyMXConfig(frozen=True)), path)  # replaced whole
    assert path.read_bytes() != good and sorted(os.listdir(tmp_path)) == ["mx.safetensors"]
    load_mx_checkpoint(net, path)


def test_a_directory_path_is_refused(tmp_path):
    with pytest.raises(MXCheckpointError, match="a directory; give a file path"):
        save_mx_checkpoint(_net(1, FlyMXConfig(frozen=True)), tmp_path)
    assert os.listdir(tmp_path) == []


def test_a_model_without_mx_weights_is_refused():
    with pytest.raises(MXCheckpointError, match="no weight converted by FlyMXConfig"):
        save_mx_checkpoint(nn.Sequential(nn.Linear(64, 64)), "unused.safetensors")
    assert not os.path.exists("unused.safetensors")
    targets = ckpt.mx_targets(_net(0, FlyMXConfig(), layout="mixtral"))
    assert list(targets) == ["proj.weight", "moe.experts.gate_up", "moe.experts.down"]
    assert copy.deepcopy(targets["proj.weight"].shape) == [64, 64]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_master_values_cast_back_to_the_same_bytes(fmt, mode, dtype):
    f = formats.as_format(fmt)
    torch.manual_seed(0)
    x = torch.randn(64, 8, 32) * torch.logspace(-30, 30, 8).reshape(1, 8, 1)
    x[0] = 0.0  # zero blocks
    x[1] = torch.randn(8, 32) * 1e-39  # subnormal blocks (fp32; flushed in bf16)
    x[2, :, 0] = f.max / 2 * 1.0001  # largest element just above half the format's range: rounds down to it
    x[3, :, 0] = f.max * 2.0 ** torch.arange(-3, 5)  # saturating blocks
    x = x.reshape(64, 256).to(dtype)
    data, scale = formats.to_mx(x, fmt, mode)
    d8, s8 = data.view(torch.uint8), scale.view(torch.uint8)
    back = ckpt.master_values(d8, s8, fmt, mode).to(dtype)
    data2, scale2 = formats.to_mx(back, fmt, mode)
    assert torch.equal(scale2.view(torch.uint8), s8) and torch.equal(data2.view(torch.uint8), d8)
    # and the values are the dequantised ones but where the cast's conventions need another pre-image
    deq = formats.from_mx(data, scale, fmt)
    same = (back.float() == deq) | (scale.view(torch.uint8) == 0).repeat_interleave(32, -1)
    assert same.float().mean() > 0.95


def test_loading_into_a_meta_model_is_refused(tmp_path):
    """``copy_`` into meta tensors writes nothing: a load there would report keys it never set."""
    src = _net(0, FlyMXConfig(frozen=True))
    save_mx_checkpoint(src, tmp_path / "m.safetensors")
    with torch.device("meta"):
        dst = Net()
    quantize_(dst, FlyMXConfig(frozen=True), filter_fn=mx_filter)
    with pytest.raises(MXCheckpointError, match="on the meta device; materialise the model first"):
        load_mx_checkpoint(dst, tmp_path / "m.safetensors")
