"""Saving a sharded model's checkpoint from every rank: staged, checksummed, then published in one step.

* **sharded**: every rank writes its own shards with DCP into a staging directory, rank 0 adds
  ``meta.pt`` and the manifest (each file's size and CRC-32s), then publishes. Loads into any mesh;
  needs a filesystem every rank sees. :class:`AsyncSaves` writes the same save in the background.
* **full**: rank 0 holds the gathered state and writes one ``torch.save`` file alone.
"""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

import lightning
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from hp_lightning._version import __version__
from hp_lightning.checkpoint import layout
from hp_lightning.checkpoint.collective import agree, on_rank0, rank, world_size
from hp_lightning.checkpoint.integrity import file_record, shard_record
from hp_lightning.checkpoint.layout import DCP_METADATA_FILE, FORMAT_VERSION, FULL_INFO_KEY, MANIFEST_FILE, META_FILE, MODEL_KEY, OPTIMIZER_KEY
from hp_lightning.core import devices


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (hp_lightning's or Lightning's layout)."""
    path = Path(path)
    return path.is_dir() and ((path / MANIFEST_FILE).is_file() or (path / DCP_METADATA_FILE).is_file())


def mesh_record(state: Mapping[str, Any]) -> dict[str, Any]:
    for value in state.values():
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            return {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or ()), "device_type": mesh.device_type}
    return {}


def producer_record() -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "hp_lightning_version": __version__,
        "torch_version": torch.__version__.split("+")[0],
        "lightning_version": lightning.__version__,
        "world_size": world_size(),
    }


def prepare_target(path: Path, *, overwrite: bool = True, what: str = "Cannot save a checkpoint") -> Path:
    """Rank 0: finish a swap a kill interrupted, drop what killed saves left, make a marked staging directory."""
    if path.exists() and not path.is_dir() and not path.is_file():
        raise ValueError(f"{what} to {str(path)!r}: something other than a file or directory is there.")
    # A save replaces an older checkpoint of the same name (a conversion only when asked), and nothing else.
    layout.refuse_foreign(path, overwrite=overwrite, what=what)
    layout.recover(path)
    layout.clean_stale(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return layout.new_staging(path)


@layout.cyclic_gc_paused
def save_checkpoint(checkpoint: dict[str, Any], path: Path, *, sharded: bool, checksums: bool = False) -> None:
    """Write Lightning's ``checkpoint`` dict to ``path`` from every rank; the save appears whole or not at all.

    The state must come from :func:`model_state_dict` / :func:`optimizer_state_dict` with ``full = not sharded``.
    ``checksums`` (sharded): also record every file's SHA-256 (a read-back; cryptographic strength, not
    more coverage than the CRC-32s). A failed write raises the same OSError on every rank, nothing published.
    """
    path = Path(path)
    if sharded:
        _save_sharded(dict(checkpoint), path, checksums=checksums)
    else:
        _save_full(dict(checkpoint), path)


def _split(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what DCP writes: model and optimizer tensors, the rest of Lightning's checkpoint for ``meta.pt``)."""
    tensors: dict[str, Any] = {MODEL_KEY: checkpoint.pop(MODEL_KEY, {})}
    for index, optim_state in enumerate(checkpoint.pop(OPTIMIZER_KEY, None) or []):
        tensors[f"optimizer_{index}"] = optim_state
    return tensors, checkpoint


#: Index of the extra write result that carries a rank's file records to DCP's coordinator.
_RECORDS_INDEX = MetadataIndex(fqn="__hp_lightning_file_records__")


class RecordingWriter(FileSystemWriter):
    """torch's DCP ``FileSystemWriter`` that also records each shard file's integrity record (:func:`shard_record`).

    Each rank hands its records to the coordinator inside its write results, which DCP already gathers;
    :meth:`finish` takes them out before the index is written (``.metadata`` is plain DCP's), leaving
    every rank's in :attr:`records` on rank 0, with no collective of its own.
    """

    def __init__(self, path: Path, *, sha256: bool = False) -> None:
        super().__init__(str(path))  # DCP's defaults: one file per rank, fsynced
        self.sha256 = sha256
        self.records: dict[str, dict[str, Any]] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        results: list[WriteResult] = super().write_data(plan, planner).wait()
        spans: dict[str, list[tuple[int, int]]] = {}
        for result in results:
            info = result.storage_data
            spans.setdefault(info.relative_path, []).append((info.offset, info.length))
        root = Path(self.path)
        records = {name: shard_record(root / name, items, sha256=self.sha256) for name, items in spans.items()}
        done: torch.futures.Future = torch.futures.Future()
        done.set_result([*results, WriteResult(index=_RECORDS_INDEX, size_in_bytes=0, storage_data=records)])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        for result in (r for rank_results in results for r in rank_results if r.index == _RECORDS_INDEX):
            self.records.update(result.storage_data)
        super().finish(metadata, [[r for r in rank_results if r.index != _RECORDS_INDEX] for rank_results in results])


