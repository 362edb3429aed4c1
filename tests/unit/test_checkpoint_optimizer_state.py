"""Optimizer state in one process: parameters without saved state, tied weights, state keyed by position."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from hp_lightning.checkpoint import load_checkpoint, model_state_dict, optimizer_state_dict, save_checkpoint
from hp_lightning.checkpoint.__main__ import main


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "full"])
def test_a_parameter_that_never_had_a_gradient_resumes_with_fresh_state(tmp_path: Path, sharded: bool) -> None:
    torch.manual_seed(0)
    model = WithUnused()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    path = tmp_path / "ckpt"
    checkpoint = {
        "state_dict": model_state_dict(model, full=not sharded),
        "optimizer_states": [optimizer_state_dict(model, optimizer, full=not sharded)],
        "pytorch-lightning_version": "2.6.6",
    }
    save_checkpoint(checkpoint, path, sharded=sharded)
    fresh = WithUnused()
    fresh_optimizer = torch.optim.Adam(fresh.parameters())
    load_checkpoint(path, fresh, [fresh_optimizer])
    assert torch.equal(fresh_optimizer.state[fresh.used.weight]["exp_avg"], optimizer.state[model.used.weight]["exp_avg"])
    assert fresh.unused.weight not in fresh_optimizer.state and fresh.unused.bias not in fresh_optimizer.state


def test_tied_weights_keyed_by_position_resume(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.mid, self.head = nn.Embedding(4, 4), nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.mid(self.emb(x)))

    model = Tied()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.arange(4)).sum().backward()
        optimizer.step()
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "pytorch-lightning_version": "2.6.6"}, path)
    fresh = Tied()
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped, nothing to warn about
        load_checkpoint(path, fresh, [fresh_optimizer])
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg"], fresh_optimizer.state[q]["exp_avg"])


def test_state_keyed_by_position_is_refused_when_the_parameters_changed(tmp_path: Path) -> None:
    """A parameter swapped for another of the same shape would shift positions onto it: refused, not loaded."""
    from hp_lightning.checkpoint import load_checkpoint

    class Saved(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.old, self.b = (nn.Linear(2, 2, bias=False) for _ in range(3))

    class Changed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.new = (nn.Linear(2, 2, bias=False) for _ in range(3))

    saved = Saved()
    optimizer = torch.optim.Adam(saved.parameters())
    saved.b(saved.old(saved.a(torch.randn(3, 2)))).sum().backward()
    optimizer.step()
    full = tmp_path / "plain.ckpt"
    torch.save({"state_dict": saved.state_dict(), "optimizer_states": [optimizer.state_dict()], "pytorch-lightning_version": "2.6.6"}, full)
    assert main(["shard", str(full), str(tmp_path / "sharded")]) == 0
    for path in (full, tmp_path / "sharded"):
        changed = Changed()
        with pytest.raises(ValueError, match=r"keyed by position .* \['new.weight'\] are not in it"):
            load_checkpoint(path, changed, [torch.optim.Adam(changed.parameters())], strict=False)
    # The same parameters declared in another order: the moments' shapes do not fit, refused too.
    class Forward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 3, bias=False), nn.Linear(3, 2, bias=False)

    class Reordered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b, self.a = nn.Linear(3, 2, bias=False), nn.Linear(2, 3, bias=False)

    forward = Forward()
    optimizer = torch.optim.Adam(forward.parameters())
    forward.b(forward.a(torch.randn(3, 2))).sum().backward()
    optimizer.step()
    torch.save({"state_dict": forward.state_dict(), "optimizer_states": [optimizer.state_dict()], "pytorch-lightning_version": "2.6.6"}, full)
    reordered = Reordered()
    with pytest.raises(ValueError, match=r"keyed by position .* state shapes do not fit"):
        load_checkpoint(full, reordered, [torch.optim.Adam(reordered.parameters())])
