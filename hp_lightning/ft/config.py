"""The fault-tolerance option, as :mod:`hp_lightning.ft` has always exported it.

The option and its checks live in :mod:`hp_lightning.core.fault_tolerance`, beside the other
options: validating ``HSDPStrategy(fault_tolerance=...)`` must not import this package (torchft
hooks, checkpoint healing). This module keeps the old import path working.
"""

from hp_lightning.core.fault_tolerance import (
    FROM_ENV,
    GROUP_ENV,
    LIGHTHOUSE_ENV,
    FaultTolerance,
    check_lighthouse_reachable,
    require_torchft,
)

__all__ = ["FROM_ENV", "FaultTolerance", "GROUP_ENV", "LIGHTHOUSE_ENV", "check_lighthouse_reachable", "require_torchft"]
