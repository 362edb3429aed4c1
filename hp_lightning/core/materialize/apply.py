"""The entry point, :func:`materialize`: coverage check, allocation, replay or rules, value check;
and what is moved after setup.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import ExitStack

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hp_lightning.core.materialize.allocation import _agreed_rng_state, _allocate
from hp_lightning.core.materialize.checks import _meta_slots, _uncovered_message, check_coverage, check_values
from hp_lightning.core.materialize.full_tensors import _FullTensorWrites, _Slot
from hp_lightning.core.materialize.ops import _DTENSOR_RANDOM_WARNING, _LINKS_ATTR, _local, _poison
from hp_lightning.core.materialize.preloaded import meta_stand_ins, state_dict_name, take_pending_weights
from hp_lightning.core.materialize.recording import _forget_construction, _Links
from hp_lightning.core.materialize.replay import _Replay, _ReplayError
from hp_lightning.core.materialize.rules import _hf_init_weights, _is_hf_pretrained, _root_hook, _rule_program, _Step
from hp_lightning.core.materialize.stage_units import _Discarded, _units_put_back
from hp_lightning.core.mesh import ParallelMesh


@torch.no_grad()
def materialize(model: nn.Module, mesh: DeviceMesh | ParallelMesh, init_device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
    """Allocate meta-device tensors (local shards only) and initialize every one of them; False when there were none.

    See the package docstring for the steps, the guarantee and the cost; whole (unsharded) tensors
    are broadcast from rank 0 at the end. Tensors a deferred ``load_weights`` fills
    (:mod:`.preloaded`) are allocated, left out of the init program (meta-device stand-ins take its
    writes) and loaded after it. When the generator was not used since construction began, it is
    left where building the model for real would have left it.

    Args:
        model: the sharded model (``prepare_model`` called :func:`link_construction` before sharding).
        mesh: the data-parallel mesh, or the strategy's :class:`ParallelMesh` (only its device type is read).
        init_device: where tensors are allocated and initialized (the host under CPU offload).
        group: the ranks holding this same model (None: the world; a pipeline stage's ranks
            under PP, whose tensors differ from the other stages').

    Raises:
        ValueError: a tensor no rule covers (before allocating), or a tensor still uninitialized
            or absurd afterwards; raised on every rank.
    """
    pending = take_pending_weights(model)
    slots = _meta_slots(model)
    if not slots:
        _forget_construction(model)
        if pending:
            raise ValueError(
                f"load_weights(...) was deferred to the materialization of {type(model).__name__}, but nothing of it is on the "
                f"meta device any more; call load_weights after setup instead."
            )
        return False
    # Tensors a deferred load_weights fills: allocated, left out of initialization, then loaded.
    preloaded = {f"{where}{name}" for where, source in pending for name in source.covered()}
    to_init = [s for s in slots if state_dict_name(s.qualified) not in preloaded]
    links: _Links | None = model.__dict__.get(_LINKS_ATTR)
    if links is not None and links.record.broken:
        _warn_rules_instead(f"The construction of {type(model).__name__} could not be recorded for replay ({links.record.broken})", stacklevel=2)
        links = None
    root = _root_hook(model) if not _is_hf_pretrained(model) else None
    check_coverage(model, to_init, links, root is not None)

    _allocate(model, slots, init_device)
    start = links.record.rng_state if links is not None else torch.get_rng_state()
    agreed = _agreed_rng_state(start, mesh.device_type)
    untouched = torch.equal(torch.get_rng_state(), agreed)

    originals = [s.get() for s in to_init]
    sharded = {id(t): t for t in originals if isinstance(t, DTensor)}
    tracked = {t.untyped_storage().data_ptr(): t for t in originals if not isinstance(t, DTensor)}
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=_DTENSOR_RANDOM_WARNING)
        stack.enter_context(torch.device(init_device))
        stack.enter_context(meta_stand_ins(model, preloaded))
        writes = stack.enter_context(_FullTensorWrites(sharded, tracked))
        removed_storages = stack.enter_context(_units_put_back(model))
        if removed_storages:  # a pipeline stage: the other stages' units consume the generator as in the whole model
            stack.enter_context(_Discarded(removed_storages, init_device))
        torch.set_rng_state(agreed)
        _run_program(model, to_init, links, writes, root, agreed, preloaded)
        writes.flush()
        final_state = torch.get_rng_state()

    _adopt_replaced(to_init, init_device)
    for _, source in pending:
        source.load()
    # A rule may also replace a buffer (``self.inv_freq = ...``): that writes it too.
    unwritten = [s for s, t in zip(to_init, originals) if s.get() is t and not writes.was_written(t)]
    if unwritten:
        raise ValueError(_uncovered_message(model, unwritten, after_rules=True))
    check_values(slots, group, mesh.device_type)
    if dist.is_available() and dist.is_initialized():
        for slot in slots:
            tensor = slot.get()
            if not isinstance(tensor, DTensor):
                dist.broadcast(tensor.data, group=group, group_src=0)
    if untouched:
        torch.set_rng_state(final_state)
    _forget_construction(model)
    return True


def _warn_rules_instead(why: str, stacklevel: int) -> None:
    """On rank 0: ``why`` the model is initialized by its modules' rules instead of a replay (``stacklevel`` as the caller's)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        message = f"{why}; it is initialized by its modules' rules instead (deterministic, but not equal to a model built without the meta device)."
        warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)


