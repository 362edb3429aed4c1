"""Running this rank's stage(s): torch's ``PipelineStage`` and schedules, one batch at a time (:class:`PipelineRunner`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from hp_lightning.core import devices
from hp_lightning.parallel.pipeline.ties import TiedCopies, tied_parameters
from hp_lightning.parallel.pipeline_schedules import SCHEDULE_SPECS, rank_of_stage


def PipelineStage(
    submodule: nn.Module,
    stage_index: int,
    stage_num: int,
    device: Optional[torch.device] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> _TorchPipelineStage:
    """The seed's ``PipelineStage(stage_model, stage_index, stage_num=pp_size)``: torch's ``PipelineStage``.

    Args:
        submodule: this rank's stage (already ``fully_shard``-ed over its data-parallel sub-mesh).
        device: where the stage runs (default: the current accelerator, else the CPU).
        group: the pipeline group, e.g. ``mesh["pp"].get_group()``; may be left out only when the
            world is exactly the stages (no data parallelism).

    Raises:
        ValueError: without ``group`` when the world has more ranks than stages.
    """
    if group is None and dist.is_initialized() and dist.get_world_size() != stage_num:
        raise ValueError(
            f"PipelineStage(stage_num={stage_num}) on a world of {dist.get_world_size()} ranks needs the pipeline group: "
            f"pass group=mesh['pp'].get_group() (the ranks that hold this rank's other stages)."
        )
    if device is None:
        device_type = devices.current_accelerator_type()
        module = devices.device_module(device_type)
        device = torch.device(device_type, module.current_device()) if module is not None else devices.cpu_device()
    return _TorchPipelineStage(submodule, stage_index, stage_num, device, group=group)


class PipelineRunner:
    """One rank's stage(s) and schedule; :meth:`step` runs one batch through the pipeline (forward and backward).

    Args:
        stage_module: this rank's stage, an FSDP root (the schedule drives its gradient sync); or,
            with several stages per rank, one root per stage, in ``stage_index`` order.
        stage_index: the stage's index (or the stages' indices, increasing) among ``num_stages``.
        num_stages: stages in the whole pipeline (ranks x stages per rank).
        schedule: a name of :data:`SCHEDULES`; multi-stage schedules take every stage of the rank.
        loss_fn: ``(output, target) -> loss`` of one micro-batch, on the last stage.

    Raises:
        ValueError: a stage with ``replicate_params``, a stage count the schedule cannot run, or ties with several stages per rank.
    """

    def __init__(
        self,
        stage_module: Union[nn.Module, Sequence[nn.Module]],
        *,
        stage_index: Union[int, Sequence[int]],
        num_stages: int,
        device: torch.device,
        group: dist.ProcessGroup,
        schedule: str,
        microbatches: int,
        loss_fn: Callable[[Any, Any], torch.Tensor],
    ) -> None:
        modules = [stage_module] if isinstance(stage_module, nn.Module) else list(stage_module)
        indices = [stage_index] if isinstance(stage_index, int) else list(stage_index)
        replicated = [
            name or "(stage root)" for module in modules for name, m in module.named_modules() if getattr(m, "_hp_replicated", None) is not None
        ]
        if replicated:
            raise ValueError(
                f"PipelineRunner needs a stage without replicate_params; got units with replicate_params at {replicated}. "
                f"torch's pipeline schedules turn gradient sync off for every micro-batch and reduce FSDP's gradients "
                f"themselves, so those parameters would never be all-reduced. Let fully_shard shard them under a pipeline."
            )
        pp = dist.get_world_size(group)
        spec = SCHEDULE_SPECS[schedule]
        per_rank = num_stages // pp
        if len(modules) != len(indices) or num_stages % pp or len(modules) != per_rank or (not spec.multi and per_rank != 1):
            raise ValueError(
                f"PipelineRunner(schedule={schedule!r}): {len(modules)} stage module(s) with indices {indices} do not fit "
                f"{num_stages} stages on {pp} ranks ({'one stage per rank' if not spec.multi else 'the same count on every rank'})."
            )
        if per_rank > 1 and tied_parameters(modules[0]):
            raise ValueError(
                f"Pipeline: parameters tied across stages ({[list(t.names) for t in tied_parameters(modules[0])]}) are kept "
                f"equal only with one stage per rank so far; set pipeline_stages_per_rank=1 or untie them in the model."
            )
        self.stage_indices, self.num_stages, self.pp_size = indices, num_stages, pp
        self.stage_index = indices[0]
        self.microbatches, self.group, self.schedule_name = microbatches, group, schedule
        self.last_rank = rank_of_stage(schedule, num_stages - 1, pp, per_rank) if spec.multi else pp - 1
        self.loss_scale = float(microbatches)
        self._loss_fn = loss_fn
        self._predicting = False
        self.stages = [_TorchPipelineStage(m, i, num_stages, device, group=group) for m, i in zip(modules, indices)]
        self.stage = self.stages[0]
        self.stage_modules = modules
        self.tied = TiedCopies(modules[0], stage_index=indices[0], num_stages=num_stages, group=group)
        # scale_grads=False: the loss is scaled instead, so gradients accumulated over Lightning's
        # accumulate_grad_batches are never divided twice.
        target: Any = self.stages if spec.multi else self.stage
        self.schedule = spec.cls(target, n_microbatches=microbatches, loss_fn=self._scaled_loss, scale_grads=False)

    @property
    def is_first(self) -> bool:
        """This rank feeds the pipeline (holds stage 0)."""
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        """This rank computes the loss (holds the last stage)."""
        return self.num_stages - 1 in self.stage_indices

    def _scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        if self._predicting:  # no target: nothing to compute
            return torch.zeros((), device=output.device)
        return self._loss_fn(output, target) / self.loss_scale

    def _check_batch(self, inputs: torch.Tensor) -> None:
        if inputs.shape[0] % self.microbatches:
            raise ValueError(
                f"Pipeline: a batch of {inputs.shape[0]} samples per data-parallel rank does not split into "
                f"pipeline_microbatches={self.microbatches} equal micro-batches. Use a batch size divisible by it."
            )

    def _run(self, run: Callable[..., Any], inputs: torch.Tensor, target: Any, losses: list[torch.Tensor]) -> Any:
        """One schedule call with each stage's part: the input on the first, target and losses on the last."""
        args = (inputs,) if self.is_first else ()
        kwargs = {"target": target, "losses": losses} if self.is_last else {}
        return run(*args, **kwargs)

    def step(self, inputs: torch.Tensor, target: Any, *, accumulate: int = 1) -> torch.Tensor:
        """Forward and backward of one batch, split into micro-batches; the batch's mean loss on every stage.

        Raises:
            ValueError: a batch that does not split into ``microbatches`` equal parts.
        """
        self._check_batch(inputs)
        self.loss_scale = float(self.microbatches * accumulate)
        losses: list[torch.Tensor] = []
        earlier = self.tied.set_aside_grads()
        self._run(self.schedule.step, inputs, target, losses)
        self.tied.sum_grads(earlier)
        return self._share_loss(losses)

    def evaluate(self, inputs: torch.Tensor, target: Any = None, *, outputs: bool = False) -> tuple[Optional[torch.Tensor], Any]:
        """Forward only (torch's ``eval`` schedule): the mean loss (with a target) and, if asked, the last stage's output, on every stage."""
        self._check_batch(inputs)
        self.loss_scale = float(self.microbatches)
        losses: list[torch.Tensor] = []
        # torch's schedules compute a loss on the last stage whenever they have a loss function: a
        # prediction gets a placeholder target (one number per sample) and the loss is skipped.
        self._predicting = target is None
        try:
            output = self._run(self.schedule.eval, inputs, torch.zeros(inputs.shape[0]) if target is None else target, losses)
        finally:
            self._predicting = False
            self._reshard()  # a forward without backward leaves gathered what it gathered
        loss = self._share_loss(losses) if target is not None else None
        if outputs:
            box = [output if self.is_last else None]
            dist.broadcast_object_list(box, group=self.group, group_src=self.last_rank)
            output = box[0]
        return loss, output

    def _reshard(self) -> None:
        """Free every gathered unit of this rank's stages (kept gathered across micro-batches under ``pipeline_keep_gathered``)."""
        for module in self.stage_modules:
            for unit in module.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()

    def _share_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the micro-batch losses, computed on the last stage and sent to every stage."""
        device = self.stage.device
        if self.is_last:
            loss = torch.stack([part.detach().float() for part in losses]).mean().to(device) * self.loss_scale
        else:
            loss = torch.zeros((), dtype=torch.float32, device=device)
        dist.broadcast(loss, group=self.group, group_src=self.last_rank)
        return loss
