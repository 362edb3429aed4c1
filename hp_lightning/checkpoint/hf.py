"""Hugging Face in, Hugging Face out: safetensors directories read into, and written from, a sharded model.

* :func:`load_hf_weights`: rank 0 checks the headers against the directory and the model, every rank
  agrees, then DCP's ``HuggingFaceStorageReader`` reads on each rank only the slices it holds (a memory
  map, never the whole file). Reads are strict (:class:`StrictHFPlanner`, :func:`_check_tied_copies`).
* :func:`save_hf`: every rank writes its part with DCP's ``HuggingFaceStorageWriter``, which merges the
  parts into whole-tensor shards on rank 0 file by file: no rank holds the whole model.
* :func:`export_hf` (``export-hf``): a checkpoint read by the project's own readers, written in one process.

Every output is staged and renamed into place; a non-empty target is refused unless ``overwrite=True``,
and even then only an earlier export of ours is replaced (:func:`_read_export_record`).
"""

from __future__ import annotations

import contextlib
import filecmp
import json
import math
import os
import re
import shutil
import stat
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from hp_lightning.checkpoint import layout
from hp_lightning.checkpoint.adapters import ADAPTER_WEIGHTS, adapter_state, check_peft_export, merged_adapters
from hp_lightning.checkpoint.collective import agree, on_every_rank, on_rank0, rank, warn_rank0
from hp_lightning.checkpoint.convert import _safetensors_ready
from hp_lightning.checkpoint.integrity import CorruptCheckpointError, UnsafeCheckpointError, open_regular, outside_reason
from hp_lightning.checkpoint.layout import MODEL_KEY, TOKEN_FILE
from hp_lightning.checkpoint.names import FileNames
from hp_lightning.checkpoint.read import read_full_file, read_sharded
from hp_lightning.core.materialize.preloaded import awaits_materialization, defer_weights
from hp_lightning.fully_shard.policies import parse_dtype

__all__ = [
    "HF_INDEX_FILE",
    "HF_SINGLE_FILE",
    "export_hf",
    "is_hf_directory",
    "load_hf_weights",
    "parse_size",
    "save_hf",
]

HF_INDEX_FILE = "model.safetensors.index.json"
HF_SINGLE_FILE = "model.safetensors"
SUFFIX = ".safetensors"
#: Files copied from ``config=`` next to the weights (the ones ``from_pretrained`` reads besides them).
CONFIG_FILES = ("config.json", "generation_config.json")
#: What an export of ours records in its directory: a token and the files it wrote (the only ones it may replace).
EXPORT_RECORD = ".hp_lightning_export.json"
#: DCP's writer leaves each rank's part here before consolidating (its fixed sub-directory name).
_PARTS_DIR = "sharded"
#: The output-embedding keys Hugging Face drops when ``tie_word_embeddings`` ties them to the input embedding.
TIED_OUTPUT_KEYS = ("lm_head.weight",)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# ---------------------------------------------------------------- recognizing and inspecting a directory


