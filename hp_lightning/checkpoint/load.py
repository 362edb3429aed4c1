"""Loading any supported checkpoint into a sharded model and its optimizers, from every rank.

Order of work: recognize the format (rank 0), verify integrity (the ranks share a sharded
checkpoint's files), compare keys and shapes with the model, and only then move tensors: DCP reads
each rank's part (resharding to this mesh), or rank 0 reads a single file and broadcasts it.
"""

from __future__ import annotations

import io
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import lightning
import torch
import torch.distributed as dist
from lightning.fabric.wrappers import is_wrapped
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hp_lightning.checkpoint import hf, layout
from hp_lightning.checkpoint.collective import on_every_rank, on_rank0, rank, warn_rank0, world_size
from hp_lightning.checkpoint.integrity import CorruptCheckpointError, ReadCheck, corruption_message, regular_file_size, share_by_size, verify_records
from hp_lightning.checkpoint.layout import FSDP_MODEL_KEY, FULL_INFO_KEY, MODEL_KEY, OPTIMIZER_KEY, CheckpointKind
from hp_lightning.checkpoint.read import dcp_index, dcp_load, directory_message, read_dcp_metadata, read_full_file, read_meta, read_sharded
from hp_lightning.checkpoint.save import save_checkpoint
from hp_lightning.core.state_dict import (
    Shape,
    check_model_keys,
    check_optimizer_state,
    is_keyed_by_position,
    model_shapes,
    names_to_positions,
    optimizer_param_names,
    positions_to_names,
    state_shapes,
    unwrap_optimizer,
)

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

__all__ = [  # the readers stay importable from here, where they used to live
    "LoadsShardedCheckpoints", "dcp_index", "directory_message", "load_checkpoint", "load_from_checkpoint", "load_weights", "read_full_file",
]


@layout.cyclic_gc_paused
def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizers: Sequence[Any],
    *,
    strict: bool = True,
    weights_only: Optional[bool] = None,
    verify: bool = True,
    elsewhere: Collection[str] = (),
    keys: Optional[layout.StateKeys] = None,
) -> dict[str, Any]:
    """Load a checkpoint of any supported format into the sharded ``model`` and ``optimizers``; return the rest.

    Formats: hp_lightning sharded directories and full files, Lightning's sharded directories, plain
    Lightning ``.ckpt`` files (optimizer state keyed by position matched by order), bare ``state_dict``
    files and ``.safetensors`` weights. Pass no optimizers to load the weights only.

    Args:
        strict: missing or unexpected model keys are an error (else they are reported and skipped).
        weights_only: None or True: every pickle is read safely (tensors, primitive containers and
            ``add_safe_globals`` types; else :class:`UnsafeCheckpointError`). False: unpickle anything,
            which runs code the file carries: only for files you trust.
        verify: check every byte this load uses against what the save recorded, each tensor before it
            is copied into the model (with a SHA-256 recorded, every byte before any tensor moves).
        elsewhere: model keys other ranks load (a pipeline's other stages): neither missing nor unexpected.
            A single file is then first written as a temporary sharded directory, so each stage reads its part.
        keys: a Lightning Fabric single file's ``state`` keys, read in the Trainer's layout.

    Raises:
        FileNotFoundError, CorruptCheckpointError, UnsafeCheckpointError (on every rank, before any
        tensor is read), ValueError: not a checkpoint, a newer format, keys or shapes that do not fit.
    """
    path = Path(path)
    model = _unwrapped(model)
    optimizers = [unwrap_optimizer(o) for o in optimizers]

    def find() -> CheckpointKind:
        if not path.exists():
            layout.recover(path)
        return layout.classify(path)

    kind = on_rank0(find)
    if elsewhere and kind is CheckpointKind.FULL_FILE:
        return _load_full_into_stage(path, model, optimizers, strict=strict, weights_only=weights_only, verify=verify, elsewhere=elsewhere)
    if kind is CheckpointKind.FULL_FILE:
        return _load_full(path, model, optimizers, strict=strict, weights_only=weights_only, verify=verify, keys=keys)
    return _load_sharded(path, kind, model, optimizers, strict=strict, weights_only=weights_only, verify=verify, elsewhere=elsewhere)


