"""Per-step policy on top of HSDPStrategy's mechanism, each configurable from LightningCLI YAML.

* :class:`GradientAccumulationSync`: what non-final micro-batches communicate
  (``"skip"`` / ``"every"`` / ``"defer_all_reduce"``); :func:`micro_batch_sync` for manual optimization.
* :class:`GradientScaling`: the gradient scaling factor (fixed or per batch) and reduce op.
* :class:`ReshardSchedule`: ``reshard_after_forward`` per phase, parameters kept gathered
  inside accumulation windows.
* :class:`ShardingReport`: per-unit table of what was sharded, with warnings.
* :class:`GradientMemoryMonitor`: gradient bytes held after each backward.
* :class:`NonFiniteGradients`: stop at the first NaN/inf gradient, naming the step, unit and parameter.
* :class:`ShardedEMA`: an exponential moving average of the weights, kept on the shards; evaluated, saved, exported.
* :class:`Throughput`: samples/s, tokens/s, TFLOP/s (FLOPs measured), MFU and peak memory every N steps.
"""

from hp_lightning.callbacks.accumulation import GradientAccumulationSync, micro_batch_sync
from hp_lightning.callbacks.ema import ShardedEMA
from hp_lightning.callbacks.memory import GradientMemoryMonitor, live_gradient_bytes
from hp_lightning.callbacks.nonfinite import NonFiniteGradientError, NonFiniteGradients
from hp_lightning.callbacks.report import ShardingReport, ShardingSummary, UnitReport, sharding_summary
from hp_lightning.callbacks.resharding import ReshardSchedule
from hp_lightning.callbacks.scaling import GradientScaling
from hp_lightning.callbacks.throughput import Throughput

__all__ = [
    "GradientAccumulationSync",
    "GradientMemoryMonitor",
    "GradientScaling",
    "NonFiniteGradientError",
    "NonFiniteGradients",
    "ReshardSchedule",
    "ShardedEMA",
    "ShardingReport",
    "ShardingSummary",
    "Throughput",
    "UnitReport",
    "live_gradient_bytes",
    "micro_batch_sync",
    "sharding_summary",
]