def is_hf_directory(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face weights directory (an index or ``*.safetensors``, and no DCP ``.metadata``)."""
    path = Path(path)
    if not path.is_dir() or (path / ".metadata").exists():
        return False
    return (path / HF_INDEX_FILE).exists() or any(p.name.endswith(SUFFIX) for p in path.iterdir())


@dataclass(frozen=True)
class _Entry:
    """One tensor of the directory, as its file's header declares it (``dtype``: torch's name, e.g. ``"bfloat16"``)."""

    file: str
    shape: tuple[int, ...]
    dtype: str


def _regular_file(path: Path, directory: Path, why: str) -> None:
    """``path`` must be a regular file (not a link) directly inside ``directory``."""
    if path.is_symlink():
        raise UnsafeCheckpointError(
            f"Hugging Face directory {str(directory)!r}: {path.name!r} ({why}) is a symbolic link to {os.readlink(path)!r}; "
            f"only regular files inside the directory are read (a link may lead anywhere). A hub cache snapshot links its "
            f"blobs: download with `huggingface-cli download REPO --local-dir DIR` (real files) or copy it with `cp -rL`."
        )
    if not path.exists():
        raise CorruptCheckpointError(
            f"Hugging Face directory {str(directory)!r}: {path.name!r} ({why}) is missing. Copy the whole model directory again."
        )
    if not path.is_file():
        raise UnsafeCheckpointError(f"Hugging Face directory {str(directory)!r}: {path.name!r} ({why}) is not a regular file.")


def _index_files(directory: Path) -> tuple[Optional[dict[str, str]], Optional[int]]:
    """The index's ``weight_map`` (tensor -> file name), every name checked to be a file inside ``directory``,
    and its declared ``total_size``; (None, None) without an index."""
    index = directory / HF_INDEX_FILE
    if not (index.exists() or index.is_symlink()):
        return None, None
    _regular_file(index, directory, "the index")
    try:
        data = json.loads(index.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{str(index)!r} is not valid JSON ({exc}). Copy the model directory again.") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CorruptCheckpointError(
            f"{str(index)!r} has no 'weight_map' of tensor names to file names (got {type(weight_map).__name__}). "
            f"Copy the model directory again."
        )
    for name in sorted(set(weight_map.values())):
        # A plain file name, nothing else: a link is then refused by _regular_file, naming its target.
        if name in ("", ".", "..") or "/" in name or "\\" in name or os.sep in name or not name.endswith(SUFFIX):
            raise UnsafeCheckpointError(
                f"{str(index)!r} names {name!r} as a weights file: expected a '*{SUFFIX}' file directly inside "
                f"{str(directory)!r}. An index may not lead outside its directory; this one is refused."
            )
    metadata = data.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    return weight_map, total if isinstance(total, int) else None


def _inspect(directory: Path) -> dict[str, _Entry]:
    """Every tensor of the directory with its file, shape and dtype, from the headers alone, cross-checked.

    ``safetensors`` refuses a header whose data does not end exactly at the file's end; the index must
    list exactly the files present (DCP's reader reads every ``*.safetensors`` file, a stray one too),
    name each tensor's real file, and its ``total_size`` must equal the bytes the headers declare.
    """
    from safetensors import safe_open  # safetensors is optional (hp-lightning[safetensors])

    directory = Path(directory)
    weight_map, total = _index_files(directory)
    present = sorted(p.name for p in directory.iterdir() if p.name.endswith(SUFFIX))
    files = sorted(set(weight_map.values())) if weight_map is not None else present
    if not files:
        raise CorruptCheckpointError(f"Hugging Face directory {str(directory)!r} holds no '*{SUFFIX}' file.")
    for name in files:
        _regular_file(directory / name, directory, "listed in the index" if weight_map is not None else "a weights file")
    stray = sorted(set(present) - set(files))
    if stray:
        raise CorruptCheckpointError(
            f"Hugging Face directory {str(directory)!r}: {stray} are not listed in {HF_INDEX_FILE} (left from another "
            f"model or export?). Every '*{SUFFIX}' file of the directory is read, so they would mix in: remove or move them."
        )
    entries: dict[str, _Entry] = {}
    declared = 0
    for name in files:
        try:
            with safe_open(str(directory / name), framework="pt") as f:
                for key in f.keys():
                    if key in entries:
                        raise CorruptCheckpointError(
                            f"Hugging Face directory {str(directory)!r}: tensor {key!r} is in both {entries[key].file!r} and "
                            f"{name!r}. Export it again (a DCP sharded save's parts are not a Hugging Face directory)."
                        )
                    view = f.get_slice(key)
                    shape, dtype = tuple(int(s) for s in view.get_shape()), _TORCH_DTYPES.get(str(view.get_dtype()).upper())
                    if dtype is None:
                        raise CorruptCheckpointError(
                            f"Hugging Face directory {str(directory)!r}: {name!r} stores {key!r} as {view.get_dtype()!r}, "
                            f"a dtype torch cannot hold ({sorted(_TORCH_DTYPES)} are read)."
                        )
                    entries[key] = _Entry(name, shape, dtype)
                    declared += math.prod(shape) * getattr(torch, dtype).itemsize
        except CorruptCheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for a bad header or size
            raise CorruptCheckpointError(
                f"Hugging Face directory {str(directory)!r}: {name!r} is not a readable safetensors file "
                f"({type(exc).__name__}: {exc}); truncated or damaged? Copy it again."
            ) from exc
    if weight_map is not None:
        wrong = [f"{k!r} -> {v!r} (holds it: {entries[k].file if k in entries else 'no file'})" for k, v in weight_map.items() if k not in entries or entries[k].file != v]
        unlisted = sorted(set(entries) - set(weight_map))
        if wrong or unlisted:
            raise CorruptCheckpointError(
                f"{str(directory / HF_INDEX_FILE)!r} disagrees with its files: {wrong[:6]}"
                f"{'; tensors not in the index: ' + str(unlisted[:6]) if unlisted else ''}. Copy the model directory again."
            )
        if total is not None and total != declared:
            raise CorruptCheckpointError(
                f"{str(directory / HF_INDEX_FILE)!r} declares total_size {total} bytes but its files' headers declare "
                f"{declared}. Copy the model directory again."
            )
    return entries


#: safetensors' dtype names -> torch's (what the header declares, as ``safe_open`` reports it).
_TORCH_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn", "I16": "int16",
                 "U16": "uint16", "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32",
                 "I64": "int64", "U64": "uint64", "F64": "float64"}


# ---------------------------------------------------------------- loading


def _tie_groups(module: nn.Module) -> list[list[str]]:
    """Names sharing one parameter (tied weights), each group in the whole model's order; singletons left out.

    A pipeline stage also lists the ties it shares with other stages (``lm_head`` on the last, the
    embedding on the first), so the last stage loads the embedding's tensor and writes none of it.
    """
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    across = [list(getattr(tie, "names", ())) for tie in module.__dict__.get("_hp_pipeline_ties", ())]
    local = [names for names in groups.values() if len(names) > 1 and not any(set(names) <= set(group) for group in across)]
    return [*across, *local]


def _plan_load(
    entries: Mapping[str, _Entry],
    module_state: Mapping[str, Any],
    ties: list[list[str]],
    *,
    prefix: str,
    strict: bool,
    allow_cast: bool,
    elsewhere: Collection[str],
    source: str,
) -> tuple[dict[str, str], list[str], list[str]]:
    """Which file tensor goes into which module key; (mapping hf -> module key, missing, unexpected).

    Raises ValueError for missing / unexpected keys (when strict), a shape mismatch, or a cast not allowed.
    """
    ours = {k[len(prefix):]: k for k in module_state if k.startswith(prefix)}
    if not ours:
        raise ValueError(
            f"Hugging Face weights {source}: no module key starts with prefix {prefix!r} (the module's keys look like "
            f"{list(module_state)[:3]}). Pass the attribute holding the Hugging Face model, e.g. prefix='net.', or none."
        )
    elsewhere_hf = {k[len(prefix):] for k in elsewhere if k.startswith(prefix)}
    alias_of: dict[str, list[str]] = {}
    for group in ties:
        names = [n[len(prefix):] for n in group if n.startswith(prefix)]
        for n in names:
            alias_of[n] = names
    mapping: dict[str, str] = {}
    satisfied: set[str] = set()
    for hf_key, module_key in ours.items():
        if hf_key in satisfied:
            continue
        group = alias_of.get(hf_key, [hf_key])
        held = [n for n in group if n in entries]
        if held:  # a tied group loads once, from the first of its names the file holds (Hugging Face omits the copies)
            mapping[held[0]] = ours.get(held[0], module_key)
            satisfied.update(group)
    missing = sorted(k for k in ours if k not in satisfied)
    tied_extra = {n for group in alias_of.values() for n in group if n in entries and n in satisfied}
    unexpected = sorted(k for k in entries if k not in ours and k not in elsewhere_hf and k not in tied_extra)
    if strict and (missing or unexpected):
        hint = _prefix_hint(list(ours), list(entries), prefix)
        raise ValueError(
            f"Hugging Face weights {source} do not fit the module"
            f"{' under prefix ' + repr(prefix) if prefix else ''}: "
            f"{len(missing)} module key(s) missing from the files {missing[:6]}, {len(unexpected)} file key(s) the module "
            f"lacks {unexpected[:6]}.{hint} Pass strict=False to load the keys that match and keep the rest as initialized."
        )
    if not mapping and entries:
        hint = _prefix_hint(list(ours), list(entries), prefix)
        raise ValueError(
            f"Hugging Face weights {source} fill no tensor of the module{' under prefix ' + repr(prefix) if prefix else ''}, "
            f"even with strict=False: the module's keys look like {list(ours)[:3]}, the files' like {list(entries)[:3]}.{hint} "
            f"Training would start from the initialization alone; pass the prefix where the Hugging Face model sits."
        )
    shapes, casts = [], []
    for hf_key, module_key in mapping.items():
        entry, target = entries[hf_key], module_state[module_key]
        if tuple(target.shape) != entry.shape:
            shapes.append(f"{hf_key!r} in {entry.file!r}: file {list(entry.shape)} vs module {list(target.shape)}")
        if entry.dtype != str(target.dtype).removeprefix("torch."):
            casts.append(f"{hf_key!r}: file {entry.dtype} vs module {str(target.dtype).removeprefix('torch.')}")
    if shapes:
        raise ValueError(
            f"Hugging Face weights {source}: shapes differ from the module's for {len(shapes)} tensor(s): {shapes[:6]}. "
            f"Build the module from the same config (hidden size, vocabulary, heads) as the checkpoint."
        )
    if casts and not allow_cast:
        raise ValueError(
            f"Hugging Face weights {source}: dtypes differ from the module's for {len(casts)} tensor(s): {casts[:4]}; loading "
            f"would cast them silently. Build the module in the file's dtype, or pass allow_cast=True to cast on load."
        )
    return mapping, missing, unexpected


def _prefix_hint(module_keys: list[str], file_keys: list[str], prefix: str) -> str:
    """A likely prefix when the names differ by one, e.g. the LightningModule attribute ``net.``."""
    files = set(file_keys)
    for key in module_keys:
        parts = key.split(".")
        for i in range(1, len(parts)):
            if ".".join(parts[i:]) in files:
                guess = prefix + ".".join(parts[:i]) + "."
                return f" The module's keys look like {prefix + key!r}, the files' like {'.'.join(parts[i:])!r}: pass prefix={guess!r}."
    return ""


class _DeferredLoad:
    """:func:`load_hf_weights` run by materialize, which allocates the tensors it names and initializes only the others."""

    def __init__(self, module: nn.Module, path: Path, *, prefix: str, strict: bool, allow_cast: bool) -> None:
        self.module, self.path = module, path
        self.prefix, self.strict, self.allow_cast = prefix, strict, allow_cast

    def covered(self) -> set[str]:
        """The module keys the files fill (tied copies included), checked as the load will check them."""
        source = repr(str(self.path))
        elsewhere = set(self.module.__dict__.get("_hp_pipeline_elsewhere", ()))
        entries = on_rank0(lambda: _inspect(self.path))
        names = FileNames(self.module)
        ties = _tie_groups(self.module)

        def plan() -> set[str]:
            # Names, shapes and dtypes only: the tensors are still on the meta device. Compared under the
            # files' names (no torch.compile wrapper, peft's base layers in place); returned under the module's own.
            own = self.module.state_dict()
            by_file = names.mapping(own)
            mapping, _, _ = _plan_load(
                entries, {file: own[name] for file, name in by_file.items()}, _file_ties(names, ties), prefix=self.prefix,
                strict=self.strict, allow_cast=self.allow_cast, elsewhere=elsewhere, source=source,
            )
            return {by_file[file] for file in mapping.values()}

        covered = on_every_rank(plan)
        for group in ties:
            if covered & set(group):
                covered |= set(group)
        return covered

    def load(self) -> None:
        load_hf_weights(self.module, self.path, prefix=self.prefix, strict=self.strict, allow_cast=self.allow_cast)


def defer_until_materialized(module: nn.Module, path: Path, *, prefix: str = "", strict: bool = True, allow_cast: bool = False) -> bool:
    """Leave the load to the strategy when ``module`` awaits its materialization; returns whether it did.

    The strategy then initializes only the tensors the files do not hold (rotary ``inv_freq``, a new
    head) and loads the files into the others: nothing is initialized to be overwritten.
    """
    if not awaits_materialization(module):
        return False
    defer_weights(module, _DeferredLoad(module, path, prefix=prefix, strict=strict, allow_cast=allow_cast))
    return True


def load_hf_weights(
    module: nn.Module,
    path: Path,
    *,
    prefix: str = "",
    strict: bool = True,
    allow_cast: bool = False,
    elsewhere: Collection[str] = (),
) -> None:
    """Load a Hugging Face safetensors directory into a (sharded) module, each rank reading its own slices.

    Call it on every rank once the model is sharded and materialized. Headers, keys, shapes and dtypes
    are checked before any tensor is read, so a refusal is raised on every rank alike; then each rank
    reads only the rows of the tensors it holds, through a memory map.

    Args:
        prefix: where the Hugging Face model sits inside ``module`` (``"net."`` for ``self.net``).
        strict: a key missing on either side is an error, else reported and skipped. Tied weights
            count as present when the file holds either name (Hugging Face stores them once).
        allow_cast: cast on copy when dtypes differ; off by default (a silent cast changes precision).
        elsewhere: module keys other ranks hold (a pipeline's other stages): neither missing nor unexpected.

    Raises:
        CorruptCheckpointError, UnsafeCheckpointError: a damaged directory, a link, a file outside it.
        ValueError: keys, shapes or dtypes that do not fit the module, or a module still on the meta device.
    """
    path = Path(path)
    source = repr(str(path))
    elsewhere = set(elsewhere) | set(module.__dict__.get("_hp_pipeline_elsewhere", ()))
    entries = on_rank0(lambda: _inspect(path))
    names = FileNames(module)
    ties = _file_ties(names, _tie_groups(module))
    module_state: dict[str, Any] = {}  # under the files' names (see FileNames); by_file gives the module's own
    by_file: dict[str, str] = {}

    def compare() -> tuple[dict[str, str], list[str], list[str]]:
        own = get_model_state_dict(module)
        by_file.update(names.mapping(own))
        module_state.update({file: own[name] for file, name in by_file.items()})
        on_meta = [k for k, v in module_state.items() if k.startswith(prefix) and getattr(v, "is_meta", False)]
        if on_meta:
            raise ValueError(
                f"load_weights({source}): the module is still on the meta device ({on_meta[:4]}); loading into it would "
                f"keep nothing. Call it in configure_model (Trainer) or before fabric.setup, on the model built there by "
                f"HSDPStrategy, so that the strategy loads it while materializing; or once it has sharded and materialized "
                f"the model (on_fit_start, or after fabric.setup); or materialize it yourself first (module.to_empty(device=...))."
            )
        return _plan_load(
            entries, module_state, ties, prefix=prefix, strict=strict, allow_cast=allow_cast, elsewhere=elsewhere, source=source
        )

    mapping, missing, unexpected = on_every_rank(compare)
    copies = _tied_copies(entries, ties, prefix)
    if dist.is_initialized():  # a pipeline stage may tie names the others do not hold: rank 0 compares every rank's
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, copies)
        copies = sorted({group for rank_copies in every for group in rank_copies})
    if copies:
        on_rank0(lambda: _check_tied_copies(path, entries, copies))
    if missing:
        warn_rank0(f"Hugging Face weights {source}: {len(missing)} module key(s) not in the files, kept as initialized: {missing[:8]}")
    if unexpected:
        warn_rank0(f"Hugging Face weights {source}: {len(unexpected)} file key(s) the module lacks, ignored: {unexpected[:8]}")
    request = {hf_key: module_state[module_key] for hf_key, module_key in mapping.items()}
    error: Optional[BaseException] = None
    try:
        dcp.load(request, storage_reader=HuggingFaceStorageReader(str(path)), planner=StrictHFPlanner(source), no_dist=not dist.is_initialized())
    except (Exception, dcp.CheckpointException) as exc:  # noqa: BLE001 - DCP's collectives already ran (its CheckpointException is a BaseException)
        causes = [f[0] if isinstance(f, tuple) else f for _, f in sorted(getattr(exc, "failures", {}).items())] or [exc]
        ours = [cause for cause in causes if isinstance(cause, CorruptCheckpointError)]
        error = CorruptCheckpointError(str(ours[0]) if ours else f"Hugging Face weights {source} could not be read: {type(exc).__name__}: {exc}")
    if error is not None:
        raise error
    loaded = {by_file[file_key]: request[hf_key] for hf_key, file_key in mapping.items()}
    set_model_state_dict(module, loaded, options=StateDictOptions(strict=False))


class StrictHFPlanner(DefaultLoadPlanner):
    """DCP's planner for the Hugging Face read, strict: every tensor requested is found and every element of it is read.

    Rank 0 checked the headers, but each rank's reader lists its own copy of the directory: a key it
    does not find, or chunks that do not cover the rank's part, would otherwise keep the initialization.
    """

    def __init__(self, source: str) -> None:
        super().__init__(allow_partial_load=False)
        self.source = source

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None  # set by DCP before planning
        absent = sorted(fqn for fqn in self.state_dict if fqn not in self.metadata.state_dict_metadata)
        if absent:
            raise CorruptCheckpointError(
                f"Hugging Face weights {self.source}: DCP's reader on rank {rank()} finds no tensor {absent[:6]} in the "
                f"directory, which rank 0 read them from (does this node hold a different or incomplete copy?); nothing is "
                f"loaded rather than keeping {'them' if len(absent) > 1 else 'it'} as initialized."
            )
        plan = super().create_local_plan()
        read: dict[str, int] = {}
        for item in plan.items:
            read[item.dest_index.fqn] = read.get(item.dest_index.fqn, 0) + math.prod(item.lengths)
        short = []
        for fqn, value in self.state_dict.items():
            chunks = value.__create_chunk_list__() if hasattr(value, "__create_chunk_list__") else None
            wanted = sum(math.prod(chunk.sizes) for chunk in chunks) if chunks is not None else int(value.numel())
            if read.get(fqn, 0) != wanted:
                short.append(f"{fqn!r} ({read.get(fqn, 0):,} of its {wanted:,} elements here)")
        if short:
            raise CorruptCheckpointError(
                f"Hugging Face weights {self.source}: DCP's reader on rank {rank()} would fill only part of {short[:6]}; the "
                f"files place those tensors elsewhere than their headers' shapes say. Nothing is loaded."
            )
        return plan


def _file_ties(names: FileNames, ties: list[list[str]]) -> list[list[str]]:
    """Tied groups under the files' names (a group of adapters only drops out)."""
    groups = [[file for name in group if (file := names.file_name(name)) is not None] for group in ties]
    return [group for group in groups if len(group) > 1]


def _tied_copies(entries: Mapping[str, _Entry], ties: list[list[str]], prefix: str) -> list[tuple[str, ...]]:
    """The tied groups (file keys) of which the files hold more than one copy: only one can be loaded into the shared parameter."""
    held = [tuple(n[len(prefix):] for n in group if n.startswith(prefix) and n[len(prefix):] in entries) for group in ties]
    return [copies for copies in held if len(copies) > 1]


#: Elements compared at a time when two tied copies are checked against each other (two such blocks in memory).
_COMPARE_ELEMENTS = 1 << 22


def _check_tied_copies(directory: Path, entries: Mapping[str, _Entry], groups: Sequence[tuple[str, ...]]) -> None:
    """Refuse files holding two copies of tied weights that differ (bit for bit), naming both keys and the largest difference.

    Loading one would silently drop the other. Read block by block (memory maps), never both whole.
    """
    from safetensors import safe_open

    for group in groups:
        first = entries[group[0]]
        for key in group[1:]:
            other = entries[key]
            where = f"Hugging Face directory {str(directory)!r}: {group[0]!r} (in {first.file!r}) and {key!r} (in {other.file!r})"
            if first.shape != other.shape or first.dtype != other.dtype:
                raise CorruptCheckpointError(
                    f"{where} are tied in the module (one parameter) but the files hold them as {list(first.shape)} {first.dtype} and "
                    f"{list(other.shape)} {other.dtype}; loading one would silently drop the other. Remove the copy you do not want."
                )
            with safe_open(str(directory / first.file), framework="pt") as fa, safe_open(str(directory / other.file), framework="pt") as fb:
                a, b = fa.get_slice(group[0]), fb.get_slice(key)
                rows = first.shape[0] if first.shape else 1
                step = max(1, _COMPARE_ELEMENTS // max(1, math.prod(first.shape[1:])))
                largest: Optional[float] = None
                for start in range(0, rows, step):
                    x, y = (a[start:start + step], b[start:start + step]) if first.shape else (fa.get_tensor(group[0]), fb.get_tensor(key))
                    if torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                        continue
                    wide = torch.complex128 if x.is_complex() else torch.float64
                    gap = float((x.to(wide) - y.to(wide)).abs().max())
                    largest = gap if largest is None or not gap <= largest else largest
            if largest is not None:
                raise CorruptCheckpointError(
                    f"{where} are tied in the module (one parameter) but differ in the files (largest difference {largest:.6g}); "
                    f"loading one would silently drop the other. Remove the copy you do not want from the files, or load into a "
                    f"module that does not tie them."
                )


# ---------------------------------------------------------------- writing


def parse_size(value: Union[int, str]) -> int:
    """``"5GB"`` (10^9), ``"500MiB"`` (2^20 each), ``"50KB"`` or a byte count -> bytes; ValueError for anything else or < 1."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.match(str(value))
        if match is None:
            raise ValueError(f"max_shard_size expects a size like '5GB', '500MB', '2GiB' or a byte count; got {value!r}.")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()])
    if size < 1:
        raise ValueError(f"max_shard_size must be at least one byte; got {value!r}.")
    return size


def _file_plan(sizes: Mapping[str, int], max_shard_size: int) -> dict[str, int]:
    """Tensor -> 1-based file index: in order, a new file when the next tensor would pass the limit.

    Unlike huggingface_hub's planner it needs only sizes (which every pipeline stage sends), not tensors.
    """
    plan: dict[str, int] = {}
    index, used = 1, 0
    for key, size in sizes.items():
        if used and used + size > max_shard_size:
            index, used = index + 1, 0
        plan[key] = index
        used += size
    return plan


def _read_config(config: Optional[Path]) -> dict[str, Any]:
    if config is None:
        return {}
    config = Path(config)
    file = config / "config.json" if config.is_dir() else config
    if not file.is_file():
        raise FileNotFoundError(f"config={str(config)!r}: expected a Hugging Face model directory holding config.json (or the file itself).")
    try:
        data = json.loads(file.read_text())
    except ValueError as exc:
        raise ValueError(f"{str(file)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{str(file)!r} holds {type(data).__name__}, not a Hugging Face config object.")
    return data


@dataclass(frozen=True)
class _Previous:
    """An earlier export of ours: its token, its listed files present (deleted later), the user's files (carried over)."""

    token: str
    files: tuple[str, ...]
    carried: tuple[str, ...]


def _check_target(out: Path, *, overwrite: bool) -> Optional[_Previous]:
    """What may be replaced at ``out``: nothing if it is absent or empty; with ``overwrite``, an earlier export of ours
    (:func:`_read_export_record`). Raises for anything else."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise FileExistsError(f"Hugging Face export: {str(out)!r} exists and is not a directory; choose another path.")
    if not out.exists() or not any(out.iterdir()):
        return None
    if not overwrite:
        raise FileExistsError(
            f"Hugging Face export: {str(out)!r} already exists and is not empty; choose a new path, or pass "
            f"overwrite=True (--overwrite) to replace an earlier export there."
        )
    return _read_export_record(out)


_TOKEN = re.compile(r"^[0-9a-f]{12}$")


def _read_export_record(out: Path) -> _Previous:
    """The earlier export at ``out``, checked before anything is written.

    Its record (ours, naming the token the directory's ``TOKEN_FILE`` holds) must list only plain names
    of regular files directly inside ``out``; every other entry must be a regular file of the user's
    (a README, tokenizer files), never weights. Anything else is refused, naming it.
    """
    record = out / EXPORT_RECORD
    where = f"Hugging Face export: {str(out)!r}"
    links = [name for name in (EXPORT_RECORD, TOKEN_FILE) if (out / name).is_symlink()]
    if links:
        raise UnsafeCheckpointError(f"{where}: its {links} {'is a link' if len(links) == 1 else 'are links'}; an export of ours writes regular files there.")
    try:
        with open_regular(record) as f:
            data = json.loads(f.read(1 << 20))
        with open_regular(out / TOKEN_FILE) as f:
            mark = f.read(64).decode("ascii", "replace")
    except FileNotFoundError:
        raise UnsafeCheckpointError(
            f"{where} holds no export record of ours ({EXPORT_RECORD} and {TOKEN_FILE}): this program did not write it (or "
            f"wrote it before exports were marked), so nothing in it is replaced or deleted. Choose another directory."
        ) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # a FIFO or device in their place: open_regular's own error
        if isinstance(exc, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{where}: its {EXPORT_RECORD} is not valid JSON ({type(exc).__name__}); nothing is replaced.") from None
    ours = isinstance(data, dict) and data.get("writer") == "hp_lightning"
    files = data.get("files") if ours else None
    token = data.get("token") if ours else None
    if not isinstance(files, list) or not all(isinstance(n, str) for n in files) or not isinstance(token, str) or not _TOKEN.match(token):
        raise CorruptCheckpointError(f"{where}: its {EXPORT_RECORD} is not a record this program writes (a token and a list of file names); nothing is replaced.")
    if mark != token:
        raise UnsafeCheckpointError(
            f"{where}: its {EXPORT_RECORD} names token {token!r}, which the directory's {TOKEN_FILE} does not hold: the record "
            f"was not written with this directory, so nothing it lists is deleted. Choose another directory."
        )
    present = []
    for name in files:
        reason = outside_reason(out, name)
        if reason is None and ("/" in name or "\\" in name or name in (".", EXPORT_RECORD, TOKEN_FILE)):
            reason = "it is not a plain file name directly inside the output"
        if reason is None:
            try:
                mode = os.lstat(out / name).st_mode
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(mode):
                reason = "it is a link or a directory, not a file an export writes"
        if reason is not None:
            raise UnsafeCheckpointError(
                f"{where}: entry {name!r} of its {EXPORT_RECORD} is refused ({reason}); an overwrite deletes only regular files "
                f"directly inside the output that the record lists, so nothing is replaced. The record was altered."
            )
        present.append(name)
    carried, refused = [], []
    for entry in sorted(out.iterdir(), key=lambda p: p.name):
        if entry.name in files or entry.name in (EXPORT_RECORD, TOKEN_FILE):
            continue
        if entry.name.endswith(SUFFIX) or entry.name == HF_INDEX_FILE:
            refused.append(f"{entry.name!r} (weights this program did not write)")
        elif not stat.S_ISREG(os.lstat(entry).st_mode):
            refused.append(f"{entry.name!r} (a link or a directory this program did not write)")
        else:
            carried.append(entry.name)
    if refused:
        raise UnsafeCheckpointError(
            f"{where} holds {', '.join(refused[:6])}; they are never replaced, deleted or moved. Choose another directory, or "
            f"move them out first."
        )
    return _Previous(token, tuple(present), tuple(carried))


def _carry(source: Path, target: Path) -> None:
    """The user's file ``source`` under ``target`` too: a hard link (the same file), or a copy where links are not supported."""
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, target, follow_symlinks=False)


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``b`` holds what ``a`` holds: the same file (a hard link), or a copy with equal bytes."""
    try:
        return os.path.samefile(a, b) or (os.path.getsize(a) == os.path.getsize(b) and filecmp.cmp(a, b, shallow=False))
    except OSError:
        return False


def _publish(staging: Path, out: Path, previous: Optional[_Previous], config: Optional[Path], token: str, dtype: Optional[torch.dtype]) -> list[str]:
    """Copy the config files in, record and mark what we wrote, and put the staged directory in ``out``'s place.

    Over an earlier export the user's files are hard-linked in first, then the directories are exchanged
    atomically (else renamed: ``out`` is briefly absent, never partial). The old directory then loses only
    the files its record listed and the carried files (checked to be in the new one); anything else stays.
    """
    if config is not None:
        base = Path(config) if Path(config).is_dir() else Path(config).parent
        for name in CONFIG_FILES:
            if (base / name).is_file():
                shutil.copyfile(base / name, staging / name)
        settings = _read_config(config)
        named = [k for k in ("dtype", "torch_dtype") if k in settings]
        if dtype is not None and named:  # from_pretrained builds the model in the config's dtype
            settings.update(dict.fromkeys(named, str(dtype).removeprefix("torch.")))
            (staging / "config.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    written = sorted(p.name for p in staging.iterdir() if p.name not in (EXPORT_RECORD, TOKEN_FILE))
    (staging / EXPORT_RECORD).write_text(json.dumps({"token": token, "files": written, "writer": "hp_lightning"}, indent=1))
    (staging / TOKEN_FILE).write_text(token)
    if not out.exists():
        os.rename(staging, out)
        layout.fsync_dir(out.parent)
        return written
    carried = previous.carried if previous is not None else ()
    clash = sorted(set(carried) & set(written))
    if clash:
        raise UnsafeCheckpointError(
            f"Hugging Face export: {str(out)!r} holds {clash}, which the earlier export did not write but this one does; "
            f"they are never replaced. Move them out first."
        )
    for name in carried:
        _carry(out / name, staging / name)
    if layout.exchange(staging, out):
        old = staging  # now holds the earlier export
    else:
        old = out.with_name(f"{out.name}.hp-export-old-{previous.token if previous else token}")
        os.rename(out, old)
        try:
            os.rename(staging, out)
        except OSError:
            os.rename(old, out)  # the earlier export back in its place
            raise
    layout.fsync_dir(out.parent)
    listed = (*previous.files, EXPORT_RECORD, TOKEN_FILE) if previous is not None else ()
    for name in (*listed, *carried):  # the new export is in place: nothing below may fail the export
        entry = old / name
        try:
            if stat.S_ISREG(os.lstat(entry).st_mode) and (name not in carried or _same_file(entry, out / name)):
                entry.unlink()
        except OSError:
            continue
    try:
        old.rmdir()
    except OSError:
        warn_rank0(f"Hugging Face export: the earlier export's directory {str(old)!r} still holds files its record did not list; left there.")
    return written


def _untie(state: dict[str, Any], ties: list[list[str]], prefix: str) -> dict[str, Any]:
    """Drop the later names of each tied group (Hugging Face stores a tied weight once, under its first name)."""
    drop = {n[len(prefix):] for group in ties for n in group[1:] if n.startswith(prefix)}
    return {k: v for k, v in state.items() if k not in drop}


def _cast(state: dict[str, Any], dtype: Optional[torch.dtype]) -> dict[str, Any]:
    if dtype is None:
        return state
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def save_hf(
    module: nn.Module,
    path: Path,
    *,
    prefix: str = "",
    config: Optional[Path] = None,
    max_shard_size: Union[int, str] = "5GB",
    dtype: Union[str, torch.dtype, None] = None,
    overwrite: bool = False,
    peft: Optional[str] = None,
) -> Path:
    """Write the (sharded) module as a Hugging Face directory, every rank writing its own part; call on every rank; returns ``path``.

    No gather: DCP's writer merges the ranks' parts into whole-tensor shards on rank 0 file by file
    (rank 0 never holds the model). Tied weights are written once, under their first name.

    Args:
        prefix: where the Hugging Face model sits inside ``module`` (``"net."``): only those keys, stripped.
        config: a Hugging Face model directory (or its ``config.json``) whose config files are copied in.
        max_shard_size: the largest file, like ``save_pretrained``'s (``"5GB"``, ``"500MB"``, bytes).
        dtype: cast floating tensors on write (``"bf16"``); None keeps the module's dtype.
        overwrite: replace an earlier export of ours at ``path`` (only the files it recorded).
        peft: required with peft adapters: ``"merged"`` folds each into its weight (``W + scale B A``, on
            the shards), for ``from_pretrained``; ``"adapter"`` writes peft's adapter directory, for
            ``PeftModel.from_pretrained(base, path)``.

    Raises:
        FileExistsError: ``path`` is not empty and ``overwrite`` is False.
        ValueError: a bad size or dtype, no key under ``prefix``, adapters without ``peft``, or an
            adapter ``"merged"`` cannot fold (DoRA, a LoRA bias, another tuner: use ``"adapter"``).
    """
    out = Path(path)
    limit = parse_size(max_shard_size)
    cast = parse_dtype(dtype, name="dtype")
    names = FileNames(module)
    check_peft_export(names, peft)
    if peft == "adapter":
        return _save_adapter(module, out, names, overwrite=overwrite)

    state: dict[str, Any] = {}

    def select() -> dict[str, int]:
        own = get_model_state_dict(module)
        if peft == "merged":
            own = merged_adapters(module, own)
        full = {file: own[name] for file, name in names.mapping(own).items()}
        chosen = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
        if not chosen:
            raise ValueError(f"save_hf: the module has no key under prefix {prefix!r} (its keys look like {list(full)[:3]}).")
        state.update(_cast(_untie(chosen, _file_ties(names, _tie_groups(module)), prefix), cast))
        return {k: _nbytes(v) for k, v in state.items()}

    sizes = on_every_rank(select)
    if dist.is_initialized():  # pipeline stages hold different keys: every rank plans the files of all of them
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, sizes)
        sizes = {k: v for rank_sizes in every for k, v in rank_sizes.items()}
    plan = _file_plan(sizes, limit)

    def prepare() -> tuple[str, Optional[_Previous]]:
        _read_config(config)
        previous = _check_target(out, overwrite=overwrite)
        token = layout.new_token()
        out.parent.mkdir(parents=True, exist_ok=True)
        layout.staging_path(out, token).mkdir()
        return token, previous

    token, previous = on_rank0(prepare)
    staging = layout.staging_path(out, token)
    error: Optional[BaseException] = None
    try:
        writer = HuggingFaceStorageWriter(str(staging), fqn_to_index_mapping=plan, save_distributed=True, enable_consolidation=True)
        dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())
    except Exception as exc:  # noqa: BLE001 - shared below
        error = exc
    state.clear()
    try:
        agree(error)
    except BaseException:
        if rank() == 0 and staging.is_dir():
            shutil.rmtree(staging)  # our own staging directory, named with this save's token
        raise

    def finish() -> list[str]:
        parts = staging / _PARTS_DIR
        if parts.is_dir():
            shutil.rmtree(parts)  # inside our own staging directory: only DCP's parts of this save
        return _publish(staging, out, previous, config, token, cast)

    on_rank0(finish)
    return out


def _save_adapter(module: nn.Module, out: Path, names: FileNames, *, overwrite: bool) -> Path:
    """peft's adapter directory for ``module``'s one ``PeftModel``, gathered to rank 0 and published as an export of ours."""
    from safetensors.torch import save_file

    peft_model, state = adapter_state(module, names)  # every rank: the gather is a collective

    def write() -> None:
        previous = _check_target(out, overwrite=overwrite)
        token = layout.new_token()
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = layout.staging_path(out, token)
        staging.mkdir()
        try:
            save_file({k: v.contiguous() for k, v in state.items()}, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            peft_model.peft_config[peft_model.active_adapter].save_pretrained(str(staging))
            _publish(staging, out, previous, None, token, None)
        except BaseException:
            if staging.is_dir():
                shutil.rmtree(staging)  # our own staging directory, named with this save's token
            raise

    on_rank0(write)
    return out


def export_hf(
    src: Path,
    out: Path,
    *,
    prefix: Optional[str] = None,
    config: Optional[Path] = None,
    max_shard_size: Union[int, str] = "5GB",
    dtype: Union[str, torch.dtype, None] = None,
    overwrite: bool = False,
    trust_pickle: bool = False,
    ema: bool = False,
) -> str:
    """Write checkpoint ``src`` (a sharded directory or a full file) as a Hugging Face directory; return a summary.

    One process, no process group; read by the project's readers (checked, pickles safe unless
    ``trust_pickle``). With ``config`` saying ``tie_word_embeddings`` the tied copy is dropped (it must
    equal the input embedding, else refused).

    Args: as :func:`save_hf`, and ``prefix`` None: no prefix, but keys that all start with one attribute
        (``net.``) are refused, naming the ``--prefix`` to pass (unstripped, ``from_pretrained`` would
        silently initialize the model at random); ``""`` writes them as they are. ``ema``: write the
        ``ShardedEMA`` average in place of the weights (a tied weight too), in the weight's dtype unless
        ``dtype`` casts it from the average's fp32.

    Raises:
        FileExistsError, ValueError: as :func:`save_hf`; a tied copy that differs; with ``ema``, no
            average or one that does not fit the weights.
        CorruptCheckpointError, UnsafeCheckpointError: as the readers.
    """
    src, out = Path(src), Path(out)
    limit = parse_size(max_shard_size)
    cast = parse_dtype(dtype, name="dtype")
    settings = _read_config(config)
    previous = _check_target(out, overwrite=overwrite)
    full = layout.classify(src) is layout.CheckpointKind.FULL_FILE
    if full:
        checkpoint = read_full_file(src, weights_only=False if trust_pickle else None)
    else:
        checkpoint = read_sharded(src, weights_only=True, trust_pickle=trust_pickle)
    weights = checkpoint.get(MODEL_KEY)
    if not isinstance(weights, dict):
        raise ValueError(f"{str(src)!r} holds no model weights ({MODEL_KEY!r}); export-hf needs a checkpoint with them.")
    if ema:
        averages = _averages_in(src, checkpoint if full else None, trust_pickle=trust_pickle)
        weights = _averages_for_weights(src, weights, averages, keep_dtype=cast is None)
    roots = {k.split(".", 1)[0] for k in weights}
    if prefix is None and len(roots) == 1 and all("." in k for k in weights):
        root = next(iter(roots))
        raise ValueError(
            f"{str(src)!r}: every key starts with {root + '.'!r} (the LightningModule's attribute holding the model?); "
            f"written as they are, from_pretrained would match none of them. Pass --prefix {root}. (or --prefix '' to keep them)."
        )
    prefix = prefix or ""
    state = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix) and isinstance(v, torch.Tensor)}
    if not state:
        raise ValueError(
            f"{str(src)!r} has no tensor under prefix {prefix!r}; its keys look like {list(weights)[:3]}. Pass the "
            f"LightningModule attribute holding the model, e.g. --prefix net."
        )
    dropped = []
    if settings.get("tie_word_embeddings", True) and config is not None:
        for key in TIED_OUTPUT_KEYS:
            if key not in state:
                continue
            twins = [k for k, v in state.items() if k != key and v.shape == state[key].shape and torch.equal(v, state[key])]
            if not twins:
                raise ValueError(
                    f"{str(config)!r} says tie_word_embeddings (the default when absent), but {key!r} equals no other "
                    f"tensor of the checkpoint: writing it tied would change the model. Use the config of the model "
                    f"you trained (tie_word_embeddings: false), or train it tied."
                )
            del state[key]
            dropped.append(key)
    state, _ = _safetensors_ready(_cast(state, cast))  # contiguous, tied copies under two names stored twice
    plan = _file_plan({k: _nbytes(v) for k, v in state.items()}, limit)
    token = layout.new_token()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = layout.staging_path(out, token)
    staging.mkdir()
    try:
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(staging), fqn_to_index_mapping=plan), no_dist=True)
        written = _publish(staging, out, previous, config, token, cast)
    except BaseException:
        if staging.is_dir():
            shutil.rmtree(staging)  # our own staging directory, named with this export's token
        raise
    files = [n for n in written if n.endswith(SUFFIX)]
    note = f", tied copy {dropped} dropped" if dropped else ""
    what = "the ShardedEMA average of " if ema else ""
    return f"wrote {out} ({len(state)} tensors in {len(files)} safetensors file(s){note}) from {what}{src}"


def _averages_in(src: Path, checkpoint: Optional[Mapping[str, Any]], *, trust_pickle: bool) -> dict[str, torch.Tensor]:
    """The ``ShardedEMA`` average checkpoint ``src`` holds, whole, by parameter name; ValueError if none.

    From a sharded directory only optimizer 0's average entries are read, not the optimizer's own state.
    """
    from hp_lightning.core.ema import AVERAGE, CHECKPOINT_KEY, FORMAT, averaged_weights_in

    found: Optional[dict[str, torch.Tensor]] = None
    if checkpoint is None:
        found = _read_sharded_average(src, (OPTIMIZER_ENTRY, CHECKPOINT_KEY, "state"), AVERAGE, trust_pickle=trust_pickle)
    else:
        with contextlib.suppress(KeyError):
            found = averaged_weights_in(checkpoint)
    if not found:
        raise ValueError(
            f"export-hf --ema: {str(src)!r} holds no ShardedEMA average (looked for optimizer 0's {CHECKPOINT_KEY!r} "
            f"state, where a sharded save keeps it, and a callback state of format {FORMAT!r}, where a full save does). "
            f"It was saved without hp_lightning.callbacks.ShardedEMA, as weights only, or consolidated with "
            f"--weights-only. Export the weights (drop --ema), or train with ShardedEMA in the Trainer's callbacks and "
            f"export one of its checkpoints."
        )
    return found


#: Where a sharded Trainer checkpoint keeps optimizer 0 (and the average beside its state).
OPTIMIZER_ENTRY = "optimizer_0"


def _read_sharded_average(src: Path, under: tuple[str, ...], leaf: str, *, trust_pickle: bool) -> dict[str, torch.Tensor]:
    """The tensors of sharded directory ``src`` stored at ``under + (name, leaf)``, whole, by ``name`` (nothing else read)."""
    import warnings

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hp_lightning.checkpoint.read import dcp_load, read_dcp_metadata

    pickles = False if trust_pickle else None
    metadata = read_dcp_metadata(src, weights_only=pickles)
    routes = metadata.planner_data or {}
    wanted: dict[str, tuple[str, torch.Tensor]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        route = tuple(routes.get(key, (key,)))
        if len(route) == len(under) + 2 and route[: len(under)] == under and route[-1] == leaf and isinstance(entry, TensorStorageMetadata):
            wanted[key] = (str(route[len(under)]), torch.empty(entry.size, dtype=entry.properties.dtype))
    if wanted:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp_load({key: tensor for key, (_, tensor) in wanted.items()}, src, weights_only=pickles, no_dist=True)
    return dict(wanted.values())


def _averages_for_weights(
    src: Path, weights: Mapping[str, Any], averages: Mapping[str, torch.Tensor], *, keep_dtype: bool
) -> dict[str, Any]:
    """``weights`` with each averaged parameter's average in place of its weight (and of a weight tied to it).

    A weight equal bit for bit to an averaged one (a tied copy saved under a second name) takes that
    average too. ``keep_dtype``: each average cast to its weight's dtype.
    """
    unknown = sorted(set(averages) - set(weights))
    if unknown:
        raise ValueError(
            f"export-hf --ema: the ShardedEMA average in {str(src)!r} covers {len(unknown)} parameter(s) its model weights "
            f"lack, e.g. {unknown[:3]} (weights like {list(weights)[:3]}): the checkpoint mixes two models. Export another checkpoint."
        )
    out = dict(weights)
    by_shape: dict[tuple[tuple[int, ...], torch.dtype], list[str]] = {}
    for name, average in averages.items():
        weight = weights[name]
        if not isinstance(weight, torch.Tensor) or tuple(average.shape) != tuple(weight.shape):
            raise ValueError(
                f"export-hf --ema: the ShardedEMA average of {name!r} in {str(src)!r} has shape {tuple(average.shape)}, its "
                f"weight {tuple(getattr(weight, 'shape', ()))}: the checkpoint mixes two models. Export another checkpoint."
            )
        out[name] = average.to(weight.dtype) if keep_dtype else average
        by_shape.setdefault((tuple(weight.shape), weight.dtype), []).append(name)
    for name, weight in weights.items():
        if name in averages or not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            continue
        twin = next((n for n in by_shape.get((tuple(weight.shape), weight.dtype), []) if torch.equal(weights[n], weight)), None)
        if twin is not None:
            out[name] = out[twin]
    return out