def _load_full_into_stage(
    path: Path,
    model: nn.Module,
    optimizers: list[Any],
    *,
    strict: bool,
    weights_only: Optional[bool],
    verify: bool,
    elsewhere: Collection[str],
) -> dict[str, Any]:
    """A single file into one pipeline stage, through a temporary sharded directory next to it.

    A broadcast would send every stage the whole model; one write lets each rank read only its part.
    """
    whole: dict[str, Any] = {}

    def read() -> Path:
        whole.update(read_full_file(path, weights_only=weights_only, verify=verify))
        whole.pop(FULL_INFO_KEY, None)
        return layout.staging_path(path.with_name(f"{path.name}.for-pipeline"), layout.new_token())

    temporary = on_rank0(read)
    save_checkpoint(whole, temporary, sharded=True)
    whole.clear()
    try:
        return _load_sharded(
            temporary, CheckpointKind.HP_SHARDED, model, optimizers, strict=strict, weights_only=weights_only, verify=False, elsewhere=elsewhere
        )
    finally:
        if dist.is_initialized():
            dist.barrier()
        if rank() == 0:
            layout.remove(temporary)


# ------------------------------------------------ sharded


def _verify_sharded(path: Path, manifest: Mapping[str, Any], *, ranges_on_read: bool) -> None:
    """This rank's share of the recorded files (about equal bytes) against the manifest (:func:`verify_records`)."""
    try:
        mine = share_by_size(manifest["files"], world_size())[rank()]
        problems = verify_records(path, manifest["files"], mine, ranges_on_read=ranges_on_read)
    except OSError as exc:
        problems = [f"{str(path)!r} cannot be read on rank {rank()}: {exc}"]
    if problems:
        raise CorruptCheckpointError(corruption_message(problems, path))


def _stored_model(index: Mapping[tuple[Any, ...], Shape]) -> tuple[str, dict[str, Shape]]:
    roots = {k[0] for k in index}
    model_key = MODEL_KEY if MODEL_KEY in roots else FSDP_MODEL_KEY
    return model_key, {k[1]: shape for k, shape in index.items() if k[0] == model_key and len(k) == 2}


def _stored_optimizer(index: Mapping[tuple[Any, ...], Shape], i: int) -> tuple[dict[Any, dict[str, Shape]], int]:
    """Per parameter, the state entries stored for optimizer ``i`` with their shapes; and its number of param groups."""
    root = f"optimizer_{i}"
    entries: dict[Any, dict[str, Shape]] = {}
    groups = set()
    for k, shape in index.items():
        if k[0] != root or len(k) < 3:
            continue
        if k[1] == "state" and len(k) >= 4:
            entries.setdefault(k[2], {})[k[3]] = shape
        elif k[1] == "param_groups":
            groups.add(k[2])
    return entries, len(groups)


#: State entries of torch's optimizers that have their parameter's shape (factored ones, such as
#: Adafactor's row and column variances, do not, and are not compared).
PARAMETER_SHAPED_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg", "acc_delta", "sum", "exp_inf", "prev", "ax"}
)


