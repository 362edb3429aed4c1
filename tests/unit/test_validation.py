"""Bad configurations fail at Trainer(...) or HSDPStrategy(...) with what was expected, what came, and the fix.

Nothing here starts a process or a process group: every error is raised before one could hang.
"""

from __future__ import annotations

import re

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

import hp_lightning
from hp_lightning import HSDPStrategy
from hp_lightning.core.mesh import resolve_mesh_shape
from hp_lightning.core.units import select_modules, select_params
from tests.helpers import TinyNet

BAD_STRATEGY_ARGS = [
    # (kwargs, exception type, regex that must appear in the message)
    (dict(mesh_shape=[2, 2, 2]), ValueError, r"1 dim .*2 dims.*got 3 dims"),
    (dict(mesh_shape=[0, 4]), ValueError, r">= 1.*got \[0, 4\]"),
    (dict(mesh_shape=[-2, 4]), ValueError, r">= 1 \(or -1"),
    (dict(mesh_shape=[-1, -1]), ValueError, r"at most one size"),
    (dict(mesh_shape="2x2"), TypeError, r"list/tuple of ints.*got str"),
    (dict(mesh_shape=[2.0, 2]), TypeError, r"sizes must be ints.*float"),
    (dict(mesh_shape=[]), ValueError, r"got 0 dims"),
    (dict(param_dtype="bf17"), ValueError, r"param_dtype must be one of .*got 'bf17'.*param_dtype='bf16'"),
    (dict(reduce_dtype=torch.int32), ValueError, r"floating dtype; got torch.int32"),
    (dict(reduce_dtype=16), TypeError, r"string like 'bf16'.*got int"),
    (dict(reshard_after_forward="yes"), TypeError, r"reshard_after_forward=.*True or False; got str"),
    (dict(cpu_offload=1), TypeError, r"cpu_offload=.*True or False; got int"),
    (dict(comm_fusion=None), TypeError, r"comm_fusion=.*True or False; got NoneType"),
    (dict(reduce_op="mean"), ValueError, r"reduce_op=.*\['avg', 'sum'\]; got 'mean'"),
    (dict(gradient_scaling_factor=0.0), ValueError, r"finite number > 0.*got 0.0"),
    (dict(gradient_scaling_factor="half"), TypeError, r"finite number > 0 or None.*got str"),
    (dict(prefetch=-1), ValueError, r"int >= 0.*got -1"),
    (dict(state_dict_type="zip"), ValueError, r"\['sharded', 'full'\]; got 'zip'"),
    (dict(timeout=-5), ValueError, r"> 0 seconds; got -5"),
    (dict(timeout="30m"), TypeError, r"seconds .* or a timedelta; got str"),
    (dict(shard_modules=["no_such_pkg.model.Block"]), ValueError, r"does not import to a class.*my_pkg.model.Block"),
    (dict(shard_modules=[3]), TypeError, r"classes or strings; got int"),
    (dict(shard_modules=[torch.Tensor]), TypeError, r"nn.Module subclasses; got Tensor"),
    (dict(ignored_params="head.*"), TypeError, r"list of strings; got str.*\['head.\*'\]"),
    (dict(shard_placement={"*.weight": "1"}), TypeError, r"maps strings to ints"),
    (dict(shard_placement=[("*.weight", 1)]), TypeError, r"mapping of parameter-name glob to dim"),
    (dict(process_group_backend=3), TypeError, r"string like 'gloo' or None"),
    (dict(async_save="yes"), TypeError, r"async_save=.*True or False; got str"),
    (dict(async_save=True, state_dict_type="full"), ValueError, r"async_save=True.*got state_dict_type='full'.*state_dict_type='sharded'"),
    (dict(pipeline_parallel_size=2, pipeline_split_points="atuo"), TypeError, r"expects 'auto' or a list of module names; got str 'atuo'"),
    (dict(pipeline_parallel_size=3, pipeline_split_points=["a"]), ValueError, r"needs 2 split point\(s\); got 1"),
    (dict(pipeline_parallel_size=2, pipeline_split_points="net.blocks.2"), TypeError, r"list of module names; got str"),
    (dict(pipeline_parallel_size=0), ValueError, r"pipeline_parallel_size=.*int >= 1.*got 0"),
    (dict(pipeline_parallel_size=2, pipeline_split_points=["b"], pipeline_schedule="zb"), ValueError, r"'dualpipev'\]; got 'zb'"),
    (dict(pipeline_parallel_size=2, pipeline_split_points=["b"], pipeline_microbatches=0), ValueError, r"int >= 1 or None; got 0"),
    (dict(pipeline_parallel_size=2, pipeline_split_points=["b"], replicate_params=["head.*"]), ValueError, r"replicate_params=.* needs pipeline_parallel_size=1; got .*'head.\*'.*never be all-reduced"),
    (dict(pipeline_parallel_size=2, pipeline_split_points=["b"], tensor_parallel_size=2), ValueError, r"got pipeline_parallel_size=2 with tensor_parallel_size=2.*TP or EP inside a stage"),
]


