"""Every private Lightning name hp_lightning's front ends use, re-exported from one place.

Lightning's public API has no equivalent for these (each entry says what needs it). Guards, as for
torch (:mod:`hp_lightning.core._torch_private`): :func:`missing_private_names` and
:func:`hooks_not_called` (run by ``tests/unit/test_private_apis.py``); on an untested Lightning,
``import hp_lightning`` still works and the first use of a feature that needs a missing name raises
:class:`~hp_lightning.core._torch_private.MissingPrivateNameError` naming it, the feature and the
verified releases. A wrapped method passes on whatever arguments Lightning's caller gives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from hp_lightning.core._torch_private import MissingPrivateNameError, PrivateName, entry_for, missing_error, placeholder_class, resolve, tested_range

#: The Lightning releases hp_lightning is tested on: the oldest it supports (Makefile: ``LIGHTNING_OLDEST``,
#: the compat slice) and the newest (``LIGHTNING_PIN``, the whole suite).
VERIFIED_LIGHTNING: tuple[str, ...] = ("2.6.0", "2.6.6")
#: The Lightning releases hp_lightning supports: the range its verified releases span (``pyproject.toml`` pins the same).
TESTED_LIGHTNING = tested_range(VERIFIED_LIGHTNING)


def _name(module: str, path: str, feature: str) -> PrivateName:
    return PrivateName(module, path, feature, verified=VERIFIED_LIGHTNING)


_DIST = "lightning.fabric.utilities.distributed"
_PRIVATE_NAMES: tuple[PrivateName, ...] = (
    _name(_DIST, "_init_dist_connection", "process-group creation from the cluster environment"),
    _name(_DIST, "_distributed_is_initialized", "the strategies' barrier"),
    _name("lightning.fabric.utilities.types", "_PATH", "the checkpoint hooks' path type"),
    _name("lightning.fabric.utilities.types", "_Stateful", "resumable_dataloaders (telling a stateful loader apart)"),
    _name(_DIST, "_sync_ddp_if_available", "the strategies' all_reduce (logged metrics with sync_dist)"),
    _name(_DIST, "_all_gather_ddp_if_available", "the strategies' all_gather"),
    _name("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher", "launching `python train.py` runs (Trainer)"),
    _name("lightning.fabric.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher", "launching `python train.py` runs (Fabric)"),
    _name("lightning.fabric.strategies.strategy", "_BackwardSyncControl", "fabric.no_backward_sync (HSDPFabricStrategy)"),
    _name("lightning.fabric.accelerators.registry", "_AcceleratorRegistry", "registering the NPU accelerator"),
    _name("lightning.pytorch.trainer.connectors.accelerator_connector", "_AcceleratorConnector._choose_auto_accelerator",
          "accelerator='auto' choosing NPUs (enable_npu_auto_selection)"),
    _name("lightning.pytorch.trainer.connectors.checkpoint_connector", "_CheckpointConnector.resume_start",
          "the checkpoint-path agreement before a resume (fit(ckpt_path=...))"),
    _name("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector._slurm_sigusr_handler_fn",
          "SLURM auto-requeue at a step boundary"),
    _name("lightning.pytorch.loops.fit_loop", "_FitLoop._should_accumulate", "gradient accumulation (which micro-batches skip sync)"),
    _name("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop._broadcast_sigterm_tensor",
          "preemption agreement once per optimizer step (instead of Lightning's per-batch broadcast)"),
)

#: Lightning methods hp_lightning replaces on an instance, or calls itself where Lightning decides:
#: ``(path from the Trainer to the object, method)``. :func:`hooks_not_called` checks that
#: Lightning's own loop still calls each (if it stopped, the replacement would silently do nothing).
PATCHED_HOOKS: tuple[tuple[str, str], ...] = (
    ("_checkpoint_connector", "resume_start"),
    ("fit_loop", "_should_accumulate"),
    ("fit_loop.epoch_loop", "_broadcast_sigterm_tensor"),
)
#: Methods hp_lightning replaces on a Lightning class (on request): ``(module, class, method)``,
#: called by Lightning while a ``Trainer(accelerator="auto")`` is built.
PATCHED_CLASS_HOOKS: tuple[tuple[str, str, str], ...] = (
    ("lightning.pytorch.trainer.connectors.accelerator_connector", "_AcceleratorConnector", "_choose_auto_accelerator"),
)


def _resolve(module_path: str, attribute_path: str) -> bool:
    try:
        resolve(module_path, attribute_path)
    except (ImportError, AttributeError):
        return False
    return True


def missing_private_names(names: Sequence[PrivateName] = _PRIVATE_NAMES) -> list[str]:
    """The private Lightning names (of ``names``) this installation lacks, each resolved attribute by attribute."""
    return [entry.name for entry in names if not _resolve(entry.module, entry.path)]


def _error(module_path: str, attribute_path: str) -> MissingPrivateNameError:
    import lightning

    entry = entry_for(f"{module_path}.{attribute_path}", _PRIVATE_NAMES, VERIFIED_LIGHTNING)
    return missing_error(entry, tested=TESTED_LIGHTNING, version=lightning.__version__)


def _load(module_path: str, attribute_path: str) -> Any:
    """One private name now, or the one clear error (:func:`_error`)."""
    try:
        return resolve(module_path, attribute_path)
    except (ImportError, AttributeError):
        raise _error(module_path, attribute_path) from None


def _function(module_path: str, attribute_path: str) -> Any:
    """A private function, or (missing) a stand-in that raises the clear error when called: ``import`` still works."""
    if _resolve(module_path, attribute_path):
        return resolve(module_path, attribute_path)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise _error(module_path, attribute_path)

    return missing


def _class(module_path: str, attribute_path: str) -> Any:
    """A private class (or type alias), or (missing) a stand-in that refuses instances and isinstance checks."""
    if _resolve(module_path, attribute_path):
        return resolve(module_path, attribute_path)
    return placeholder_class(attribute_path.rpartition(".")[2], lambda: _error(module_path, attribute_path))


init_dist_connection = _function(_DIST, "_init_dist_connection")
distributed_is_initialized = _function(_DIST, "_distributed_is_initialized")
sync_ddp_if_available = _function(_DIST, "_sync_ddp_if_available")
all_gather_ddp_if_available = _function(_DIST, "_all_gather_ddp_if_available")
PathLike = _class("lightning.fabric.utilities.types", "_PATH")
Stateful = _class("lightning.fabric.utilities.types", "_Stateful")
TrainerSubprocessScriptLauncher = _class("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher")
FabricSubprocessScriptLauncher = _class("lightning.fabric.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher")
BackwardSyncControl = _class("lightning.fabric.strategies.strategy", "_BackwardSyncControl")
AcceleratorRegistryType = _class("lightning.fabric.accelerators.registry", "_AcceleratorRegistry")


# ---------------------------------------------------------------- does Lightning still call them?


@contextmanager
def _counting(owner: Any, method: str, counts: dict[str, int], key: str, *, on_class: bool = False) -> Iterator[None]:
    """Count the calls of ``owner.method`` inside the block (on this instance, or on the class), then restore it."""
    original = owner.__dict__[method] if on_class else getattr(owner, method)
    own = None if on_class else owner.__dict__.get(method)  # an instance attribute of its own, to put back
    target = original.__func__ if isinstance(original, staticmethod) else original

    @functools.wraps(target)
    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[key] += 1
        return target(*args, **kwargs)

    setattr(owner, method, staticmethod(counted) if isinstance(original, staticmethod) else counted)
    try:
        yield
    finally:
        if on_class or own is not None:
            setattr(owner, method, original)
        else:
            del owner.__dict__[method]


def hooks_not_called(make_trainer: Callable[[], Any], fit: Callable[[Any], None]) -> list[str]:
    """The patched Lightning methods Lightning did not call while building a Trainer and fitting it.

    Build with ``accelerator="auto"`` (:data:`PATCHED_CLASS_HOOKS`) and fit a plain Lightning
    strategy with more than one rank and gradient accumulation (:data:`PATCHED_HOOKS`: Lightning
    broadcasts its SIGTERM flag only then). Nothing is left changed afterwards.

    Raises:
        MissingPrivateNameError: a hook is missing altogether.
    """
    counts: dict[str, int] = {}
    with ExitStack() as stack:
        for module, cls_name, method in PATCHED_CLASS_HOOKS:
            key = f"{cls_name}.{method}"
            counts[key] = 0
            stack.enter_context(_counting(_load(module, cls_name), method, counts, key, on_class=True))
        trainer = make_trainer()
    with ExitStack() as stack:
        for path, method in PATCHED_HOOKS:
            owner = trainer
            for part in path.split("."):
                owner = getattr(owner, part)
            key = f"{type(owner).__name__}.{method}"
            counts[key] = 0
            if not hasattr(owner, method):
                raise _error(type(owner).__module__, key)
            stack.enter_context(_counting(owner, method, counts, key))
        fit(trainer)
    return [key for key, n in counts.items() if n == 0]


def should_accumulate(trainer: Any) -> bool:
    """True while the running training batch is a non-final micro-batch of its window."""
    try:
        decide = trainer.fit_loop._should_accumulate
    except AttributeError:
        raise _error("lightning.pytorch.loops.fit_loop", "_FitLoop._should_accumulate") from None
    return bool(decide())


def before_resume(trainer: Any, check: Any) -> None:
    """Call ``check(checkpoint_path)`` on every rank just before Lightning reads a checkpoint.

    ``load_checkpoint`` runs only on ranks that have a path; ``resume_start`` sees it (``None``
    included) on every rank. Wraps that method of this trainer's connector only (idempotent).
    """
    connector = trainer._checkpoint_connector
    if not hasattr(type(connector), "resume_start"):  # the version check, at the call
        raise _error("lightning.pytorch.trainer.connectors.checkpoint_connector", "_CheckpointConnector.resume_start")
    original = getattr(connector.resume_start, "__hp_lightning_original__", connector.resume_start)

    def resume_start(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> None:
        check(checkpoint_path)
        original(checkpoint_path, *args, **kwargs)  # 2.6: weights_only

    resume_start.__hp_lightning_original__ = original  # type: ignore[attr-defined]
    connector.resume_start = resume_start


def replace_sigterm_broadcast(trainer: Any, replacement: Any) -> None:
    """Call ``replacement()`` where this trainer's training epoch loop broadcasts its SIGTERM flag.

    That broadcast is a world collective and a host-device sync on every micro-batch; hp_lightning
    agrees once per optimizer step instead. Replaces the method on this loop instance only.
    """
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(type(loop), "_broadcast_sigterm_tensor"):  # the version check, at the call
        raise _error("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop._broadcast_sigterm_tensor")
    loop._broadcast_sigterm_tensor = replacement


def slurm_save_and_requeue(trainer: Any, signum: int) -> None:
    """Lightning's own SLURM auto-requeue (``hpc_ckpt`` save, requeue), called at a batch every rank reaches.

    Lightning runs it inside its signal handler, where the save (a collective) can hang.
    """
    connector = trainer._signal_connector
    if not hasattr(type(connector), "_slurm_sigusr_handler_fn"):  # the version check, at the call
        raise _error("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector._slurm_sigusr_handler_fn")
    connector._slurm_sigusr_handler_fn(signum, None)


def accelerator_connector_class() -> type:
    """Lightning's ``_AcceleratorConnector`` (where ``accelerator="auto"`` is resolved)."""
    return _load("lightning.pytorch.trainer.connectors.accelerator_connector", "_AcceleratorConnector")