def _first_failure(exc: BaseException) -> tuple[BaseException, str]:
    """The underlying error of a DCP ``CheckpointException`` (the lowest failed rank's) and where it arose."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        source, failure = min(failures.items())
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, BaseException):
            return cause, f"rank {source}: "
    return exc, ""


def _abandon(staging: Path, path: Path, exc: BaseException) -> NoReturn:
    """Rank 0: drop the unpublished staging directory and raise the write failure, named (shared by the caller)."""
    cause, source = _first_failure(exc)
    with contextlib.suppress(OSError):  # else the next save of this name clears it
        layout.remove(staging)
    raise layout.write_error(cause, path, source=source) from None


def _start_sharded(path: Path, rest: dict[str, Any]) -> Path:
    """Rank 0: a fresh staging directory holding ``meta.pt``."""
    staging = prepare_target(path)
    try:
        # The producer record marks hp_lightning's layout even if the manifest is later lost.
        torch.save({**rest, FULL_INFO_KEY: {**producer_record(), "format": "sharded"}}, staging / META_FILE)
        layout.fsync_file(staging / META_FILE)
    except (OSError, RuntimeError) as exc:
        _abandon(staging, path, exc)
    return staging


def _finish_sharded(staging: Path, path: Path, records: Mapping[str, Any], tensors: Mapping[str, Any], checksums: bool) -> None:
    """Rank 0, once every rank's files are written: the manifest (the completion mark), then publish."""
    try:
        files = {n: records.get(n) or file_record(staging / n, checksum=checksums) for n in layout.data_files(staging)}
        manifest = {
            **producer_record(),
            "format": "sharded",
            "model_key": MODEL_KEY,
            "num_optimizers": len(tensors) - 1,
            "mesh": mesh_record(tensors[MODEL_KEY]),
            "checksum": "sha256" if checksums else "crc32",
            "files": files,
        }
        layout.write_manifest(staging, manifest)
    except OSError as exc:
        _abandon(staging, path, exc)
    layout.publish(staging, path)


def _save_sharded(checkpoint: dict[str, Any], path: Path, *, checksums: bool) -> None:
    tensors, rest = _split(checkpoint)
    staging = on_rank0(lambda: _start_sharded(path, rest))
    writer = RecordingWriter(staging, sha256=checksums)
    # Every rank writes its shards; DCP gathers their outcome (and the file records), so a failure
    # raises on all ranks: rank 0 then clears the staging directory and every rank raises its message.
    try:
        dcp.save(tensors, storage_writer=writer, no_dist=not dist.is_initialized())
    except dcp.CheckpointException as exc:
        on_rank0(lambda failure=exc: _abandon(staging, path, failure))
    on_rank0(lambda: _finish_sharded(staging, path, writer.records, tensors, checksums))