@pytest.mark.parametrize(("kwargs", "exc", "pattern"), BAD_STRATEGY_ARGS, ids=[str(k) for k, _, _ in BAD_STRATEGY_ARGS])
def test_strategy_rejects_bad_arguments(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        HSDPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("mesh_shape", "devices", "num_nodes", "pattern"),
    [
        ([3, 2], 4, 1, r"replicate x shard == world size 4; got 6"),
        ([3], 4, 1, r"shard == world size 4; got 3"),
        ([3, -1], 2, 2, r"3 does not divide it"),
    ],
)
def test_mesh_that_cannot_cover_the_world_fails_in_trainer_constructor(mesh_shape, devices, num_nodes, pattern):
    with pytest.raises(ValueError, match=pattern):
        Trainer(strategy=HSDPStrategy(mesh_shape=mesh_shape), accelerator="cpu", devices=devices, num_nodes=num_nodes, logger=False)


@pytest.mark.parametrize("precision", ["64-true", "16-true"])
def test_unsupported_precision_fails_in_trainer_constructor(precision):
    with pytest.raises(ValueError, match=r"supports precision .*'32-true'.*'bf16-mixed'.*got"):
        Trainer(strategy="hsdp", accelerator="cpu", devices=2, precision=precision, logger=False)


def test_fp16_error_explains_the_alternative():
    from hp_lightning.strategies.precision import normalize_precision

    with pytest.raises(ValueError, match=r"use 'bf16-mixed'"):
        normalize_precision("16-mixed")


def test_mesh_resolution_infers_and_checks():
    assert resolve_mesh_shape(None, world_size=8, num_nodes=2, devices_per_node=4) == (2, 4)
    assert resolve_mesh_shape([-1], world_size=8, num_nodes=2, devices_per_node=4) == (8,)
    assert resolve_mesh_shape([4, -1], world_size=8, num_nodes=2, devices_per_node=4) == (4, 2)
    with pytest.raises(ValueError, match=r"world size 8; got 6"):
        resolve_mesh_shape([3, 2], world_size=8, num_nodes=2, devices_per_node=4)


def test_unit_selection_errors_name_what_exists():
    model = TinyNet()
    with pytest.raises(ValueError, match=r"'Attention' matches no submodule of TinyNet\. Available classes: \['Block', 'LayerNorm', 'Linear', 'ModuleList'\]"):
        select_modules(model, ["Attention"])
    with pytest.raises(ValueError, match=r"'layers\.\*' matches no submodule.*blocks"):
        select_modules(model, ["layers.*"])
    with pytest.raises(ValueError, match=r"pattern 'embed\.\*' matches no parameter.*inp.weight"):
        select_params(model, ["embed.*"], "replicate_params")


def test_unit_selection_forms_agree():
    model = TinyNet(depth=3)
    by_class = select_modules(model, [type(model.blocks[0])])
    by_name = select_modules(model, ["Block"])
    by_path = select_modules(model, ["tests.helpers.Block"])
    by_glob = select_modules(model, ["blocks.*"])
    assert [id(m) for m in by_class] == [id(m) for m in by_name] == [id(m) for m in by_path] == [id(m) for m in by_glob]
    # Bottom-up: the last block first (children before parents, later siblings first).
    assert by_class[0] is model.blocks[2]