def _check_positions(
    model: nn.Module, flat: list[str], stored: Mapping[Any, Mapping[str, Shape]], missing: Collection[str], i: int, source: str
) -> None:
    """State keyed by position names this run's parameters only if they are the saved ones, in the saved order.

    A missing parameter or a state shape that differs from its parameter's shows that positions moved.
    """
    absent = [name for name in flat if name in missing]
    shapes = model_shapes(model)
    wrong = [
        f"position {k} -> {flat[int(k)]!r}: {key} {tuple(shape)} vs parameter {shapes.get(flat[int(k)])}"
        for k, entries in stored.items()
        if int(k) < len(flat)
        for key, shape in entries.items()
        if key in PARAMETER_SHAPED_STATE and shape and shape != shapes.get(flat[int(k)])
    ]
    if absent or wrong:
        why = f"parameters {absent[:6]} are not in it" if absent else f"state shapes do not fit: {wrong[:4]}"
        raise ValueError(
            f"Checkpoint {source}: optimizer {i} state is keyed by position (a plain PyTorch / Lightning checkpoint) and "
            f"needs this run's optimizer to list the saved parameters in the saved order, but {why}, so positions "
            f"would move state onto other parameters. Resume with the model that saved it, or load the weights only "
            f"(hp_lightning.checkpoint.load_weights, strict=False) and start the optimizer fresh."
        )


def _plan_optimizers(
    model: nn.Module, optimizers: list[Any], stored_count: int, *, strict: bool, source: str
) -> list[Any]:
    """Which optimizers to restore; a missing or different optimizer state is an error when strict."""
    if not optimizers:
        return []
    if stored_count == 0:
        message = (
            f"Checkpoint {source} holds no optimizer state (saved weights-only?), but this run has "
            f"{len(optimizers)} optimizer(s) to restore."
        )
        if strict:
            raise KeyError(message + " Resume from a full training checkpoint, or load the weights only with hp_lightning.checkpoint.load_weights.")
        warn_rank0(message + " Optimizers start fresh.")
        return []
    if stored_count != len(optimizers):
        raise ValueError(
            f"Checkpoint {source} holds state for {stored_count} optimizer(s); configure_optimizers returns "
            f"{len(optimizers)}. Configure the same optimizers as the run that saved it."
        )
    return optimizers


def _load_sharded(
    path: Path,
    kind: CheckpointKind,
    model: nn.Module,
    optimizers: list[Any],
    *,
    strict: bool,
    weights_only: Optional[bool],
    verify: bool,
    prefix: str = "",
    elsewhere: Collection[str] = (),
    rest: bool = True,
) -> dict[str, Any]:
    """Read a sharded directory into ``model`` and ``optimizers``; return ``meta.pt`` (empty without ``rest``).

    Every pickle is read (by each rank) before any tensor moves, so a refusal is raised on every rank alike.
    """
    source = repr(str(path))

    def read_and_verify() -> Optional[dict[str, Any]]:
        manifest = layout.read_manifest(path) if kind is CheckpointKind.HP_SHARDED else None
        if manifest is not None and verify:
            _verify_sharded(path, manifest, ranges_on_read=True)  # before anything else in the directory is read
        return manifest

    manifest = on_every_rank(read_and_verify)  # one agreement: the first rank's problem is raised on every rank
    if manifest is None:
        warn_rank0(f"{source} is in Lightning's sharded layout, which records no checksums; it is loaded unverified.")
    check = ReadCheck(path, manifest["files"]) if manifest is not None and verify else None

    def read_and_compare() -> tuple[Any, ...]:
        # Reads and checks only (no collective, no optimizer code), so the ranks share one agreement over all of it.
        meta = read_meta(path, weights_only) if rest else {}
        metadata = read_dcp_metadata(path, weights_only=weights_only)
        index = dcp_index(path, weights_only=weights_only, metadata=metadata)
        model_key, stored = _stored_model(index)
        stored = {k[len(prefix) :]: shape for k, shape in stored.items() if k.startswith(prefix) and k[len(prefix) :] not in elsewhere}
        sharded_model = get_model_state_dict(model)  # what DCP loads into (in place), and the shapes to compare
        missing, unexpected = check_model_keys(state_shapes(sharded_model), stored, strict=strict, source=source)
        restoring = _plan_optimizers(model, optimizers, len({k[0] for k in index if str(k[0]).startswith("optimizer_")}), strict=strict, source=source)
        request: dict[str, Any] = {model_key: {prefix + k: v for k, v in sharded_model.items() if k in stored}}
        return meta, metadata, index, model_key, missing, unexpected, restoring, request

    meta, metadata, index, model_key, missing, unexpected, restoring, request = on_every_rank(read_and_compare)
    _report_skipped(missing, unexpected, source)

    def optimizer_requests() -> list[Any]:
        # torch's state-dict API may run the optimizer's step: only after the agreement above, so every rank is here.
        return [_optimizer_request(model, optimizer, index, i, set(missing), source, elsewhere) for i, optimizer in enumerate(restoring)]

    plans = on_every_rank(optimizer_requests) if restoring else []
    for i, plan in enumerate(plans):
        request[f"optimizer_{i}"] = plan[0]

    dcp_load(request, path, weights_only=weights_only, no_dist=not dist.is_initialized(), allow_partial_load=True, check=check, metadata=metadata)
    loaded_model = {k[len(prefix) :]: v for k, v in request[model_key].items()}
    set_model_state_dict(model, loaded_model, options=StateDictOptions(strict=False))
    for optimizer, (loaded, names, by_position, skipped) in zip(restoring, plans):
        named = positions_to_names(loaded, names, source) if by_position else loaded
        if elsewhere:  # the stored groups list every stage's parameters; this stage's optimizer holds its own
            for group, mine in zip(named["param_groups"], names):
                group["params"] = list(mine)
        set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(strict=False))  # parameters without saved state start fresh (below)
        _forget_state(model, optimizer, skipped)

    return meta


