"""Model transform: swap recognised modules for dispatched ones in place (usable without Lightning)."""

from fly_lightning.transform import moe as _moe  # noqa: F401  (registers its matchers)
from fly_lightning.transform import rms_norm as _rms_norm  # noqa: F401
from fly_lightning.transform.core import Matcher, TransformSummary, register_matcher, transform

__all__ = ["Matcher", "TransformSummary", "register_matcher", "transform"]
