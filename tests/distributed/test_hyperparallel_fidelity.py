"""Code written against HyperParallel's ``fully_shard`` keeps working: one test per fidelity item.

All items run in one 2-rank gloo launch (a module fixture); each test checks its part against a
single-process reference.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import TinyNet, run_distributed


def _sharded(seed: int = 0, **kwargs):
    from hp_lightning import fully_shard, init_device_mesh

    torch.manual_seed(seed)
    model = TinyNet()
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def fidelity_worker() -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import hp_lightning
    from hp_lightning import fully_shard

    dist.init_process_group("gloo")
    out: dict = {}

    # 1. offload_policy=None and device= (HyperParallel spellings).
    model = _sharded(offload_policy=None, device="cpu")
    out["none_offload_sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    try:
        fully_shard(TinyNet(), device="meta", mesh=model.device_mesh)
        out["device_mismatch"] = None
    except ValueError as exc:
        out["device_mismatch"] = str(exc)

    # 2. load_state_dict: full tensors, this rank's shards, DTensors; assign both ways.
    torch.manual_seed(1)
    target = {k: v.detach().clone() for k, v in TinyNet().state_dict().items()}
    out["load"] = {}
    for form in ("full", "local", "dtensor"):
        for assign in (False, True):
            model = _sharded()
            current = dict(model.named_parameters())
            if form == "full":
                state = target
            else:
                state = {}
                for key, value in target.items():
                    like = current[key]
                    from torch.distributed.tensor import distribute_tensor

                    dt = distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
                    state[key] = dt if form == "dtensor" else dt.to_local().clone()
            given = {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in state.items()}
            model.load_state_dict(state, assign=assign)
            still_dtensors = all(isinstance(p, DTensor) for p in model.parameters())
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
            loss = model(x).pow(2).mean()
            loss.backward()  # the loaded model still trains (FSDP re-registered the parameters)
            loaded = _full(model)
            torch.optim.SGD(model.parameters(), lr=0.5).step()
            # Training the module never writes into the caller's dict (HyperParallel copies on load).
            touched = [
                k for k, v in state.items() if not torch.equal(v.to_local() if isinstance(v, DTensor) else v, given[k])
            ]
            out["load"][(form, assign)] = (loaded, still_dtensors, float(loss), touched)
    try:
        _sharded().load_state_dict({"head.weight": torch.zeros(3, 3)}, strict=False)
        out["bad_shape"] = None
    except ValueError as exc:
        out["bad_shape"] = str(exc)

    # 3. hp_lightning.get_model_state_dict / set_model_state_dict.
    model = _sharded()
    full = hp_lightning.get_model_state_dict(model, full_state_dict=True)
    sharded = hp_lightning.get_model_state_dict(model)
    other = _sharded(seed=5)
    hp_lightning.set_model_state_dict(other, {k: v.clone() for k, v in full.items()})
    out["state_dict"] = {
        "full": {k: v.clone() for k, v in full.items()},
        "sharded_are_dtensors": all(isinstance(v, DTensor) for v in sharded.values()),
        "after_set": _full(other),
    }

    # 4. set_requires_all_reduce on a 1-D mesh: True and False are no-ops (gradients still reduced).
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3 + dist.get_rank()))
    out["all_reduce"] = {}
    for flag in (True, False):
        model = _sharded()
        model.set_requires_all_reduce(flag)
        model(x).pow(2).mean().backward()
        out["all_reduce"][flag] = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}

    # 6. CPUOffloadPolicy() on a CPU-only machine: no pinning needed, same gradients as no offload.
    from hp_lightning import CPUOffloadPolicy

    model = _sharded(offload_policy=CPUOffloadPolicy())
    model(x).pow(2).mean().backward()
    out["offload"] = {
        "grads": {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()},
        "on_host": all(p.to_local().device.type == "cpu" for p in model.parameters()),
    }

    # 5. Argument errors: TypeError for wrong types, catchable as ValueError too.
    caught = {}
    for name, call in {
        "mesh": lambda: fully_shard(TinyNet(), mesh="dp"),
        "reshard_after_forward": lambda: fully_shard(TinyNet(), reshard_after_forward="yes"),
        "reduce_op": lambda: _sharded().set_reduce_op_type(3),
        "mp_policy": lambda: fully_shard(TinyNet(), mp_policy="bf16"),
    }.items():
        try:
            call()
            caught[name] = None
        except ValueError as exc:
            caught[name] = (isinstance(exc, TypeError), str(exc))
    out["errors"] = caught
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(fidelity_worker, 2)


def test_offload_policy_none_and_device_are_accepted(results):
    for res in results:
        assert res["none_offload_sharded"]
        assert "does not match the mesh" in res["device_mismatch"]


def test_load_state_dict_takes_full_tensors_local_shards_and_dtensors_with_assign_both_ways(results):
    torch.manual_seed(1)
    reference = TinyNet()
    expected = {k: v.detach() for k, v in reference.named_parameters()}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected_loss = float(reference(x).pow(2).mean())
    for res in results:
        assert len(res["load"]) == 6
        for (form, assign), (params, still_dtensors, loss, touched) in res["load"].items():
            assert still_dtensors, (form, assign)
            assert touched == [], (form, assign, touched)
            for name, value in expected.items():
                torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=f"{form} assign={assign} {name}")
            assert loss == pytest.approx(expected_loss, rel=1e-6), (form, assign)
        assert "expected the full shape (4, 16) or this rank's shard (2, 16)" in res["bad_shape"]


def test_get_and_set_model_state_dict(results):
    torch.manual_seed(0)
    expected = dict(TinyNet().named_parameters())
    for res in results:
        state = res["state_dict"]
        assert state["sharded_are_dtensors"]
        for name, value in expected.items():
            torch.testing.assert_close(state["full"][name], value.detach(), rtol=0, atol=0)
            torch.testing.assert_close(state["after_set"][name], value.detach(), rtol=0, atol=0)


def _reference_grads(world: int = 2) -> dict[str, torch.Tensor]:
    """Gradients of the mean loss over every rank's batch, on one process."""
    torch.manual_seed(0)
    reference = TinyNet()
    for rank in range(world):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3 + rank))
        (reference(x).pow(2).mean() / world).backward()
    return {n: p.grad for n, p in reference.named_parameters()}


def test_set_requires_all_reduce_is_a_no_op_on_fsdp_either_way(results):
    expected = _reference_grads()
    for res in results:
        for flag, grads in res["all_reduce"].items():
            for name, value in expected.items():
                torch.testing.assert_close(grads[name], value, rtol=1e-5, atol=1e-6, msg=f"flag={flag} {name}")


def test_cpu_offload_policy_trains_on_a_cpu_only_machine(results):
    expected = _reference_grads()
    for res in results:
        assert res["offload"]["on_host"]
        for name, value in expected.items():
            torch.testing.assert_close(res["offload"]["grads"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_argument_type_errors_are_also_value_errors(results):
    for res in results:
        assert set(res["errors"]) == {"mesh", "reshard_after_forward", "reduce_op", "mp_policy"}
        for name, caught in res["errors"].items():
            assert caught is not None, name
            is_type_error, message = caught
            assert is_type_error, name  # still a TypeError for code that catches those
            assert "expects" in message and "got" in message, message
