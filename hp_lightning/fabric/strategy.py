"""HSDPFabricStrategy: Fabric's hooks over :class:`~hp_lightning.frontends.base.StrategyBase`.

Only what Fabric calls: ``init_module``, ``setup`` (with optimizers created before it),
``no_backward_sync``, ``backward``, clipping, ``save`` / ``load`` of a Fabric ``state`` dict, and
the exit without a teardown hook. ``HSDPStrategy`` is the same class under its old name.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from hp_lightning import checkpoint as hp_checkpoint
from hp_lightning._lightning_private import BackwardSyncControl, FabricSubprocessScriptLauncher, PathLike
from hp_lightning.checkpoint.collective import on_rank0
from hp_lightning.checkpoint.layout import StateKeys
from hp_lightning.core.materialize import move_unsharded_states
from hp_lightning.core.options import HSDPOptions
from hp_lightning.fabric import state as fabric_state
from hp_lightning.fabric.fault_tolerance import start_fault_tolerance
from hp_lightning.fabric.optimizers import ReplacedParameters, rebind_optimizer
from hp_lightning.fabric.precision import HSDPPrecision, precision_from_fabric
from hp_lightning.fabric.refusals import NO_CHECKPOINT_IO, refuse_trainer_options
from hp_lightning.frontends.constructors import FabricConstructor
from hp_lightning.ft.engine import FaultTolerantHSDP
from hp_lightning.fully_shard import HSDPModule
from hp_lightning.fully_shard.divergence import check_before_backward
from hp_lightning.recipe.parallelize import ShardedModel
from hp_lightning.recipe.prepare import prepared

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

__all__ = ["HSDPFabricStrategy", "HSDPStrategy"]


class HSDPFabricStrategy(FabricConstructor, ParallelStrategy):
    """FSDP / HSDP training with PyTorch FSDP2 under Lightning Fabric.

    ``Fabric(strategy="hsdp")`` shards every model passed to ``fabric.setup`` with the same plan,
    options (:class:`~hp_lightning.core.options.HSDPOptions`) and checkpoint layout as
    ``Trainer(strategy="hsdp")``, so either front end resumes the other's checkpoints. Under
    ``fabric.no_backward_sync(model)`` non-final micro-batches communicate what
    ``accumulation_mode`` says (nothing, by default).

    Raises:
        TypeError / ValueError: for any option of the wrong type or value, in ``Fabric(...)``;
            ValueError for ``save_on_preemption=True`` or ``pipeline_parallel_size`` above 1;
            TypeError for a ``checkpoint_io`` plugin.
    """

    _mesh_available = "once the processes are set up (after fabric.launch())"
    _launcher_class = FabricSubprocessScriptLauncher

    def _refuse_options(self, options: HSDPOptions, lightning_args: dict[str, Any]) -> None:
        refuse_trainer_options(options, lightning_args["checkpoint_io"])

    def _init_front_end(self) -> None:
        self._backward_sync_control = _NoGradientSync(self)
        self._models: list[nn.Module] = []
        self._replaced = ReplacedParameters()
        self._fault_tolerance: Optional[FaultTolerantHSDP] = None

    # ------------------------------------------------------------------ properties

    @property
    def fault_tolerance(self) -> Optional[FaultTolerantHSDP]:
        """With the ``fault_tolerance`` option, once model and optimizer are set up: torchft's quorum and commit.

        A step begins at the model's first forward with gradients, or call ``begin_step()`` yourself
        before reading the step's data (its :class:`~hp_lightning.ft.Participation` selects the
        share of :class:`~hp_lightning.ft.ParticipantBatches`). ``optimizer.step()`` returns whether it committed.
        """
        return self._fault_tolerance

    def _start_fault_tolerance(self, module: nn.Module, optimizers: list[Optimizer]) -> None:
        config = self.fault_tolerance_config
        if config is not None:
            self._fault_tolerance = start_fault_tolerance(config, module, optimizers, models=len(self._models), running=self._fault_tolerance)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The optimizer's step; under ``fault_tolerance`` torchft's commit vote, which steps it only if committed."""
        if self._fault_tolerance is None:
            return super().optimizer_step(optimizer, **kwargs)
        if kwargs:
            raise TypeError(f"optimizer.step() under fault_tolerance takes no arguments (no closure); got {sorted(kwargs)}.")
        return self._fault_tolerance.commit()

    @property
    def sharded_model(self) -> Optional[ShardedModel]:
        """The root and units of the last model set up (None before)."""
        return prepared(self._models[-1]) if self._models else None

    @property
    @override
    def precision(self) -> HSDPPrecision:
        plugin = self._precision
        if plugin is None:
            plugin = self._precision = HSDPPrecision("32-true")
        return plugin  # type: ignore[return-value]

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        # Set inside Fabric(...): converting here refuses unsupported precisions before any process starts.
        self._precision = None if precision is None else precision_from_fabric(precision)

    @property
    def _hsdp_precision(self) -> HSDPPrecision:
        return self.precision

    def _sharded_roots(self) -> list[nn.Module]:
        return self._models

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        return super().checkpoint_io  # never used for saving: see save_checkpoint

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO) -> None:
        raise TypeError(NO_CHECKPOINT_IO.format(got=type(io).__name__))

    def _watchdog_started(self) -> None:
        assert self._watchdog is not None
        self._watchdog.report_uncaught_errors()  # posted before the traceback prints, not at exit
        atexit.unregister(self._leave_at_exit)  # once per strategy, however often Fabric launches
        atexit.register(self._leave_at_exit)

    # ------------------------------------------------------------------ model and optimizers

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """Where ``fabric.init_module(empty_init=...)`` creates the model's tensors.

        On the meta device unless ``empty_init=False`` or ``meta_init=False`` (None follows the
        option): each rank then allocates only its shards at ``fabric.setup``. Real tensors suit
        loading weights before setup, at the cost of every rank holding the whole model until then.
        """
        stack = ExitStack()
        stack.enter_context(self._init_context(empty_init, self._init_device()))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` in place (after the ``parallelize_fn`` option) and initialize what is on the meta device.

        Sharding replaces the parameters: create optimizers afterwards, or pass them to
        ``fabric.setup(model, optimizer)``, which rebinds them.

        Raises:
            TypeError: for a module wrapped in FSDP1 (``FullyShardedDataParallel``), or a
                ``parallelize_fn`` that returns no module.
        """
        module = self._apply_parallelize_fn(module, in_place=False)
        before = list(module.parameters())
        self._shard(module)
        self._replaced.record(before, module.parameters())
        if all(m is not module for m in self._models):
            self._models.append(module)
        self._report_sharding(lambda: self.sharding_summary(module).table())
        return module

    @override
    def setup_module_and_optimizers(  # type: ignore[override]  # Fabric's base still names torch's deprecated _LRScheduler
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[LRScheduler] = None
    ) -> tuple[nn.Module, list[Optimizer], Optional[LRScheduler]]:
        """Shard ``module``, then point ``optimizers`` at the sharded parameters of the same names (``fabric.setup``).

        Raises:
            ValueError: when an optimizer holds a parameter that is not the model's, or already
                holds state (it stepped before setup): create it after ``fabric.setup_module(model)``.
        """
        names_before = {id(p): (name, p) for name, p in module.named_parameters()}
        module = self.setup_module(module)
        after = dict(module.named_parameters())
        for index, optimizer in enumerate(optimizers):
            rebind_optimizer(optimizer, names_before, after, index)
        self._start_fault_tolerance(module, optimizers)
        return module, optimizers, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Check that ``optimizer`` (``fabric.setup_optimizers``) holds the sharded parameters (ValueError otherwise)."""
        self._replaced.refuse_stale(optimizer, models_set_up=bool(self._models))
        self._start_fault_tolerance(self._models[-1], [optimizer])
        return optimizer

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # Before setup the model stays where it is (sharding allocates only the shards); afterwards only unsharded state moves.
        if prepared(module) is not None:
            move_unsharded_states(module, self.root_device)

    # ------------------------------------------------------------------ backward and clipping

    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        """``fabric.backward(loss)``: first compare across ranks which parameters this backward reaches.

        Ranks reaching different parameters would issue different gradient collectives and hang;
        they raise together instead (:mod:`hp_lightning.fully_shard.divergence`). Call
        ``fabric.backward(loss)``, not ``loss.backward()``.

        Raises:
            RankDivergenceError: on every rank, when some rank's backward reaches other parameters.
        """
        for model in [module] if module is not None else self._models:
            check_before_backward(model, tensor)
        super().backward(tensor, module, *args, **kwargs)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Scale the optimizer's gradients so their global norm (over every shard) is at most ``max_norm``; returns it before clipping."""
        self.precision.unscale_gradients(optimizer)
        return self.precision.clip_norm(optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        self.precision.unscale_gradients(optimizer)
        self.precision.clip_value(optimizer, clip_val)

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(
        self,
        path: PathLike,
        state: dict[str, Union[nn.Module, Optimizer, Any]],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Write ``state`` in the Trainer's checkpoint layout (see :mod:`hp_lightning.fabric.state`), from every rank.

        ``state_dict_type="sharded"``: a directory of every rank's shards (loads into any mesh);
        ``"full"``: one file written by rank 0. Either way the save appears whole or not at all.

        Raises:
            TypeError: for ``storage_options`` (no CheckpointIO plugin is involved).
            ValueError: for ``filter`` (the Trainer's layout stores whole states), for a
                ``state`` without exactly one sharded model, or one using a reserved key.
        """
        if filter is not None:
            raise ValueError(
                f"fabric.save(..., filter=...) is not supported by HSDPStrategy: checkpoints hold whole model and optimizer "
                f"states, as the Trainer's do, so either front end can resume them. Got a filter for {sorted(filter)}; "
                f"save without it (hp_lightning.checkpoint.load_weights(..., strict=False) loads a subset later)."
            )
        parts = fabric_state.split_state(state, "fabric.save")
        target = self._checkpoint_target(path, storage_options)
        if target is None:
            return
        self.reshard_all()
        checkpoint = fabric_state.to_checkpoint(parts, full=self.options.state_dict_type == "full")
        self._write_checkpoint(checkpoint, target, in_background=self.options.async_save)

    @override
    def load_checkpoint(
        self,
        path: PathLike,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Union[nn.Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore ``state`` from a checkpoint of either front end (or any format hp_lightning reads).

        The model and optimizers are loaded in place, resharded to this mesh; LR schedulers and
        objects with ``load_state_dict`` are restored in place, other entries replaced in ``state``.
        A module alone (``fabric.load_raw``) loads its weights only; ``state=None`` returns a
        single file's whole contents. ``weights_only=False`` unpickles anything (trusted files only).

        Returns:
            What the checkpoint holds beyond what ``state`` asked for.

        Raises:
            ValueError: for ``state=None`` on a sharded directory (it has no meaning without a
                model), an optimizer alone, or a ``state`` without exactly one sharded model.
            FileNotFoundError, KeyError, CorruptCheckpointError: as :func:`hp_lightning.checkpoint.load_checkpoint`.
        """
        source = self._checkpoint_source(path)
        if not state:
            if source.is_dir():
                raise ValueError(
                    f"fabric.load({str(source)!r}) without state: a sharded checkpoint is read into a model. Pass "
                    f"state={{'model': model, ...}}, or make one file first: python -m hp_lightning.checkpoint consolidate {source} full.ckpt"
                )
            return hp_checkpoint.read_full_file(source, weights_only=weights_only)
        self.reshard_all()
        if isinstance(state, nn.Module):
            hp_checkpoint.load_weights(state, source, strict=strict, weights_only=weights_only)
            return {}
        if isinstance(state, Optimizer):
            raise ValueError(
                "fabric.load(path, optimizer): an optimizer's sharded state is keyed by the model's parameter names; "
                "pass both: fabric.load(path, {'model': model, 'optimizer': optimizer})."
            )
        parts = fabric_state.split_state(state, "fabric.load")
        record = None
        if len(parts.optimizers) > 1 or len(parts.schedulers) > 1:
            record = on_rank0(lambda: fabric_state.read_record(source, weights_only))
        label = repr(str(source))
        optimizers = fabric_state.in_stored_order(parts.optimizers, (record or {}).get("optimizers"), "optimizers", label)
        schedulers = fabric_state.in_stored_order(parts.schedulers, (record or {}).get("lr_schedulers"), "LR schedulers", label)
        keys = StateKeys(parts.model_key, tuple(k for k, _ in optimizers), tuple(k for k, _ in schedulers))
        rest = hp_checkpoint.load_checkpoint(
            source, parts.model, [o for _, o in optimizers], strict=strict, weights_only=weights_only, keys=keys
        )
        return fabric_state.restore_rest(parts, rest, state, strict=strict, source=label, scheduler_order=schedulers)

    # ------------------------------------------------------------------ teardown

    def _leave_at_exit(self) -> None:
        """At interpreter exit (Fabric has no teardown hook): report an uncaught error, else stop watching."""
        failure = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        self._end_watching(failure if isinstance(failure, BaseException) else None)  # the other ranks stop instead of waiting

    @override
    def teardown(self) -> None:
        """Finish a save in flight, stop the fault watchdog and release the environment (call it when the process goes on without Fabric)."""
        self._stop_background()
        if self._fault_tolerance is not None:
            self._fault_tolerance.shutdown()
            self._fault_tolerance = None
        if self._watchdog is not None:
            atexit.unregister(self._leave_at_exit)
        super().teardown()


class _NoGradientSync(BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the strategy's accumulation mode for non-final micro-batches."""

    def __init__(self, strategy: HSDPFabricStrategy) -> None:
        self._strategy = weakref.proxy(strategy)

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        """What a non-final micro-batch communicates, per the strategy's :attr:`accumulation_mode`; TypeError for an unsharded module."""
        if not enabled:
            return nullcontext()
        if not isinstance(module, HSDPModule):
            raise TypeError(
                f"fabric.no_backward_sync(model) needs the model set up with HSDPStrategy; got a {type(module).__name__} "
                f"that is not sharded. Call model = fabric.setup(model, ...) first."
            )
        return self._strategy._non_final_micro_batch(module)


#: The name this class had before the Trainer and Fabric strategies got distinct ones (kept working).
HSDPStrategy = HSDPFabricStrategy
