"""The ``fault_tolerance`` option under Fabric: torchft's engine started on the model and optimizer ``fabric.setup`` got."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from hp_lightning.core.fault_tolerance import FaultTolerance
from hp_lightning.ft.engine import FaultTolerantHSDP


def start_fault_tolerance(
    config: FaultTolerance, module: nn.Module, optimizers: list[Optimizer], *, models: int, running: Optional[FaultTolerantHSDP]
) -> FaultTolerantHSDP:
    """torchft's quorum and commit over ``module`` and its one optimizer; a step begins at the first forward with gradients.

    Raises:
        ValueError: for more than one model (``models``) or optimizer, or a second setup (``running``).
    """
    if running is not None or len(optimizers) != 1 or models != 1:
        raise ValueError(
            f"HSDPStrategy(fault_tolerance=...) under Fabric supports one model and one optimizer (set up once); got "
            f"{models} model(s) and {len(optimizers)} optimizer(s) in this call"
            f"{' after a previous one' if running is not None else ''}."
        )
    # The strategy's own fault watchdog (its fault_watchdog option) ends the group on a failure.
    ft = FaultTolerantHSDP(config, module, optimizers[0], group_watchdog=False)

    def begin_step_at_first_forward(_module: nn.Module, _args: Any) -> None:
        if not ft.in_step and torch.is_grad_enabled() and _module.training:
            ft.begin_step()

    module.register_forward_pre_hook(begin_step_at_first_forward)
    return ft