def test_auto_units_prefer_hf_no_split_modules():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

    class HFLike(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer()])
            self.extra = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)])

    from hp_lightning.core.units import auto_units

    units = auto_units(HFLike())
    assert [type(u).__name__ for u in units] == ["Layer", "Layer"]


def test_registered_names():
    from lightning.pytorch.strategies import StrategyRegistry

    assert {"hsdp", "hp_fsdp", "hsdp_cpu_offload"} <= set(StrategyRegistry)
    fsdp = StrategyRegistry.get("hp_fsdp")
    offload = StrategyRegistry.get("hsdp_cpu_offload")
    assert isinstance(fsdp, HSDPStrategy) and fsdp.options.mesh_shape == (-1,)
    assert offload.cpu_offload is True
    assert hp_lightning.HSDPStrategy is HSDPStrategy


def test_every_error_message_has_a_received_value():
    # Every message in BAD_STRATEGY_ARGS names what was received ("got ...").
    for kwargs, exc, _ in BAD_STRATEGY_ARGS:
        with pytest.raises(exc) as info:
            HSDPStrategy(**kwargs)
        assert re.search(r"got|does not import", str(info.value)), str(info.value)


# ------------------------------------------------------------------ options written once (issue 26)


def test_each_option_is_documented_once_and_the_reference_is_generated_from_it():
    """Each field's documentation, kept at run time, is the reference's row (its freshness: test_public_surface.py)."""
    from pathlib import Path

    from hp_lightning.core.options import field_docs

    docs = field_docs()
    assert docs and all(len(text) > 20 for text in docs.values()), [name for name, text in docs.items() if len(text) <= 20]
    text = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for name in docs:
        assert f"| `{name}` |" in text, name


def test_options_are_grouped_by_owner_and_built_flat():
    from dataclasses import FrozenInstanceError, fields

    from hp_lightning.core.options import OPTION_GROUPS, CheckpointOptions, HSDPOptions, ParallelOptions, group_of

    # Every option belongs to exactly one group; the flat class is all of them, in their order.
    owned = [f.name for group in OPTION_GROUPS for f in fields(group)]
    assert owned == [f.name for f in fields(HSDPOptions)] and len(set(owned)) == len(owned)
    options = HSDPOptions(mesh_shape=[2, -1], state_dict_type="FULL", tensor_parallel_size=2)
    assert isinstance(options, CheckpointOptions) and isinstance(options, ParallelOptions)
    assert options.state_dict_type == "full" and options.mesh_shape == (2, -1) and group_of("async_save") is CheckpointOptions
    with pytest.raises(FrozenInstanceError):
        options.cpu_offload = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        HSDPOptions(2)  # type: ignore[misc]  (keyword-only)
    # A group checks its own fields alone, too.
    with pytest.raises(ValueError, match=r"async_save=True\) writes sharded checkpoints"):
        CheckpointOptions(async_save=True, state_dict_type="full")
    # The layout is resolved from the options once: sizes and names for a world.
    layout = options.layout(world_size=8, num_nodes=2, devices_per_node=4)
    assert (layout.names, layout.shape) == (("replicate", "shard", "tp"), (2, 2, 2))


def test_both_front_ends_take_every_option_from_the_one_constructor():
    import inspect

    from hp_lightning.core.options import HSDPOptions, input_types
    from hp_lightning.fabric import HSDPFabricStrategy
    from hp_lightning.strategies import HSDPStrategy

    types = input_types()
    for cls in (HSDPStrategy, HSDPFabricStrategy):
        params = inspect.signature(cls.__init__).parameters
        keyword_only = {n: p for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
        assert list(keyword_only) == list(types)
        assert all(keyword_only[n].annotation == types[n] for n in types)
        assert cls.__init__.__doc__ and all(f"    {n}: " in cls.__init__.__doc__ for n in types)
    strategy = HSDPStrategy(None, None, None, None, None, prefetch=2)
    assert strategy.options == HSDPOptions(prefetch=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefetchh'"):
        HSDPStrategy(prefetchh=2)
