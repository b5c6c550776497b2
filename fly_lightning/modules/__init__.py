"""Drop-in modules: same parameters and state_dict keys as the modules they replace."""

from fly_lightning.modules.moe import FlyMoE
from fly_lightning.modules.moe_experts import FlyExperts
from fly_lightning.modules.rms_norm import FlyRMSNorm

__all__ = ["FlyExperts", "FlyMoE", "FlyRMSNorm"]
