"""fly-lightning: hardware kernels behind one dispatcher, for Lightning training of dense and MoE models.

``import fly_lightning`` registers the operators and their kernels.
"""

from fly_lightning.backends import BACKENDS, load_kernels
from fly_lightning.dispatch_log import DISPATCH_LOG
from fly_lightning.modules import FlyRMSNorm
from fly_lightning.ops import moe_route, rms_norm, topk
from fly_lightning.policy import DispatchConfig, dispatch_config, get_dispatch_config, set_dispatch_config
from fly_lightning.registry import OPS, get_op

load_kernels()

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "DISPATCH_LOG",
    "OPS",
    "DispatchConfig",
    "FlyRMSNorm",
    "dispatch_config",
    "get_dispatch_config",
    "get_op",
    "moe_route",
    "rms_norm",
    "set_dispatch_config",
    "topk",
]
