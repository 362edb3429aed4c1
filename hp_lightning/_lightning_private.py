"""Every private Lightning name hp_lightning's front ends use, re-exported from one place.

Lightning's public API has no equivalent for these (each line says what it is for). When a
Lightning upgrade moves one, this file is the only place to change, and
``tests/unit/test_private_apis.py`` fails with :func:`missing_private_names`' message.

Checked against lightning 2.6.
"""

from __future__ import annotations

import importlib
from typing import Any

#: The Lightning releases every name below was checked against.
CHECKED_LIGHTNING_VERSIONS = ("2.6",)

_PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    # process-group creation with the cluster environment's address, rank and world size
    ("lightning.fabric.utilities.distributed", "_init_dist_connection"),
    ("lightning.fabric.utilities.distributed", "_distributed_is_initialized"),
    # the path type of Lightning's checkpoint hooks (str | PathLike)
    ("lightning.fabric.utilities.types", "_PATH"),
    # the protocol Lightning checks to save and restore a loader's state (StatefulDataLoader has it)
    ("lightning.fabric.utilities.types", "_Stateful"),
    # Lightning's own all-reduce for logged metrics (sync_dist), and its all-gather (uneven sizes padded)
    ("lightning.fabric.utilities.distributed", "_sync_ddp_if_available"),
    ("lightning.fabric.utilities.distributed", "_all_gather_ddp_if_available"),
    # the launchers Lightning's DDP/FSDP strategies use for `python train.py` runs
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    ("lightning.fabric.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    # Fabric's hook for no_backward_sync
    ("lightning.fabric.strategies.strategy", "_BackwardSyncControl"),
    # the accelerator registry's type (the public registries are instances of it)
    ("lightning.fabric.accelerators.registry", "_AcceleratorRegistry"),
    # the fixed accelerator="auto" chain (hp_lightning.accelerators.auto wraps it on request)
    ("lightning.pytorch.trainer.connectors.accelerator_connector", "_AcceleratorConnector._choose_auto_accelerator"),
    # the one call every rank makes with the resolved ckpt_path (only ranks with a path load)
    ("lightning.pytorch.trainer.connectors.checkpoint_connector", "_CheckpointConnector.resume_start"),
    # SLURM auto-requeue: Lightning's save of the hpc checkpoint and `scontrol requeue`
    ("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector._slurm_sigusr_handler_fn"),
    # whether the running batch is a non-final micro-batch (what Lightning itself decides)
    ("lightning.pytorch.loops.fit_loop", "_FitLoop._should_accumulate"),
    # the per-batch SIGTERM flag broadcast (a world collective and a device read per micro-batch)
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop._broadcast_sigterm_tensor"),
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop.advance"),
)


def _resolve(module_path: str, attribute_path: str) -> bool:
    try:
        obj: Any = importlib.import_module(module_path)
    except ImportError:
        return False
    for part in attribute_path.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def missing_private_names() -> list[str]:
    """The private Lightning names this installation lacks (empty when all are there)."""
    return [f"{m}.{a}" for m, a in _PRIVATE_NAMES if not _resolve(m, a)]


def _load(module_path: str, attribute_path: str) -> Any:
    """One private name, or an ImportError that names it and the versions it was checked against."""
    if not _resolve(module_path, attribute_path):
        import lightning

        raise ImportError(
            f"hp_lightning needs Lightning's private {module_path}.{attribute_path}, which lightning "
            f"{lightning.__version__} lacks (checked against {', '.join(CHECKED_LIGHTNING_VERSIONS)}). "
            f"Install a checked version (pip install 'lightning>=2.6,<2.7') or update hp_lightning/_lightning_private.py."
        )
    obj: Any = importlib.import_module(module_path)
    for part in attribute_path.split("."):
        obj = getattr(obj, part)
    return obj


_DIST = "lightning.fabric.utilities.distributed"
init_dist_connection = _load(_DIST, "_init_dist_connection")
distributed_is_initialized = _load(_DIST, "_distributed_is_initialized")
sync_ddp_if_available = _load(_DIST, "_sync_ddp_if_available")
all_gather_ddp_if_available = _load(_DIST, "_all_gather_ddp_if_available")
PathLike = _load("lightning.fabric.utilities.types", "_PATH")
Stateful = _load("lightning.fabric.utilities.types", "_Stateful")
TrainerSubprocessScriptLauncher = _load("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher")
FabricSubprocessScriptLauncher = _load("lightning.fabric.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher")
BackwardSyncControl = _load("lightning.fabric.strategies.strategy", "_BackwardSyncControl")
AcceleratorRegistryType = _load("lightning.fabric.accelerators.registry", "_AcceleratorRegistry")


def should_accumulate(trainer: Any) -> bool:
    """True while the running training batch is a non-final micro-batch of its window."""
    return bool(trainer.fit_loop._should_accumulate())


def before_resume(trainer: Any, check: Any) -> None:
    """Call ``check(checkpoint_path)`` on every rank just before Lightning reads a checkpoint.

    Lightning resolves ``fit(ckpt_path=...)`` per rank and calls the strategy's
    ``load_checkpoint`` only on ranks that have a path, so no strategy hook sees the path on
    every rank; ``resume_start`` is where each rank gets it (``None`` included). This wraps that
    method of this trainer's connector only (idempotent; nothing global changes).
    """
    connector = trainer._checkpoint_connector
    original = getattr(connector.resume_start, "__hp_lightning_original__", connector.resume_start)

    def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
        check(checkpoint_path)
        original(checkpoint_path, weights_only)

    resume_start.__hp_lightning_original__ = original  # type: ignore[attr-defined]
    connector.resume_start = resume_start


def replace_sigterm_broadcast(trainer: Any, replacement: Any) -> None:
    """Call ``replacement()`` where this trainer's training epoch loop broadcasts its SIGTERM flag.

    Before every training batch (``_TrainingEpochLoop.advance``), Lightning broadcasts from rank 0
    whether its SIGTERM handler fired and reads the flag back (``.item()``): a collective over the
    whole world and a host-device synchronization on every micro-batch. hp_lightning agrees on
    preemption once per optimizer step instead, on a host group; this replaces the method on this
    trainer's loop instance only (nothing global changes; calling it again replaces it again).
    """
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(type(loop), "_broadcast_sigterm_tensor"):  # the version check, at the call
        _load("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop._broadcast_sigterm_tensor")
    loop._broadcast_sigterm_tensor = replacement


def slurm_save_and_requeue(trainer: Any, signum: int) -> None:
    """Lightning's own SLURM auto-requeue: save the ``hpc_ckpt_N.ckpt`` checkpoint, requeue the job.

    Lightning runs it inside its signal handler, where the save (a collective for a sharded
    model) can hang; hp_lightning calls it at a batch every rank reaches together instead.
    """
    trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)


def accelerator_connector_class() -> type:
    """Lightning's ``_AcceleratorConnector`` (where ``accelerator="auto"`` is resolved)."""
    return _load("lightning.pytorch.trainer.connectors.accelerator_connector", "_AcceleratorConnector")
