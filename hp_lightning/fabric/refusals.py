"""What the Fabric strategy refuses in ``Fabric(...)``, with the fix: Trainer-only options and ``CheckpointIO`` plugins."""

from __future__ import annotations

from typing import Any

from hp_lightning.core.options import HSDPOptions

#: The error for a ``CheckpointIO`` plugin (``{got}``: its class name).
NO_CHECKPOINT_IO = (
    "The Fabric HSDPStrategy writes checkpoints with hp_lightning.checkpoint (sharded DCP directories or full files, "
    "the Trainer's layout), so a CheckpointIO plugin would never be called; got {got}. Remove it from "
    "Fabric(plugins=...) and choose the format with HSDPStrategy(state_dict_type='sharded' | 'full')."
)


def refuse_trainer_options(options: HSDPOptions, checkpoint_io: Any) -> None:
    """ValueError for ``pipeline_parallel_size`` above 1 or ``save_on_preemption=True``; TypeError for a ``checkpoint_io`` plugin."""
    if options.pipeline_parallel_size > 1:
        raise ValueError(
            f"HSDPStrategy(pipeline_parallel_size={options.pipeline_parallel_size}) is a Trainer option so far: "
            f"the Trainer strategy runs the schedule inside its step. With Fabric, build the stage yourself: "
            f"hp_lightning.PipelineStage(stage_module, stage_index, stage_num, group=mesh['pp'].get_group()) and "
            f"torch.distributed.pipelining's schedules, and set pipeline_parallel_size=1 here."
        )
    if options.save_on_preemption:
        raise ValueError(
            "HSDPStrategy(save_on_preemption=True) is a Trainer option: it saves the ModelCheckpoint's 'last.ckpt' "
            "at the end of an accumulation window, and a Fabric loop has neither. Leave it False with Fabric and "
            "save from your loop, e.g. fabric.save(path, state) when your SIGTERM handler has set a flag."
        )
    if checkpoint_io is not None:
        raise TypeError(NO_CHECKPOINT_IO.format(got=type(checkpoint_io).__name__))
