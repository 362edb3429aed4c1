"""NonFiniteGradients(action="stop") on 2 real gloo ranks: training stops cleanly, weights untouched.

The ``"raise"`` action and clip-time ``error_if_nonfinite`` are covered end to end by the fault
matrix; this checks what only an in-process run can see: the weights after the stop.
"""

from __future__ import annotations

import pytest

from hp_lightning.callbacks.nonfinite import NonFiniteGradients
from tests.helpers import run_distributed

NAN_STEP = 2


def _train_until_nan(tmp: str) -> dict:
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer, seed_everything

    from hp_lightning.callbacks.nonfinite import NonFiniteGradients
    from tests.faults.guarded import GuardedHSDPStrategy
    from tests.helpers import RegressionModule, full_params, make_dataset, max_rel_diff, rank_loader, trainer_kwargs

    class NaNOnRank1(RegressionModule):
        def on_after_backward(self) -> None:
            if self.global_rank == 1 and self.global_step == NAN_STEP:
                self.net.blocks[0].fc1.weight.grad.to_local().view(-1)[3] = float("inf")

    class Snapshot(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == NAN_STEP:
                self.before = full_params(pl_module)  # a collective: every rank takes it

    seed_everything(0)
    torch.set_num_threads(1)
    guard, snapshot = NonFiniteGradients(action="stop"), Snapshot()
    model = NaNOnRank1()
    trainer = Trainer(devices=2, strategy=GuardedHSDPStrategy(mesh_shape=[2]), max_steps=6, callbacks=[guard, snapshot], **trainer_kwargs())
    trainer.fit(model, rank_loader(make_dataset(), 16, 2))
    after = full_params(model)
    return {
        "rank": dist.get_rank(),
        "report": guard.last_report,
        "stopped_at": trainer.global_step,
        "changed": max_rel_diff(after, snapshot.before),
        "finite": all(bool(torch.isfinite(t).all()) for t in after.values()),
    }


def test_stop_action_skips_the_step_and_ends_training_on_every_rank(tmp_path):
    results = run_distributed(_train_until_nan, 2, str(tmp_path))
    for r in results:
        assert r["finite"] and r["changed"] == 0.0, r  # the optimizer never saw the inf
        assert r["stopped_at"] == NAN_STEP + 1, r  # the skipped step still counts; no step after it
        assert (
            f"Non-finite gradients at global step {NAN_STEP} (epoch 0, batch {NAN_STEP}), found before the optimizer step"
            in r["report"]
        )
        assert "First: parameter 'net.blocks.0.fc1.weight' in sharding unit 'net.blocks.0', inf on rank 1." in r["report"]


@pytest.mark.parametrize("kwargs, error", [({"action": "skip"}, ValueError), ({"max_names": 0}, TypeError)])
def test_bad_options_are_refused(kwargs, error):
    with pytest.raises(error, match="NonFiniteGradients"):
        NonFiniteGradients(**kwargs)


def _catch_and_go_on(tmp: str) -> dict:
    import time

    import torch
    from lightning.pytorch import Trainer, seed_everything

    from hp_lightning.callbacks.nonfinite import NonFiniteGradientError, NonFiniteGradients
    from tests.faults.guarded import GuardedHSDPStrategy
    from tests.helpers import RegressionModule, make_dataset, rank_loader, trainer_kwargs

    class NaNEverywhere(RegressionModule):
        def on_after_backward(self) -> None:
            if self.global_step == 1:
                self.net.head.weight.grad.to_local().view(-1)[0] = float("nan")

    def fit(model) -> Trainer:
        strategy = GuardedHSDPStrategy(mesh_shape=[2], failure_exit_grace=3.0)
        trainer = Trainer(devices=2, strategy=strategy, max_steps=3, callbacks=[NonFiniteGradients()], **trainer_kwargs())
        trainer.fit(model, rank_loader(make_dataset(), 16, 2))
        return trainer

    seed_everything(0)
    torch.set_num_threads(1)
    try:
        fit(NaNEverywhere())
        caught = ""
    except NonFiniteGradientError as exc:  # raised on every rank together: each rank catches its own
        caught = str(exc)
    # The grace bounds how long a rank whose watchdog read the other's post first waits for its own
    # error (3 s: ranks on a loaded 2-core machine raise up to a second apart). Sleep longer than
    # it: a process whose main thread goes on is not ended.
    time.sleep(4.0)
    return {"caught": caught, "second_run_steps": fit(RegressionModule()).global_step}


def test_an_error_raised_on_every_rank_can_be_caught_and_training_goes_on(tmp_path):
    # The watchdog stops ranks whose error is a consequence of another's; an error a rank raised
    # itself runs its course (here: into the user's except), and the next fit starts a new session.
    for result in run_distributed(_catch_and_go_on, 2, str(tmp_path)):
        assert "Non-finite gradients at global step 1" in result["caught"], result
        assert "parameter 'net.head.weight' in sharding unit '<root>', NaN on rank" in result["caught"], result
        assert result["second_run_steps"] == 3, result
