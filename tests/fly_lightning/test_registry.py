"""The registry: one list of ops; backends register by decorator; duplicates and unknown backends are errors."""

import pytest
import torch

import fly_lightning
from fly_lightning.dispatch import Op, register_op
from fly_lightning.registry import OPS, get_op


def test_rms_norm_registered_with_its_backends():
    op = get_op("rms_norm")
    assert op is OPS["rms_norm"]
    assert {"aten", "triton"} <= set(op.impls)


def test_unknown_op_lists_registered_ones():
    with pytest.raises(KeyError, match="rms_norm"):
        get_op("no_such_op")


def test_duplicate_registration_rejected():
    with pytest.raises(ValueError, match="already registered"):
        register_op("rms_norm", reference=lambda x: x, signature=lambda x: ())
    op = OPS["rms_norm"]
    with pytest.raises(ValueError, match="registered twice"):
        op.implement("triton")(lambda *a: None)
    with pytest.raises(ValueError, match="unknown backend"):
        op.implement("cuda")(lambda *a: None)


def test_public_ops_are_registered_ops():
    # the public op functions and the registry name the same operators, both ways: an op registered but not exported
    # (or exported under another name) fails here
    assert sorted(fly_lightning.ops.__all__) == sorted(OPS)
    for name in OPS:
        assert callable(getattr(fly_lightning.ops, name)), name
        # the package's top level exports each of them, as the same function
        assert name in fly_lightning.__all__ and getattr(fly_lightning, name) is getattr(fly_lightning.ops, name), name


def test_scratch_op_dispatch_roundtrip():
    op = Op(name="scratch", reference=lambda x: x + 1, signature=lambda x: (x.shape,))
    op.implement("aten")(op.reference)
    assert torch.equal(op(torch.zeros(2)), torch.ones(2))
