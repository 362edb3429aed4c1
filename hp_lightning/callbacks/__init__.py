"""Per-step policy on top of HSDPStrategy's mechanism (accumulation, scaling, resharding, reports, EMA,
throughput), each configurable from LightningCLI YAML and acting through the strategy's public methods."""

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