def _optimizer_request(
    model: nn.Module,
    optimizer: Any,
    index: Mapping[tuple[Any, ...], Shape],
    i: int,
    skipped: set[str],
    source: str,
    elsewhere: Collection[str] = (),
) -> tuple[dict[str, Any], list[list[str]], bool, set[str]]:
    """This run's optimizer state shaped like what checkpoint entry ``optimizer_i`` stores (to load into)."""
    current: dict[str, Any] = get_optimizer_state_dict(model, optimizer)  # initializes empty state, so it has every entry
    current["state"] = {k: v for k, v in current["state"].items() if k not in skipped}
    names = optimizer_param_names(model, optimizer)
    stored_entries, stored_groups = _stored_optimizer(index, i)
    flat = [n for group in names for n in group]
    # DCP stores dict keys as strings: native torch state (integer ids) comes back as "0", "1", ...
    by_position = bool(stored_entries) and all(str(k).isdigit() and str(k) not in flat for k in stored_entries)
    if by_position and elsewhere:
        raise ValueError(
            f"Checkpoint {source}: optimizer {i} state is keyed by position (a plain Lightning checkpoint), which "
            f"counts every parameter of the whole model; a pipeline stage holds some of them and cannot tell which "
            f"positions are its own. Resume it once without pipeline parallelism and save, or load the weights only."
        )
    if by_position:
        _check_positions(model, flat, stored_entries, skipped, i, source)
        stored_entries = {flat[int(k)]: v for k, v in stored_entries.items() if int(k) < len(flat)}
    check_optimizer_state(current, {k: sorted(v) for k, v in stored_entries.items()}, stored_groups, index=i, source=source)
    current["state"] = {k: v for k, v in current["state"].items() if k in stored_entries}
    request = names_to_positions(current, names) if by_position else current
    return request, names, by_position, skipped | (set(flat) - set(stored_entries))


def _forget_state(model: nn.Module, optimizer: Any, names: set[str]) -> None:
    """Drop optimizer state of parameters the checkpoint had none for, so they start fresh at the next step."""
    for name, param in model.named_parameters():
        if name in names:
            optimizer.state.pop(param, None)


# ------------------------------------------------ full file


