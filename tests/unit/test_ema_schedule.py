"""ShardedEMA's schedule on one process (plain tensors, no process group): start step, every N, warm-up, a callable decay.

The update rule is the same on shards (``tests/distributed/test_ema_and_replica_audit.py`` checks
it against one process on 4 gloo ranks); here each option is checked against the rule written out
by hand, step by step, with a model whose weights the test sets itself.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hp_lightning.callbacks import ShardedEMA
from tests.helpers import TinyNet


def _set_weights(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def _average(ema: ShardedEMA) -> float:
    """The average of the first parameter (every parameter holds the same value here)."""
    averages = ema.averages
    return float(averages.state[averages.param_groups[0]["params"][0]]["average"].flatten()[0])


def halving(updates: int) -> float:
    return 0.5


def _expected(weights: list[float], *, decay, warmup: bool, every: int, start: int) -> list[float]:
    """The average after each step, as the docs state the rule (``None`` before it starts)."""
    out, average, updates = [], None, 0
    for step, w in enumerate(weights, start=1):
        if step >= start:
            if average is None:
                average = w
            elif (step - start) % every == 0:
                d = decay(updates) if callable(decay) else decay
                d = min(d, (1 + updates) / (10 + updates)) if warmup else d
                average = d * average + (1 - d) * w
                updates += 1
        out.append(average)
    return out


@pytest.mark.parametrize(
    "decay, warmup, every, start",
    [(0.9, False, 1, 0), (0.9, True, 1, 0), (0.8, False, 3, 0), (0.7, True, 2, 4), (halving, False, 1, 2)],
    ids=["plain", "warmup", "every_3", "warmup_every_2_from_4", "callable_from_2"],
)
def test_schedule_follows_the_documented_rule(decay, warmup: bool, every: int, start: int) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    _set_weights(model, 0.0)
    ema = ShardedEMA(decay=decay, warmup=warmup, every_n_steps=every, start_step=start)
    ema.attach(model)  # start_step 0: the average starts now, as the weights (0.0)
    weights = [float(2**k) for k in range(1, 11)]
    got = []
    for w in weights:
        _set_weights(model, w)  # what the optimizer step would have done
        ema.update()
        got.append(_average(ema) if ema.averages.valid else None)
    if start == 0:  # the average started at attach, from the weights then (0.0): one step earlier in the rule's count
        want = _expected([0.0, *weights], decay=decay, warmup=warmup, every=every, start=1)[1:]
    else:
        want = _expected(weights, decay=decay, warmup=warmup, every=every, start=start)
    assert [g is None for g in got] == [w is None for w in want], (got, want)
    assert [g for g in got if g is not None] == pytest.approx([w for w in want if w is not None], rel=1e-6), (got, want)
    assert ema.averages.counters["steps"] == len(weights)


def test_swapped_puts_the_average_in_and_the_weights_back_even_on_error() -> None:
    model = TinyNet()
    _set_weights(model, 1.0)
    ema = ShardedEMA(decay=0.5)
    ema.attach(model)
    _set_weights(model, 3.0)
    ema.update()  # average 2.0
    with pytest.raises(RuntimeError, match="inside"):
        with ema.swapped():
            assert all(torch.all(p == 2.0) for p in model.parameters())
            raise RuntimeError("inside")
    assert all(torch.all(p == 3.0) for p in model.parameters())


def test_before_the_start_step_there_is_no_average_to_swap_or_export() -> None:
    from hp_lightning.core.ema import require_average

    model = TinyNet()
    _set_weights(model, 1.0)
    ema = ShardedEMA(start_step=5)
    ema.attach(model)
    ema.update()
    with ema.swapped():  # the weights alone
        assert all(torch.all(p == 1.0) for p in model.parameters())
    with pytest.raises(ValueError, match="has not started"):
        require_average(model, "save_hf(ema=True)")
    with pytest.raises(ValueError, match="no averaged weights follow"):
        require_average(TinyNet(), "save_hf(ema=True)")


def test_a_callable_decay_out_of_range_is_refused() -> None:
    ema = ShardedEMA(decay=lambda updates: 1.5)
    model = TinyNet()
    ema.attach(model)
    with pytest.raises(ValueError, match=r"must return a number in \[0, 1\]"):
        ema.update()


def test_export_hf_ema_takes_the_average_of_a_full_file_for_tied_copies_too(tmp_path) -> None:
    """``export_hf(..., ema=True)`` on a hand-written full checkpoint: each averaged weight replaced (a tied copy
    by its twin's average), buffers kept, the dtype the weight's (or ``dtype``'s, cast from the fp32 average)."""
    from safetensors.torch import load_file

    from hp_lightning.checkpoint.hf import export_hf
    from hp_lightning.core.ema import AVERAGE, FORMAT

    embed = torch.randn(6, 4, dtype=torch.bfloat16)
    weights = {"net.embed.weight": embed, "net.lm_head.weight": embed.clone(), "net.norm.weight": torch.ones(4), "net.steps": torch.arange(3)}
    averages = {"net.embed.weight": torch.randn(6, 4), "net.norm.weight": torch.full((4,), 0.5)}

    def save(path, averaged):
        state = {"state": {name: {AVERAGE: value} for name, value in averaged.items()}, "param_groups": [{"params": list(averaged)}]}
        torch.save({"state_dict": weights, "callbacks": {"ShardedEMA{}": {"format": FORMAT, "stored": "full", AVERAGE: state}}}, path)
        return path

    source = save(tmp_path / "ema.ckpt", averages)
    for dtype, out in ((None, tmp_path / "kept"), ("fp32", tmp_path / "fp32")):
        export_hf(source, out, prefix="net.", dtype=dtype, ema=True)
        written = load_file(str(out / "model-00001-of-00001.safetensors"))
        want = averages["net.embed.weight"].to(torch.bfloat16) if dtype is None else averages["net.embed.weight"]
        assert torch.equal(written["embed.weight"], want) and torch.equal(written["lm_head.weight"], want)
        assert torch.equal(written["norm.weight"], averages["net.norm.weight"]) and torch.equal(written["steps"], weights["net.steps"])
    with pytest.raises(ValueError, match=r"covers 1 parameter\(s\) its model weights lack, e.g. \['net.other'\]"):
        export_hf(save(tmp_path / "other.ckpt", {**averages, "net.other": torch.zeros(1)}), tmp_path / "o", prefix="net.", ema=True)
    with pytest.raises(ValueError, match=r"has shape \(5,\), its weight \(4,\)"):
        export_hf(save(tmp_path / "shape.ckpt", {"net.norm.weight": torch.zeros(5)}), tmp_path / "s", prefix="net.", ema=True)
    torch.save({"state_dict": weights}, tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="holds no ShardedEMA average.*drop --ema"):
        export_hf(tmp_path / "plain.ckpt", tmp_path / "p", prefix="net.", ema=True)
    assert not any((tmp_path / name).exists() for name in ("o", "s", "p"))