class AsyncSaves:
    """Sharded saves that write while training goes on, at most one in flight (``async_save=True``).

    :meth:`save` stalls only to copy the state to host memory and write ``meta.pt``; a background
    thread writes the shards, and rank 0 publishes when DCP reports every rank's write finished (no
    collective). A failure is raised by :meth:`wait` on every rank. Removals asked for meanwhile wait
    for the publish, so the previous checkpoint outlives an interrupted write. The background
    collectives run on a gloo group of their own, so they never interleave with training's.

    The host copy is kept between saves (no fresh allocation and page faults each time), at the price
    of one host copy of this rank's shards for the run (:meth:`close` frees it).
    """

    def __init__(self) -> None:
        self._group: Optional[dist.ProcessGroup] = None
        self._stager: Optional[DefaultStager] = None
        self._future: Optional[Future] = None
        self._lock = threading.Lock()
        self._published = threading.Event()
        self._published.set()
        self._failure: Optional[BaseException] = None  # rank 0: what went wrong while publishing
        self._removals: list[Path] = []
        self._saves = 0
        self._started = ""  # which save is in flight, and its target: for its error message
        self._target = Path(".")

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    @layout.cyclic_gc_paused
    def save(self, checkpoint: dict[str, Any], path: Path, *, checksums: bool = False) -> None:
        """Start a sharded save of Lightning's ``checkpoint`` dict; every rank calls it (first waiting for the previous)."""
        self.wait()
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend=devices.default_backend(devices.CPU))  # host copies: gloo
        if self._stager is None:  # synchronous copy: training may change the state right after save() returns
            pinned = devices.cuda_available()  # DCP pins host memory with CUDA only
            self._stager = DefaultStager(StagingOptions(pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False))
        self._saves += 1
        self._started, self._target = _describe_save(self._saves, Path(path), checkpoint), Path(path)
        tensors, rest = _split(dict(checkpoint))
        path = Path(path)
        staging = on_rank0(lambda: _start_sharded(path, rest))
        writer = RecordingWriter(staging, sha256=checksums)  # records made on the background thread
        if rank() == 0:
            self._published.clear()
        try:
            future = dcp.async_save(
                tensors, storage_writer=writer, process_group=self._group, async_stager=self._stager, no_dist=not dist.is_initialized()
            )
        except BaseException:
            self._published.set()
            raise
        assert isinstance(future, Future)  # staging is synchronous (use_async_staging=False): no AsyncSaveResponse
        self._future = future
        if rank() == 0:
            started = self._started
            future.add_done_callback(lambda done: self._publish(done, staging, path, tensors, writer, started))

    def _publish(self, done: Future, staging: Path, path: Path, tensors: Mapping[str, Any], writer: RecordingWriter, started: str) -> None:
        """Rank 0, on DCP's background thread: publish the finished save, then the removals it held back.

        ``_published`` is set last, under the lock, so a removal is never lost or racing the next save.
        """
        try:
            try:
                try:
                    done.result()
                except BaseException as exc:  # noqa: BLE001 - named, then re-raised on every rank by wait()
                    _abandon(staging, path, exc)
                _finish_sharded(staging, path, writer.records, tensors, writer.sha256)
            except BaseException as exc:  # noqa: BLE001 - re-raised on every rank by wait()
                self._failure = _in_background(exc, path, started)
                with contextlib.suppress(OSError):  # else the next save's clean-up removes it
                    layout.remove(staging)
            while True:
                with self._lock:
                    removals, self._removals = self._removals, []
                    if not removals:
                        self._published.set()
                        return
                for old in removals:
                    try:
                        layout.remove(old)
                    except OSError as exc:
                        self._failure = self._failure or exc
        finally:
            self._published.set()  # never leave wait() hanging, whatever failed above

    def remove(self, path: Path) -> None:
        """Rank 0: delete a checkpoint now, or once the save in flight is published."""
        with self._lock:
            if not self._published.is_set():
                self._removals.append(Path(path))
                return
        layout.remove(Path(path))

    def wait(self) -> None:
        """Block until the save in flight is written and published; its error (an OSError naming the save) on every rank.

        A collective: after a failure, when the other ranks may not come, do not call it.
        """
        future, self._future = self._future, None
        if future is None:
            return
        error: Optional[BaseException] = None
        try:
            future.result()
        except (Exception, dcp.CheckpointException) as exc:  # noqa: BLE001 - shared with every rank below (DCP's is a BaseException)
            error = _in_background(exc, self._target, self._started)
        if rank() == 0:
            self._published.wait()
            # Rank 0's account of a failure (made when it happened, so "N bytes free" is from then) is the one every rank raises.
            error, self._failure = self._failure or error, None
        agree(error)

    def close(self) -> None:
        """Free the kept host copy (a write in flight keeps what it is writing until it ends); no collective."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _describe_save(number: int, path: Path, checkpoint: Mapping[str, Any]) -> str:
    """"async save 3 of this run (to '...', started at global step 40, epoch 0)": which save an error is about."""
    when = [f"{name} {checkpoint[key]}" for key, name in (("global_step", "global step"), ("epoch", "epoch")) if isinstance(checkpoint.get(key), int)]
    started = f", started at {', '.join(when)}" if when else ""
    return f"async save {number} of this run (to {str(path)!r}{started})"


def _in_background(exc: BaseException, path: Path, started: str) -> OSError:
    """The error ``wait()`` raises for a failed background save: which save it was, then the named cause."""
    if not isinstance(exc, OSError) or exc.strerror is None:
        cause, source = _first_failure(exc)
        exc = layout.write_error(cause, path, source=source)
    return OSError(
        exc.errno or errno.EIO,
        f"The {started} failed in the background (reported at the next save, or at the end of the run): {exc.strerror}",
    )


def write_file_atomically(path: Path, write: Callable[[Path], Any], *, overwrite: bool = True, what: str = "Cannot save a checkpoint") -> None:
    """``write(staging)`` one file under a staging name, then publish it: ``path`` never holds half a file."""
    staging = prepare_target(path, overwrite=overwrite, what=what)
    try:
        write(staging / path.name)
        layout.fsync_file(staging / path.name)
    except (OSError, RuntimeError) as exc:
        layout.remove(staging)
        raise layout.write_error(exc, path) from None
    layout.publish(staging / path.name, path)
    layout.remove(staging)  # empty but for its mark, or holding the replaced file


def _save_full(checkpoint: dict[str, Any], path: Path) -> None:
    checkpoint[FULL_INFO_KEY] = {**producer_record(), "format": "full"}
    on_rank0(lambda: write_file_atomically(path, lambda staging: torch.save(checkpoint, staging)))


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint of either format (a sharded one is a whole directory), in one rename first."""
    layout.remove(Path(path))