def _load_full(
    path: Path,
    model: nn.Module,
    optimizers: list[Any],
    *,
    strict: bool,
    weights_only: Optional[bool],
    verify: bool,
    prefix: str = "",
    keys: Optional[layout.StateKeys] = None,
) -> dict[str, Any]:
    """Rank 0 reads the file; the others receive its tensors by broadcast, so only rank 0 needs the file."""
    source = repr(str(path))
    loaded: dict[str, Any] = {}

    def summarize() -> dict[str, Any]:
        loaded.update(read_full_file(path, weights_only=weights_only, verify=verify, keys=keys))
        if prefix:
            loaded[MODEL_KEY] = {k[len(prefix) :]: v for k, v in loaded[MODEL_KEY].items() if k.startswith(prefix)}
        optimizer_states = loaded.get(OPTIMIZER_KEY) or []
        rest = {k: v for k, v in loaded.items() if k not in (MODEL_KEY, OPTIMIZER_KEY)}
        return {
            "shapes": state_shapes(loaded[MODEL_KEY]),
            "optimizers": len(optimizer_states),
            "index": {key: shape for i, state in enumerate(optimizer_states) for key, shape in _optimizer_index(state, i).items()},
            "rest": rest,
        }

    summary = on_rank0(summarize)
    missing, unexpected = on_every_rank(lambda: check_model_keys(model_shapes(model), summary["shapes"], strict=strict, source=source))
    _report_skipped(missing, unexpected, source)
    weights = {k: v for k, v in loaded.get(MODEL_KEY, {}).items() if k not in unexpected}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized(), strict=False)
    set_model_state_dict(model, weights if rank() == 0 else {}, options=options)
    del weights

    rest = summary["rest"]
    # A bare state dict or safetensors file holds weights and nothing to resume: training starts
    # fresh from them (a Lightning checkpoint saved weights-only is different: resuming it is an error).
    weights_file = "pytorch-lightning_version" not in rest
    if weights_file and optimizers:
        warn_rank0(f"{source} holds model weights only: they are loaded, and training starts at step 0 with fresh optimizer state.")
    restoring = [] if weights_file else on_every_rank(lambda: _plan_optimizers(model, optimizers, summary["optimizers"], strict=strict, source=source))
    for i, optimizer in enumerate(restoring):
        _, names, _, skipped = on_every_rank(
            lambda i=i, optimizer=optimizer: _optimizer_request(model, optimizer, summary["index"], i, set(missing), source)
        )
        state: dict[str, Any] = {}
        if rank() == 0:
            stored = loaded[OPTIMIZER_KEY][i]
            state = positions_to_names(stored, names, source) if is_keyed_by_position(stored) else dict(stored)
            state["state"] = {k: v for k, v in state["state"].items() if k not in skipped}
        set_optimizer_state_dict(model, optimizer, state, options=options)
        _forget_state(model, optimizer, skipped)
    if weights_file:
        # What Lightning needs to accept the dict; no loops, callbacks or scheduler state to restore.
        return {"pytorch-lightning_version": lightning.__version__, "lr_schedulers": []}
    return rest


def _optimizer_index(state: Mapping[str, Any], i: int) -> dict[tuple[Any, ...], Shape]:
    """A full file's optimizer ``i`` state as a sharded checkpoint's index has it (:func:`dcp_index`: keys as
    strings, each entry with its shape), so both formats are checked by :func:`_optimizer_request`."""
    root = f"optimizer_{i}"
    index: dict[tuple[Any, ...], Shape] = {(root, "param_groups", g, "params"): None for g in range(len(state.get("param_groups", [])))}
    for k, entry in state.get("state", {}).items():
        index.update({(root, "state", str(k), key): tuple(v.shape) if isinstance(v, torch.Tensor) else None for key, v in entry.items()})
    return index


def _report_skipped(missing: list[str], unexpected: list[str], source: str) -> None:
    if missing:
        warn_rank0(f"Checkpoint {source}: {len(missing)} model key(s) missing, kept as initialized: {missing[:8]}")
    if unexpected:
        warn_rank0(f"Checkpoint {source}: {len(unexpected)} unexpected key(s) ignored: {unexpected[:8]}")


# ---------------------------------------------------------------- weights for fine-tuning


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module inside Fabric's wrapper: torch's broadcast load matches the other ranks' tensors by
    parameter name, and the wrapper's names carry a prefix (``_forward_module.``) that no key has."""
    inner = getattr(module, "module", None)
    return inner if is_wrapped(module) and isinstance(inner, nn.Module) else module


