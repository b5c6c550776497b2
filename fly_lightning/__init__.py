"""fly-lightning: hardware kernels behind one dispatcher, for Lightning training of dense and MoE models.

``import fly_lightning`` registers the operators and their kernels.
"""

from fly_lightning import ops
from fly_lightning.backends import BACKENDS
from fly_lightning.dispatch_log import DISPATCH_LOG
from fly_lightning.kernels import load_kernels
from fly_lightning.modules import FlyMoE, FlyRMSNorm
from fly_lightning.ops import *  # noqa: F403  (the public operators, named once: ops.__all__)
from fly_lightning.policy import DispatchConfig, dispatch_config, get_dispatch_config, set_dispatch_config
from fly_lightning.quant.config import FlyMXConfig, mx_filter
from fly_lightning.registry import OPS, get_op
from fly_lightning.transform import TransformSummary, transform

load_kernels()

# registers Trainer(strategy="flydsl" | "flydsl_ddp" | "flydsl_fsdp2" | "flydsl_model_parallel")
from fly_lightning.strategies import (  # noqa: E402
    FlyDDPStrategy,
    FlyFSDP2Strategy,
    FlyModelParallelStrategy,
    FlySingleDeviceStrategy,
)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "DISPATCH_LOG",
    "OPS",
    "DispatchConfig",
    "FlyDDPStrategy",
    "FlyFSDP2Strategy",
    "FlyModelParallelStrategy",
    "FlyMXConfig",
    "mx_filter",
    "FlyMoE",
    "FlyRMSNorm",
    "FlySingleDeviceStrategy",
    "TransformSummary",
    "dispatch_config",
    "get_dispatch_config",
    "get_op",
    "set_dispatch_config",
    "transform",
]
__all__ += ops.__all__
