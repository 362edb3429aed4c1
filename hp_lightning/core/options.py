"""The strategy options, validated once for both front ends (Trainer and Fabric).

:class:`HSDPOptions` is what ``HSDPStrategy(...)`` of either front end keeps: every argument
checked and normalized at construction (in ``Trainer(...)`` / ``Fabric(...)``, before any process
or group exists), then turned into a :class:`~hp_lightning.core.parallelize.ShardingPlan` at setup.
Its :meth:`settings` are what every rank must agree on before the mesh is built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Optional, Union

import torch

from hp_lightning.core import devices
from hp_lightning.core.accumulation import check_mode
from hp_lightning.core.watchdog import check_seconds
from hp_lightning.core.mesh import validate_mesh_shape, validate_parallel_sizes
from hp_lightning.core.parallelize import ShardingPlan
from hp_lightning.core.units import UnitSpec, validate_unit_specs
from hp_lightning.parallel.pipeline import SCHEDULES as PIPELINE_SCHEDULES
from hp_lightning.parallel.pipeline import validate_split_points
from hp_lightning.parallel.tensor import validate_tp_plan
from hp_lightning.fully_shard import REDUCE_OPS, CPUOffloadPolicy, OffloadPolicy, build_mp_policy, parse_dtype, validate_scaling_factor

STATE_DICT_TYPES = ("sharded", "full")
#: ``divergence_check``: compare what each rank's backward reaches before gradient collectives, or not.
DIVERGENCE_CHECKS = ("per_step", "off")
#: torch.distributed's default collective timeout (30 minutes).
DEFAULT_TIMEOUT = timedelta(minutes=30)


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"HSDPStrategy({name}=...) expects True or False; got {type(value).__name__} {value!r}.")
    return value


def _check_choice(value: Any, name: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise ValueError(f"HSDPStrategy({name}=...) expects one of {list(choices)}; got {value!r}.")
    return value.lower()


def _check_divergence_check(value: Any) -> str:
    """``"per_step"`` or ``"off"``; YAML reads a bare ``off`` as False (and ``on`` as True), so the booleans mean the same."""
    if isinstance(value, bool):
        return "per_step" if value else "off"
    return _check_choice(value, "divergence_check", DIVERGENCE_CHECKS)


def _check_microbatches(value: Any, stages: int) -> int:
    """Micro-batches per batch; None: as many as stages (the least that keeps every stage busy in steady state)."""
    if value is None:
        return stages
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"HSDPStrategy(pipeline_microbatches=...) expects an int >= 1 or None; got {type(value).__name__} {value!r}.")
    if value < 1:
        raise ValueError(f"HSDPStrategy(pipeline_microbatches=...) expects an int >= 1 or None; got {value}.")
    return value


def _check_timeout(timeout: Any, name: str = "timeout") -> timedelta:
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"HSDPStrategy({name}=...) expects seconds (a number) or a timedelta; got {type(timeout).__name__} {timeout!r}.")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"HSDPStrategy({name}=...) must be > 0 seconds; got {seconds}. Example: {name}=1800.")
    return timedelta(seconds=seconds)


def _check_patterns(patterns: Any, name: str) -> Optional[list[str]]:
    if patterns is None:
        return None
    if isinstance(patterns, str) or not isinstance(patterns, Sequence):
        raise TypeError(f"HSDPStrategy({name}=...) expects a list of strings; got {type(patterns).__name__} {patterns!r}. Example: {name}=['head.*'].")
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise TypeError(f"HSDPStrategy({name}=...) items must be non-empty strings; got {p!r}.")
    return list(patterns)


def _check_placement(placement: Any) -> Optional[dict[str, int]]:
    if placement is None:
        return None
    if not isinstance(placement, Mapping):
        raise TypeError(f"HSDPStrategy(shard_placement=...) expects a mapping of parameter-name glob to dim; got {type(placement).__name__}. Example: {{'*.w2.weight': 1}}.")
    out = {}
    for pattern, dim in placement.items():
        if not isinstance(pattern, str) or isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"HSDPStrategy(shard_placement=...) maps strings to ints; got {pattern!r}: {dim!r}.")
        out[pattern] = dim
    return out


def _check_prefetch(prefetch: Any) -> int:
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"HSDPStrategy(prefetch=...) expects an int >= 0 (0 = off); got {prefetch!r}.")
    return prefetch


def _check_backend(backend: Any) -> Optional[str]:
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"HSDPStrategy(process_group_backend=...) expects a string like 'gloo' or None; got {backend!r}.")
    return backend


@dataclass(frozen=True)
class HSDPOptions:
    """Every option of ``HSDPStrategy`` (Trainer and Fabric), validated and normalized.

    The meaning of each field is documented on :class:`hp_lightning.HSDPStrategy`.

    Raises:
        TypeError / ValueError: on construction, for any field of the wrong type or value.
    """

    mesh_shape: Optional[Sequence[int]] = None
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    tp_plan: Optional[Mapping[str, Any]] = None
    expert_modules: Optional[Sequence[str]] = None
    shard_modules: Optional[Sequence[UnitSpec]] = None
    reshard_after_forward: bool = True
    param_dtype: Optional[Union[str, torch.dtype]] = None
    reduce_dtype: Optional[Union[str, torch.dtype]] = None
    cpu_offload: bool = False
    activation_checkpointing: Optional[Sequence[UnitSpec]] = None
    ignored_params: Optional[Sequence[str]] = None
    replicate_params: Optional[Sequence[str]] = None
    comm_fusion: bool = False
    reduce_op: str = "avg"
    gradient_scaling_factor: Optional[float] = None
    shard_placement: Optional[Mapping[str, int]] = None
    prefetch: int = 1
    forward_methods: Optional[Sequence[str]] = None
    accumulation_mode: str = "skip"
    state_dict_type: str = "sharded"
    sharding_report: bool = False
    process_group_backend: Optional[str] = None
    timeout: Union[float, timedelta] = DEFAULT_TIMEOUT
    train_timeout: Optional[Union[float, timedelta]] = None
    fault_watchdog: bool = True
    heartbeat_timeout: float = 120.0
    failure_exit_grace: float = 30.0
    save_on_preemption: bool = False
    divergence_check: Union[str, bool] = "per_step"
    meta_init: bool = True
    resumable_dataloaders: bool = False
    checkpoint_checksums: bool = False
    async_save: bool = False
    pipeline_parallel_size: int = 1
    pipeline_split_points: Optional[Sequence[str]] = None
    pipeline_schedule: str = "1f1b"
    pipeline_microbatches: Optional[int] = None

    def __post_init__(self) -> None:
        tp, ep, pp = validate_parallel_sizes(self.tensor_parallel_size, self.expert_parallel_size, self.pipeline_parallel_size)
        normalized = {
            "mesh_shape": validate_mesh_shape(self.mesh_shape),
            "tensor_parallel_size": tp,
            "expert_parallel_size": ep,
            "tp_plan": validate_tp_plan(self.tp_plan),
            "expert_modules": _check_patterns(self.expert_modules, "expert_modules"),
            "shard_modules": validate_unit_specs(self.shard_modules, "shard_modules") or None,
            "reshard_after_forward": _check_bool(self.reshard_after_forward, "reshard_after_forward"),
            "param_dtype": parse_dtype(self.param_dtype, name="param_dtype"),
            "reduce_dtype": parse_dtype(self.reduce_dtype, name="reduce_dtype"),
            "cpu_offload": _check_bool(self.cpu_offload, "cpu_offload"),
            "activation_checkpointing": validate_unit_specs(self.activation_checkpointing, "activation_checkpointing") or None,
            "ignored_params": _check_patterns(self.ignored_params, "ignored_params"),
            "replicate_params": _check_patterns(self.replicate_params, "replicate_params"),
            "comm_fusion": _check_bool(self.comm_fusion, "comm_fusion"),
            "reduce_op": _check_choice(self.reduce_op, "reduce_op", REDUCE_OPS),
            "gradient_scaling_factor": validate_scaling_factor(self.gradient_scaling_factor, "HSDPStrategy(gradient_scaling_factor=...)"),
            "shard_placement": _check_placement(self.shard_placement),
            "prefetch": _check_prefetch(self.prefetch),
            "forward_methods": _check_patterns(self.forward_methods, "forward_methods"),
            "accumulation_mode": check_mode(self.accumulation_mode, "HSDPStrategy(accumulation_mode=...)"),
            "state_dict_type": _check_choice(self.state_dict_type, "state_dict_type", STATE_DICT_TYPES),
            "sharding_report": _check_bool(self.sharding_report, "sharding_report"),
            "process_group_backend": _check_backend(self.process_group_backend),
            "timeout": _check_timeout(self.timeout),
            "train_timeout": None if self.train_timeout is None else _check_timeout(self.train_timeout, "train_timeout"),
            "fault_watchdog": _check_bool(self.fault_watchdog, "fault_watchdog"),
            "heartbeat_timeout": check_seconds(self.heartbeat_timeout, "heartbeat_timeout", "HSDPStrategy"),
            "failure_exit_grace": check_seconds(self.failure_exit_grace, "failure_exit_grace", "HSDPStrategy"),
            "save_on_preemption": _check_bool(self.save_on_preemption, "save_on_preemption"),
            "divergence_check": _check_divergence_check(self.divergence_check),
            "meta_init": _check_bool(self.meta_init, "meta_init"),
            "resumable_dataloaders": _check_bool(self.resumable_dataloaders, "resumable_dataloaders"),
            "checkpoint_checksums": _check_bool(self.checkpoint_checksums, "checkpoint_checksums"),
            "async_save": _check_bool(self.async_save, "async_save"),
            "pipeline_parallel_size": pp,
            "pipeline_split_points": validate_split_points(self.pipeline_split_points, pp),
            "pipeline_schedule": _check_choice(self.pipeline_schedule, "pipeline_schedule", tuple(PIPELINE_SCHEDULES)),
            "pipeline_microbatches": _check_microbatches(self.pipeline_microbatches, pp),
        }
        if pp > 1 and normalized["replicate_params"]:
            raise ValueError(
                f"HSDPStrategy(replicate_params=...) needs pipeline_parallel_size=1; got replicate_params="
                f"{list(normalized['replicate_params'])} with pipeline_parallel_size={pp}. torch's pipeline schedules turn "
                f"gradient sync off for every micro-batch and reduce FSDP's gradients themselves, so replicate parameters "
                f"would never be all-reduced (each rank would train its own copy). Let FSDP shard them under a pipeline."
            )
        if normalized["async_save"] and normalized["state_dict_type"] != "sharded":
            raise ValueError(
                f"HSDPStrategy(async_save=True) writes sharded checkpoints in the background, but got state_dict_type="
                f"{normalized['state_dict_type']!r}, which gathers the whole state on rank 0 and writes one file. Use "
                f"state_dict_type='sharded' (convert afterwards with `python -m hp_lightning.checkpoint consolidate`), "
                f"or async_save=False."
            )
        for name, value in normalized.items():
            object.__setattr__(self, name, value)

    def sharding_plan(
        self, *, derived_param_dtype: Optional[torch.dtype], derived_reduce_dtype: Optional[torch.dtype], device_type: str
    ) -> ShardingPlan:
        """The plan :func:`~hp_lightning.core.parallelize.parallelize` applies.

        Args:
            derived_param_dtype / derived_reduce_dtype: what the front end's precision setting
                implies; the ``param_dtype`` / ``reduce_dtype`` options override them.
            device_type: the device the model trains on (pinned host memory needs an accelerator).
        """
        return ShardingPlan(
            shard_modules=self.shard_modules,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=build_mp_policy(
                param_dtype=self.param_dtype or derived_param_dtype,
                reduce_dtype=self.reduce_dtype or derived_reduce_dtype,
            ),
            # Pinned host memory speeds up host<->device copies but needs an accelerator runtime.
            offload_policy=(
                CPUOffloadPolicy(pin_memory=devices.is_accelerator(device_type)) if self.cpu_offload else OffloadPolicy()
            ),
            activation_checkpointing=self.activation_checkpointing,
            ignored_params=self.ignored_params,
            replicate_params=self.replicate_params,
            shard_placement=self.shard_placement,
            comm_fusion=self.comm_fusion,
            prefetch=self.prefetch,
            reduce_op=self.reduce_op,
            gradient_scaling_factor=self.gradient_scaling_factor,
            forward_methods=self.forward_methods,
            tp_plan=self.tp_plan,
            expert_modules=self.expert_modules,
        )

    def settings(self, owner: str = "HSDPStrategy") -> dict[str, Any]:
        """Every option as ``"HSDPStrategy(name=...)" -> value``: what all ranks must agree on."""
        settings = {f"{owner}({f.name}=...)": getattr(self, f.name) for f in fields(self)}
        if self.tp_plan:  # style objects compare by name: their default repr holds an address
            settings[f"{owner}(tp_plan=...)"] = {k: v if isinstance(v, str) else type(v).__name__ for k, v in self.tp_plan.items()}
        return settings
