"""DispatchConfig: candidate order, ATen always last, env vars, context manager, uid sharing."""

import pytest

from fly_lightning.policy import (
    DispatchConfig,
    config_from_env,
    dispatch_config,
    get_dispatch_config,
    set_dispatch_config,
)


def test_aten_is_always_the_last_candidate():
    assert DispatchConfig(backends=("triton",)).candidates("rms_norm") == ("triton", "aten")
    assert DispatchConfig(backends=("aten", "triton")).candidates("x") == ("triton", "aten")
    assert DispatchConfig(backends=()).candidates("x") == ("aten",)


def test_disabled_op_and_global_switch():
    cfg = DispatchConfig(disabled_ops={"rms_norm"})
    assert cfg.candidates("rms_norm") == ("aten",)
    assert cfg.candidates("other") == ("flydsl", "triton", "aten")
    assert DispatchConfig(enabled=False).candidates("other") == ("aten",)


def test_per_op_backend_order_overrides_global():
    cfg = DispatchConfig(backends=("flydsl", "triton"), op_backends={"grouped_mm": ("triton",)})
    assert cfg.candidates("grouped_mm") == ("triton", "aten")
    assert cfg.candidates("rms_norm") == ("flydsl", "triton", "aten")


def test_unknown_backend_and_select_rejected():
    with pytest.raises(ValueError, match="unknown backend"):
        DispatchConfig(backends=("cutlass",))
    with pytest.raises(ValueError, match="select"):
        DispatchConfig(select="fastest")


def test_equal_configs_share_a_uid():
    a = DispatchConfig(disabled_ops={"a", "b"})
    b = DispatchConfig(disabled_ops=frozenset({"b", "a"}))
    assert a.uid == b.uid
    assert a.uid != DispatchConfig().uid


def test_config_is_immutable_and_hashable():
    cfg = DispatchConfig(op_backends={"grouped_mm": ("triton",)})
    with pytest.raises(TypeError):
        cfg.op_backends["rms_norm"] = ("triton",)  # a changed mapping under an unchanged uid would share its cache
    same = DispatchConfig(op_backends={"grouped_mm": ["triton"]})
    assert cfg == same and hash(cfg) == hash(same) and cfg.uid == same.uid
    assert {cfg: 1}[same] == 1


def test_unknown_op_names_reported():
    cfg = DispatchConfig(disabled_ops={"rmsnorm"}, op_backends={"moe_route": ("triton",), "topK": ("triton",)})
    assert cfg.unknown_ops({"rms_norm", "moe_route", "topk", *cfg.inductor_ops}) == ["rmsnorm", "topK"]
    with pytest.raises(ValueError, match=r"unknown operator\(s\) \['rmsnorm', 'topK'\]"):
        set_dispatch_config(cfg)
    assert get_dispatch_config() != cfg  # not set


def test_a_string_for_a_collection_is_an_error():
    with pytest.raises(TypeError, match=r"disabled_ops=\['rms_norm'\]"):
        DispatchConfig(disabled_ops="rms_norm")
    with pytest.raises(TypeError, match=r"backends=\['triton'\]"):
        DispatchConfig(backends="triton")
    with pytest.raises(TypeError, match=r"op_backends\['rms_norm'\] .* \['triton'\]"):
        DispatchConfig(op_backends={"rms_norm": "triton"})


def test_a_pickled_config_takes_this_process_uid():
    """``spawn`` and checkpoints pickle configs: the uid is per process, so an unpickled config must get the one its
    fields have here, never the number it had where it was made."""
    import pickle

    cfg = DispatchConfig(disabled_ops={"rms_norm"})
    blob = pickle.dumps(cfg).replace(b"rms_norm", b"rms_nxrm")  # what another process's config may look like here
    other = pickle.loads(blob)
    assert other.disabled_ops == {"rms_nxrm"} and other.uid != cfg.uid
    assert pickle.loads(pickle.dumps(cfg)).uid == cfg.uid
    import copy

    assert copy.deepcopy(cfg) == cfg and copy.deepcopy(cfg).uid == cfg.uid


def test_env_vars():
    cfg = config_from_env(
        {
            "FLY_LIGHTNING_BACKENDS": "triton",
            "FLY_LIGHTNING_DISABLE": "rms_norm, moe_route",
            "FLY_LIGHTNING_SELECT": "measure",
            "FLY_LIGHTNING_INDUCTOR": "rms_norm, swiglu",
        }
    )
    assert cfg.inductor_ops == {"rms_norm", "swiglu"}
    assert config_from_env({"FLY_LIGHTNING_INDUCTOR": "none"}).inductor_ops == frozenset()
    assert cfg.backends == ("triton", "aten")
    assert cfg.disabled_ops == {"rms_norm", "moe_route"}
    assert cfg.select == "measure"
    assert config_from_env({"FLY_LIGHTNING": "0"}).enabled is False
    assert config_from_env({}) == DispatchConfig()
    # blank is unset for every variable; select is not case-sensitive, as FLY_LIGHTNING is not
    assert config_from_env({"FLY_LIGHTNING_INDUCTOR": " ", "FLY_LIGHTNING_SELECT": ""}) == DispatchConfig()
    assert config_from_env({"FLY_LIGHTNING_SELECT": "Measure"}).select == "measure"


def test_context_manager_restores_previous():
    before = get_dispatch_config()
    with dispatch_config(backends=("aten",)) as cfg:
        assert get_dispatch_config() is cfg
        assert cfg.backends == ("aten",)
    assert get_dispatch_config() is before


def test_set_returns_previous():
    before = get_dispatch_config()
    prev = set_dispatch_config(select="measure")
    try:
        assert prev is before and get_dispatch_config().select == "measure"
    finally:
        set_dispatch_config(prev)
