"""Lightning strategies: HSDPStrategy and its precision plugin."""

from hp_lightning.strategies.hsdp import ACCUMULATION_MODES, STATE_DICT_TYPES, HSDPStrategy
from hp_lightning.strategies.precision import SUPPORTED_PRECISION, HSDPPrecision

__all__ = ["ACCUMULATION_MODES", "HSDPPrecision", "HSDPStrategy", "STATE_DICT_TYPES", "SUPPORTED_PRECISION"]
