"""What the Fabric strategy refuses, with the fix, as functions its hooks call.

* :func:`refuse_trainer_options`: options only the Trainer's loop can honour, and ``CheckpointIO``
  plugins (never called: checkpoints are written by :mod:`hp_lightning.checkpoint`), in ``Fabric(...)``;
* a module wrapped in FSDP1 is refused by both front ends (:func:`hp_lightning.frontends.base.refuse_fsdp1`).
"""

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
    """Raise for ``pipeline_parallel_size`` above 1, ``save_on_preemption=True`` or a ``checkpoint_io`` plugin.

    Raises:
        ValueError: for the two options (the Trainer runs the schedule and saves at a window's end).
        TypeError: for ``checkpoint_io``.
    """
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