def load_weights(
    module: nn.Module, path: Path, *, prefix: str = "", strict: bool = True, weights_only: Optional[bool] = None, allow_cast: bool = False
) -> None:
    """Load pretrained weights into a (sharded) module, for fine-tuning; optimizer and trainer state are not touched.

    Reads a bare ``state_dict`` file, a Lightning ``.ckpt``, a ``.safetensors`` file, a sharded checkpoint
    directory or a Hugging Face model directory (each rank reading its own slices, :func:`hf.load_hf_weights`).
    Call it on every rank once the model is sharded (``on_fit_start``); a Hugging Face directory may also be
    named on the meta-device model ``configure_model`` built: the strategy then loads it while materializing.

    Args:
        prefix: use only the checkpoint's keys starting with it, stripped (``"net."`` loads ``net.*`` into
            ``self.net``); for a Hugging Face directory, where the model sits inside ``module``.
        strict: missing or unexpected keys (among those with ``prefix``) are an error.
        weights_only: None or True: safe loading; False: unpickle anything, only for files you trust.
        allow_cast: Hugging Face directories: cast on copy when dtypes differ (else refused).

    Raises:
        FileNotFoundError, CorruptCheckpointError, ValueError: as :func:`load_checkpoint`.
    """
    path = Path(path)
    module = _unwrapped(module)
    if on_rank0(lambda: hf.is_hf_directory(path)):
        if not hf.defer_until_materialized(module, path, prefix=prefix, strict=strict, allow_cast=allow_cast):
            hf.load_hf_weights(module, path, prefix=prefix, strict=strict, allow_cast=allow_cast)
        return
    kind = on_rank0(lambda: layout.classify(path))
    if kind is CheckpointKind.FULL_FILE:
        _load_full(path, module, [], strict=strict, weights_only=weights_only, verify=True, prefix=prefix)
    else:
        _load_sharded(path, kind, module, [], strict=strict, weights_only=weights_only, verify=True, prefix=prefix, rest=False)


# ---------------------------------------------------------------- the Lightning way, one CPU process


def load_from_checkpoint(cls: type[LightningModule], checkpoint_path: Any, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, **kwargs)`` that also takes sharded directories.

    One plain CPU process: a sharded directory is consolidated in memory (integrity checked), then
    handed to Lightning's own ``load_from_checkpoint``; files go to Lightning unchanged. The model
    passes through host memory twice: for larger models, ``python -m hp_lightning.checkpoint consolidate``
    once. ``weights_only`` in ``kwargs`` also decides how a directory's pickles are read.
    """
    if isinstance(checkpoint_path, (str, Path)) and Path(checkpoint_path).exists() and not Path(checkpoint_path).is_dir():
        regular_file_size(Path(checkpoint_path).parent, Path(checkpoint_path).name)  # a FIFO would block Lightning's open
    if not isinstance(checkpoint_path, (str, Path)) or not Path(checkpoint_path).is_dir():
        return cls.load_from_checkpoint(checkpoint_path, **kwargs)
    checkpoint = read_sharded(Path(checkpoint_path), weights_only=True, trust_pickle=kwargs.get("weights_only") is False)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    del checkpoint
    buffer.seek(0)
    # Read safely above unless trusted, so Lightning's own (safe by default) load of it succeeds.
    return cls.load_from_checkpoint(buffer, **kwargs)


class LoadsShardedCheckpoints:
    """Mix into a LightningModule (``class MyModule(LoadsShardedCheckpoints, LightningModule)``) so that
    ``MyModule.load_from_checkpoint(sharded_dir)`` works; files load as before."""

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        if args or not isinstance(checkpoint_path, (str, Path)) or not Path(checkpoint_path).is_dir():
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
        return load_from_checkpoint(super(), checkpoint_path, **kwargs)  # type: ignore[arg-type]
