"""How a model is cut into pipeline stages (no process group): names kept, pieces removed, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hp_lightning.parallel.pipeline import split_stage, stage_units
from tests.pipeline_models import PipelinedModule, StagedNet


def test_units_follow_registration_order_down_to_the_split_points() -> None:
    model = PipelinedModule()
    assert stage_units(model, ["net.blocks.2"]) == ["net.inp", "net.blocks.0", "net.blocks.1", "net.blocks.2", "net.blocks.3", "net.head"]
    assert stage_units(model, ["net.head"]) == ["net.inp", "net.blocks", "net.head"]  # blocks stay whole


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_each_stage_keeps_its_units_under_their_own_names(stage: int) -> None:
    torch.manual_seed(0)
    whole = PipelinedModule()
    torch.manual_seed(0)
    model = PipelinedModule()
    kept, removed = split_stage(model, ["net.blocks.1", "net.blocks.3"], stage)
    expected = [["net.inp", "net.blocks.0"], ["net.blocks.1", "net.blocks.2"], ["net.blocks.3", "net.head"]][stage]
    assert kept == expected
    names = {n for n, _ in model.named_parameters()}
    assert names == {n for n, _ in whole.named_parameters() if any(n.startswith(u + ".") for u in expected)}
    assert len(model.net.blocks) == 4  # removed blocks are Identity: indices and names are kept
    assert (model.net.inp is None) == (stage != 0) and (model.net.head is None) == (stage != 2)
    # The stages in sequence compute what the whole model computes.
    x = torch.randn(3, 8)
    h = x
    for s in range(3):
        torch.manual_seed(0)
        part = PipelinedModule()
        split_stage(part, ["net.blocks.1", "net.blocks.3"], s)
        h = part(h)
    torch.testing.assert_close(h, whole(x))


def test_module_dict_entries_are_deleted_and_stateless_modules_kept() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
            self.act = nn.ReLU()

    model = Model()
    kept, removed = split_stage(model, ["layers.b"], 1)
    assert kept == ["layers.b", "act"] and removed == ["layers.a"] and list(model.layers) == ["b"]
    assert isinstance(model.act, nn.ReLU)  # no state: every stage keeps it


def test_bad_split_points_are_named() -> None:
    model = PipelinedModule()
    with pytest.raises(ValueError, match=r"\['net.blocks.9'\] are not modules the model can be cut at.*net.blocks.3"):
        stage_units(model, ["net.blocks.9"])
    with pytest.raises(ValueError, match="must follow the model's order"):
        stage_units(model, ["net.blocks.3", "net.blocks.1"])
    with pytest.raises(ValueError, match="leave a first stage"):
        stage_units(model, ["net.inp"])


def test_parameters_on_the_way_to_a_split_point_are_refused() -> None:
    net = StagedNet()
    net.scale = nn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match=r"\['scale'\] belong to 'the root module' itself, on the way to a split point"):
        stage_units(net, ["blocks.2"])


def test_a_batch_that_is_not_an_input_target_pair_is_refused_not_truncated() -> None:
    from hp_lightning import HSDPStrategy

    strategy = HSDPStrategy()
    x, y, mask = torch.zeros(2, 8), torch.zeros(2, 4), torch.ones(2)
    assert strategy._pipeline_batch(((x, y),), {})[1] is y
    with pytest.raises(TypeError, match="cannot tell input from target in a tuple of 3.*pipeline_batch"):
        strategy._pipeline_batch(((x, y, mask),), {})