def _loaded_groups(model: nn.Module, links: _Links, loaded: set[str]) -> frozenset[int]:
    """The recorded groups of the slots a deferred load fills (by state-dict name)."""
    if not loaded:
        return frozenset()
    names = {id(m): f"{name}." if name else "" for name, m in model.named_modules()}
    return frozenset(
        group for group, (module, attr) in links.slots.items() if state_dict_name(f"{names.get(id(module), '')}{attr}") in loaded
    )


def _run_program(
    model: nn.Module, slots: Sequence[_Slot], links: _Links | None, writes: _FullTensorWrites, root: _Step | None,
    rng_state: torch.Tensor, loaded: set[str],
) -> None:
    """Replay (or rules), then rules for what the replay left unwritten, then the root's hook.

    ``loaded``: the names a deferred load fills; the replay leaves out what only they need."""
    if links is not None:
        hf_done: set[int] = set()
        in_model = {id(m) for m in model.modules()}

        def on_marker(module: nn.Module) -> None:
            # HF's post_init skipped initialization on the meta device; run it where it would have run.
            if _is_hf_pretrained(module) and id(module) not in hf_done and id(module) in in_model:
                hf_done.add(id(module))
                _hf_init_weights(module)

        try:
            _Replay(links, on_marker, loaded=_loaded_groups(model, links, loaded)).run()
            if _is_hf_pretrained(model) and id(model) not in hf_done:
                _hf_init_weights(model)
            leftover = {id(s.module) for s in slots if not writes.was_written(s.get())}
            steps = [s for s in _rule_program(model, root is not None) if id(s.module) in leftover and s.module is not model]
        except _ReplayError as exc:
            _warn_rules_instead(f"Replaying the construction of {type(model).__name__} failed ({exc})", stacklevel=3)
            # Start over from nothing: NaN everywhere, the generator where replay started, no HF marks.
            writes.flush()
            for slot in slots:
                _poison(_local(slot.get()))
            writes.written.clear()
            for module in model.modules():
                module.__dict__.pop("_is_hf_initialized", None)
            torch.set_rng_state(rng_state)
            steps = _rule_program(model, root is not None)
    else:
        steps = _rule_program(model, root is not None)
    for step in [*steps, *([root] if root is not None else [])]:
        try:
            step.run()
        except Exception as exc:
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"(while initializing {type(model).__name__} after meta-device construction: {step.what})")
            raise


def _adopt_replaced(slots: Sequence[_Slot], init_device: torch.device) -> None:
    """Accept buffers a rule replaced (``self.inv_freq = ...``); refuse replaced sharded parameters."""
    for slot in slots:
        tensor = slot.get()
        if slot.kind == "parameter" and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            raise ValueError(f"{slot.describe()} is still on the meta device after initialization; an init rule replaced it.")
        if slot.kind == "buffer" and tensor.device != init_device and not tensor.is_meta:
            slot.module._buffers[slot.name] = tensor.to(init_device)


@torch.no_grad()
def move_unsharded_states(model: nn.Module, device: torch.device) -> None:
    """Move what FSDP does not manage (whole parameters, buffers, metric states) to ``device``.

    Sharded parameters are left where FSDP put them (the device, or the host under CPU offload).
    """
    for module in model.modules():
        for param in list(module._parameters.values()):
            if param is not None and not isinstance(param, DTensor) and param.device != device:
                param.data = param.data.to(device)
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return
    for module in model.modules():
        if isinstance(module, Metric):
            module.to(device)
