"""``HSDPStrategy`` with :mod:`hp_lightning.faults` wired in, for the fault matrix.

Until the strategy itself makes these calls (the diff proposed for ``hsdp.py``), this subclass
makes them at the same points:

* right after the process group exists: start the :class:`~hp_lightning.faults.FaultWatchdog`,
  then compare the setup settings across ranks before the device mesh is built;
* right after ``parallelize`` and before ``materialize`` (its first collective on the model):
  compare the model's parameters and the sharding units;
* ``on_exception``: report the failure; ``teardown``: stop the watchdog.

Once ``HSDPStrategy`` takes ``fault_watchdog=...`` itself, this module hands out the real class,
so the same tests then check the real strategy.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from lightning.pytorch import Trainer
from typing_extensions import override

from hp_lightning import faults
from hp_lightning.mesh import resolve_mesh_shape
from hp_lightning.strategies import hsdp as hsdp_module
from hp_lightning.strategies.hsdp import HSDPStrategy

STRATEGY_HAS_WATCHDOG = "fault_watchdog" in inspect.signature(HSDPStrategy.__init__).parameters

if STRATEGY_HAS_WATCHDOG:
    GuardedHSDPStrategy = HSDPStrategy
else:

    class GuardedHSDPStrategy(HSDPStrategy):  # type: ignore[no-redef]
        """HSDPStrategy plus ``fault_watchdog``, ``heartbeat_timeout`` and ``failure_exit_grace``."""

        def __init__(
            self,
            *args: Any,
            fault_watchdog: bool = True,
            heartbeat_timeout: float = 120.0,
            failure_exit_grace: float = 30.0,
            **kwargs: Any,
        ) -> None:
            super().__init__(*args, **kwargs)
            if not isinstance(fault_watchdog, bool):
                raise TypeError(f"HSDPStrategy(fault_watchdog=...) expects True or False; got {fault_watchdog!r}.")
            self._fault_watchdog = fault_watchdog
            self._heartbeat_timeout = faults.check_seconds(heartbeat_timeout, "heartbeat_timeout", "HSDPStrategy")
            self._failure_exit_grace = faults.check_seconds(failure_exit_grace, "failure_exit_grace", "HSDPStrategy")
            self._watchdog: Optional[faults.FaultWatchdog] = None

        def _setup_distributed(self) -> None:
            super()._setup_distributed()
            if self._fault_watchdog:
                self._watchdog = self._watchdog or faults.FaultWatchdog(
                    heartbeat_timeout=self._heartbeat_timeout, exit_grace=self._failure_exit_grace
                )
                self._watchdog.start(self.global_rank, self.world_size, faults.local_ranks(self.node_rank, self.num_processes))
            shape = resolve_mesh_shape(
                self._mesh_shape, world_size=self.world_size, num_nodes=self.num_nodes, devices_per_node=self.num_processes
            )
            trainer: Optional[Trainer] = getattr(self.lightning_module, "_trainer", None)
            faults.check_rank_agreement(faults.setup_settings(self, trainer, shape), stage="setup")

        @override
        def setup(self, trainer: Trainer) -> None:
            original = hsdp_module.materialize

            def checked_materialize(model: Any, mesh: Any, init_device: Any) -> bool:
                faults.check_rank_agreement(faults.sharding_settings(model, self._sharded), stage="sharding")
                return original(model, mesh, init_device)

            hsdp_module.materialize = checked_materialize
            try:
                super().setup(trainer)
            finally:
                hsdp_module.materialize = original

        @override
        def on_exception(self, exception: BaseException) -> None:
            if self._watchdog is not None:
                self._watchdog.report(exception)

        @override
        def teardown(self) -> None:
            if self._watchdog is not None:
                self._watchdog.stop()
            super().teardown()
