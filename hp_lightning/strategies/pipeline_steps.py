"""How the Trainer strategy's step methods run: directly, or through a pipeline schedule (``pp > 1``).

The strategy delegates its step methods, ``backward``, gradient-sync blocking and state dicts to
one of these, chosen at construction: :class:`DirectSteps` is Lightning's own behaviour;
:class:`PipelineSteps` cuts the model to this rank's stage before sharding, runs torch's schedule
inside ``training_step``, and gathers every stage's state for a full checkpoint.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Optional, cast

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

from hp_lightning import checkpoint as hp_checkpoint
from hp_lightning.parallel.pipeline import (
    AUTO,
    PipelineRunner,
    StagePlan,
    gather_stages_on_rank0,
    hold_gathered,
    plan_cut,
    plan_table,
    stage_reports,
    stays_on_every_stage,
)
from hp_lightning.parallel.pipeline_hf import adapt_hf_decoder_stages, find_hf_decoders, refuse_hf_models_the_adapter_cannot_run
from hp_lightning.parallel.pipeline_schedules import keep_prefetch_inside_stages, rank_of_stage, stage_pieces, stage_view, stages_of_rank
from hp_lightning.recipe.parallelize import planned_units, shard_stage_root

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from hp_lightning.strategies.hsdp import HSDPStrategy


class DirectSteps:
    """Lightning's step methods as they are, with the strategy's accumulation mode for non-final micro-batches."""

    #: Model state-dict keys other stages hold (none without a pipeline).
    elsewhere: frozenset[str] = frozenset()

    def __init__(self, strategy: HSDPStrategy) -> None:
        self.strategy = strategy

    def before_sharding(self, trainer: pl.Trainer) -> None:
        """Nothing to cut."""

    def after_sharding(self) -> None:
        """Nothing to start."""

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return ParallelStrategy.training_step(self.strategy, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return ParallelStrategy.validation_step(self.strategy, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return ParallelStrategy.test_step(self.strategy, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return ParallelStrategy.predict_step(self.strategy, *args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        return ParallelStrategy.backward(self.strategy, closure_loss, optimizer, *args, **kwargs)

    def block_backward_sync(self) -> AbstractContextManager:
        """Non-final micro-batches communicate what the accumulation mode says; under ``"skip"`` the divergence check only records."""
        assert self.strategy.model is not None
        return self.strategy._non_final_micro_batch(self.strategy.model)

    def model_state_dict(self, full: bool) -> dict[str, Any]:
        model = self.strategy.model
        assert model is not None, "checkpoints are taken after the strategy is connected to the model"
        return hp_checkpoint.model_state_dict(model, full=full)

    def optimizer_state(self, optimizer: Optimizer, full: bool) -> dict[str, Any]:
        model = self.strategy.model
        assert model is not None, "checkpoints are taken after the strategy is connected to the model"
        return hp_checkpoint.optimizer_state_dict(model, optimizer, full=full)

    def report_scope(self) -> dict[str, Any]:
        """Extra arguments of the sharding summary (none: it covers the whole mesh)."""
        return {}


class PipelineSteps(DirectSteps):
    """The step methods through torch's pipeline schedule: each rank holds and runs its stage (or, with virtual stages, several)."""

    def __init__(self, strategy: HSDPStrategy) -> None:
        super().__init__(strategy)
        self.runner: Optional[PipelineRunner] = None
        #: Every stage's units and parameter bytes, as cut (the same on every rank); set at setup.
        self.plan: list[StagePlan] = []
        self.elsewhere = frozenset()
        self._views: list[torch.nn.Module] = []
        self._grads_aside: list[tuple[torch.nn.Parameter, Optional[Tensor]]] = []

    def before_sharding(self, trainer: pl.Trainer) -> None:
        """Refuse what PP cannot run yet (before any collective), then cut the model to this rank's stage."""
        strategy = self.strategy
        module = strategy.lightning_module
        assert module is not None and strategy.model is not None
        pp = strategy.options.pipeline_parallel_size
        where = f"HSDPStrategy(pipeline_parallel_size={pp})"
        if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
            raise ValueError(f"{where}: the pipeline schedule runs forward and backward itself, so manual optimization cannot; set automatic_optimization=True.")
        if not is_overridden("forward", module, LightningModule):
            raise ValueError(f"{where}: each stage runs the LightningModule's forward(x) on its part of the model; {type(module).__name__} does not define forward.")
        if trainer.state.fn != TrainerFn.PREDICTING and not callable(getattr(module, "pipeline_loss", None)):
            raise ValueError(
                f"{where}: the last stage computes the loss with the LightningModule's pipeline_loss(output, target), which "
                f"{type(module).__name__} does not define. Add e.g. `def pipeline_loss(self, output, target): return F.mse_loss(output, target)`."
            )
        not_called = [hook for hook in ("training_step", "validation_step", "test_step", "predict_step") if is_overridden(hook, module, LightningModule)]
        if not_called:
            rank_zero_warn(
                f"{where}: the pipeline schedule runs each stage's forward and the last stage's pipeline_loss, so "
                f"{type(module).__name__}'s {not_called} are not called: train_loss / val_loss / test_loss are logged, and "
                f"predict returns the last stage's forward output. Put per-batch work in pipeline_batch / pipeline_loss or a callback."
            )
        pp_mesh = strategy.parallel_mesh.pp
        assert pp_mesh is not None, "PipelineSteps runs only with pipeline_parallel_size > 1"
        options = strategy.options
        if module.__dict__.get("_hp_pipeline_stage") is not None:  # cut by an earlier fit/validate/predict
            self.elsewhere = module.__dict__["_hp_pipeline_elsewhere"]
            self._views = module.__dict__["_hp_pipeline_views"]
            self.plan = module.__dict__["_hp_pipeline_plan"]
            return
        before = set(module.state_dict(keep_vars=True))
        # 'auto' reads parameter sizes only (the meta-device model, before the cut): the same points on every rank.
        cut = plan_cut(module, options, pp_mesh.get_local_rank())  # refuses split points that are not modules
        split_points, stages, num_stages, self.plan = cut.split_points, cut.stages, cut.num_stages, cut.plan
        # A cut HF model the stage forward cannot run fails here, on every rank alike, not at the first step.
        refuse_hf_models_the_adapter_cannot_run(module, split_points, where)
        per_stage = [list(plan.units) for plan in self.plan]
        hf_decoders = find_hf_decoders(module)  # found whole, before the cut
        kept, removed = cut.apply(module)
        self.elsewhere = frozenset(before - set(module.state_dict(keep_vars=True)))
        # A Hugging Face causal LM runs this stage's part of its own forward (the user's forward unchanged).
        adapted = adapt_hf_decoder_stages(module, hf_decoders)
        self._views = self._several_stages(module, per_stage, stages) if len(stages) > 1 else []
        for view in self._views:
            adapt_hf_decoder_stages(view, hf_decoders)
        module.__dict__["_hp_pipeline_stage"] = stages
        module.__dict__["_hp_pipeline_elsewhere"] = self.elsewhere
        module.__dict__["_hp_pipeline_views"] = self._views
        module.__dict__["_hp_pipeline_plan"] = self.plan
        rank_zero_info(
            f"[hp_lightning] pipeline split points {split_points}"
            f"{' (auto: balanced by parameter bytes)' if options.pipeline_split_points == AUTO else ''}; pipeline stage"
            f"{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))} of {num_stages} on pipeline rank 0 of {pp}: "
            f"{kept}; the other ranks hold {len(removed)} more unit(s)"
            + (f"; Hugging Face stage forward: {adapted}" if hf_decoders else "")
        )
        strategy._report_sharding(self.plan_table)

    def _several_stages(self, module: LightningModule, per_stage: list[list[str]], stages: list[int]) -> list[torch.nn.Module]:
        """One module per stage of this rank, sharing the LightningModule's units (each becomes its own FSDP root).

        What no recipe unit owns (the embedding, the head) cannot go to the LightningModule's root,
        which spans the stages: it is sharded here, before the recipe, as one unit per stage.
        """
        strategy = self.strategy
        plan = strategy.sharding_plan()
        held = [unit for stage in stages for unit in per_stage[stage]]
        recipe = [*planned_units(module, plan), *(m for m in module.modules() if isinstance(m, FSDPModule))]
        views = []
        for stage in stages:
            mine = per_stage[stage]
            pieces = stage_pieces(module, mine, recipe)
            if pieces:  # every option of the plan, as the recipe's units get them
                shard_stage_root(module, pieces if len(pieces) > 1 else pieces[0], strategy.parallel_mesh.dp, plan)
            views.append(stage_view(module, [u for u in held if u not in mine and not stays_on_every_stage(module, u)]))
        return views

    def after_sharding(self) -> None:
        strategy = self.strategy
        assert strategy.model is not None and strategy.lightning_module is not None
        mesh, options = strategy.parallel_mesh, strategy.options
        pp_mesh = mesh.pp
        assert pp_mesh is not None, "PipelineSteps runs only with pipeline_parallel_size > 1"
        assert options.pipeline_microbatches is not None, "HSDPOptions resolves pipeline_microbatches=None to the stage count"
        pp, per_rank = options.pipeline_parallel_size, options.pipeline_stages_per_rank
        stages = stages_of_rank(options.pipeline_schedule, pp_mesh.get_local_rank(), pp, per_rank)
        modules: list[torch.nn.Module] = [strategy.model]
        if self._views:
            plan = strategy.sharding_plan()
            for view in self._views:
                if not isinstance(view, FSDPModule):  # each stage its own root, with the whole plan
                    shard_stage_root(strategy.lightning_module, view, mesh.dp, plan)
            keep_prefetch_inside_stages(self._views)
            modules = self._views
        hold_gathered(modules, options)
        self.runner = PipelineRunner(
            modules if len(modules) > 1 else modules[0],
            stage_index=stages if len(stages) > 1 else stages[0],
            num_stages=pp * per_rank,
            device=strategy.root_device,
            group=pp_mesh.get_group(),
            schedule=options.pipeline_schedule,
            microbatches=options.pipeline_microbatches,
            # None only under predict (checked in before_sharding), where no loss is computed.
            loss_fn=cast("Callable[[Any, Any], Tensor]", getattr(strategy.lightning_module, "pipeline_loss", None)),
        )
        strategy.precision_plugin.pipeline_group = pp_mesh.get_group()  # clipping: one norm over every stage

    def _runner(self) -> PipelineRunner:
        assert self.runner is not None, "the pipeline starts at setup"
        return self.runner

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.strategy.lightning_module
        assert module is not None and module.trainer is not None
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        inputs, target = split_batch(module, args, kwargs)
        accumulate = module.trainer.accumulate_grad_batches
        params = list(module.parameters())
        if batch_idx % accumulate == 0:  # a new window: what Lightning's zero_grad would do, before our backward
            for p in params:
                p.grad = None
        with self.strategy.precision_plugin.train_step_context():
            loss = self._runner().step(inputs, target, accumulate=accumulate)
        # The schedule ran backward already; Lightning zeroes gradients after training_step and
        # before backward, so they wait aside until backward() puts them back.
        self._grads_aside = [(p, p.grad) for p in params]
        for p in params:
            p.grad = None
        module.log("train_loss", loss, sync_dist=True)
        return loss

    def _evaluate(self, metric: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        module = self.strategy.lightning_module
        assert module is not None
        inputs, target = split_batch(module, args, kwargs)
        loss, _ = self._runner().evaluate(inputs, target)
        # Without a target the loss is None, which Lightning's log refuses loudly (ValueError).
        module.log(metric, cast(Tensor, loss), sync_dist=True)
        return loss

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("val_loss", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test_loss", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        inputs, _ = split_batch(self.strategy.lightning_module, args, kwargs)
        return self._runner().evaluate(inputs, None, outputs=True)[1]

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        # Lightning's sequence, hooks included, with the schedule's gradients in place of a backward.
        strategy = self.strategy
        module = strategy.lightning_module
        assert module is not None
        strategy.pre_backward(closure_loss)
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, module)
        for p, grad in self._grads_aside:
            p.grad = grad
        self._grads_aside = []
        closure_loss = strategy.precision_plugin.post_backward(closure_loss, module)
        strategy.post_backward(closure_loss)
        return closure_loss

    def block_backward_sync(self) -> AbstractContextManager:
        """The schedule drives each stage's gradient sync itself."""
        return nullcontext()

    def _gather_stages(self, state: dict[str, Any]) -> list[dict[str, Any]]:
        """Every pipeline stage's ``state``, whole, on rank 0 (a collective; empty elsewhere)."""
        return gather_stages_on_rank0(state, stage_leader=self.strategy.parallel_mesh.dp_rank == 0, pipeline_group=self._runner().group)

    def model_state_dict(self, full: bool) -> dict[str, Any]:
        if not full:
            return super().model_state_dict(full)
        stages = self._gather_stages(super().model_state_dict(False))
        return {key: value for stage in stages for key, value in stage.items()}

    def optimizer_state(self, optimizer: Optimizer, full: bool) -> dict[str, Any]:
        state = super().optimizer_state(optimizer, False)
        # Each stage's groups list its own parameters; the checkpoint's list every stage's, in
        # model order, so any mesh (a pipeline of another size, or none) can load it.
        runner = self._runner()
        stage_of = {name: stage for stage, module in zip(runner.stage_indices, runner.stage_modules) for name, _ in module.named_parameters()}
        mine = [[(stage_of.get(name, runner.stage_index), name) for name in group["params"]] for group in state["param_groups"]]
        ranks: list[Any] = [None] * runner.pp_size
        dist.all_gather_object(ranks, mine, group=runner.group)
        for index, group in enumerate(state["param_groups"]):
            # Stage by stage (a rank may hold several, not adjacent), each stage's names in model order.
            entries = [entry for rank in ranks for entry in rank[index]]
            group["params"] = [name for _, name in sorted(entries, key=lambda entry: entry[0])]
        if not full:
            return state
        parts = self._gather_stages(state)
        if not parts:
            return {}
        return {"state": {k: v for part in parts for k, v in part["state"].items()}, "param_groups": state["param_groups"]}

    def _stage_ranks(self) -> list[int]:
        """The pipeline rank of each stage (loop or V placement with virtual stages)."""
        options = self.strategy.options
        pp, per_rank = options.pipeline_parallel_size, options.pipeline_stages_per_rank
        return [rank_of_stage(options.pipeline_schedule, stage, pp, per_rank) for stage in range(pp * per_rank)]

    def plan_table(self) -> str:
        """Every stage's pipeline rank, parameter bytes (whole, before sharding) and units, as cut at setup."""
        return plan_table(self.plan, self._stage_ranks())

    def report_scope(self) -> dict[str, Any]:
        """The report covers this stage's units (its ranks' min/max, its index in the title) and lists every stage's plan."""
        mesh = self.strategy.parallel_mesh
        pp_mesh = mesh.pp
        assert pp_mesh is not None, "PipelineSteps runs only with pipeline_parallel_size > 1"
        stages = stage_reports(self.plan, self._stage_ranks())
        return {"group": mesh.dp_group, "stage": (pp_mesh.get_local_rank(), mesh.layout.pp), "stages": stages}


def split_batch(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(input, target) of a step's batch: the LightningModule's ``pipeline_batch``, else ``batch[0], batch[1]``.

    Raises:
        TypeError: for a batch that is not an (input, target) pair or a tensor, without ``pipeline_batch``.
    """
    batch = args[0] if args else kwargs["batch"]
    split = getattr(module, "pipeline_batch", None)
    if callable(split):
        return split(batch)
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, torch.Tensor):
        return batch, None
    got = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (list, tuple)) else f"a {type(batch).__name__}"
    raise TypeError(
        f"Pipeline: cannot tell input from target in {got} (the default reads (input, target) pairs only, so "
        f"nothing is dropped silently); define pipeline_batch(self, batch) -> (input, target) on the LightningModule."
    )
