"""Saving a sharded model's checkpoint from every rank: staged, checksummed, then published in one step.

* **sharded**: every rank writes its own shards in parallel with ``torch.distributed.checkpoint``
  (DCP) into a staging directory; rank 0 adds ``meta.pt`` (the rest of Lightning's checkpoint);
  then the file sizes (and, with ``checksums=True``, each file's SHA-256, read back by the ranks
  in parallel) go into the manifest rank 0 writes before it publishes.
  Fast and light on memory; loads into any world size or mesh; needs a filesystem every rank sees.
  :class:`AsyncSaves` runs the same save through DCP's ``async_save``: the state is copied to host
  memory (the only stall), the files are written by a background thread, and rank 0 publishes
  when DCP reports every rank's write finished.
* **full**: the state arrives already gathered on rank 0 (tensor by tensor, see
  :mod:`hp_lightning.core.state_dict`), which writes one ``torch.save`` file. Portable, but rank 0
  holds the whole state in host memory and writes it alone.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from hp_lightning.checkpoint import layout
from hp_lightning.core import devices
from hp_lightning.checkpoint.collective import agree, on_every_rank, on_rank0, rank, world_size
from hp_lightning.checkpoint.layout import (
    DCP_METADATA_FILE,
    FORMAT_VERSION,
    FULL_INFO_KEY,
    MANIFEST_FILE,
    META_FILE,
    MODEL_KEY,
    OPTIMIZER_KEY,
)


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
    import lightning

    from hp_lightning import __version__

    return {
        "format_version": FORMAT_VERSION,
        "hp_lightning_version": __version__,
        "torch_version": torch.__version__.split("+")[0],
        "lightning_version": lightning.__version__,
        "world_size": world_size(),
    }


def prepare_target(path: Path, *, overwrite: bool = True, what: str = "Cannot save a checkpoint") -> Path:
    """Rank 0: finish a swap a kill interrupted, drop what killed saves left, pick a staging name."""
    if path.exists() and not path.is_dir() and not path.is_file():
        raise ValueError(f"{what} to {str(path)!r}: something other than a file or directory is there.")
    # A save replaces an older checkpoint of the same name (a conversion only when asked), and nothing else.
    layout.refuse_foreign(path, overwrite=overwrite, what=what)
    layout.recover(path)
    layout.clean_stale(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return layout.staging_path(path, layout.new_token())


def save_checkpoint(checkpoint: dict[str, Any], path: Path, *, sharded: bool, checksums: bool = False) -> None:
    """Write Lightning's ``checkpoint`` dict to ``path`` from every rank; the save appears whole or not at all.

    The state in ``checkpoint`` must come from :func:`model_state_dict` / :func:`optimizer_state_dict`
    with the same ``full`` setting (``full = not sharded``). Every rank calls this.

    Args:
        checksums: sharded only: also record every file's SHA-256 (one read-back of the new files,
            usually from the page cache, spread over the ranks), so every later load checks every
            byte. Without it the manifest records sizes, which every load checks.

    Raises:
        ValueError: the target is something other than a file or directory.
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


def _start_sharded(path: Path, rest: dict[str, Any]) -> Path:
    """Rank 0: a fresh staging directory holding ``meta.pt``."""
    staging = prepare_target(path)
    staging.mkdir()
    # The producer record marks hp_lightning's layout even if the manifest is later lost.
    torch.save({**rest, FULL_INFO_KEY: {**producer_record(), "format": "sharded"}}, staging / META_FILE)
    layout.fsync_file(staging / META_FILE)
    return staging


def _finish_sharded(staging: Path, path: Path, files: dict[str, Any], tensors: Mapping[str, Any], checksums: bool) -> None:
    """Rank 0, once every rank's files are written: the manifest (the completion mark), then publish."""
    manifest = {
        **producer_record(),
        "format": "sharded",
        "model_key": MODEL_KEY,
        "num_optimizers": len(tensors) - 1,
        "mesh": mesh_record(tensors[MODEL_KEY]),
        "checksum": "sha256" if checksums else None,
        "files": files,
    }
    layout.write_manifest(staging, manifest)
    layout.publish(staging, path)


def _save_sharded(checkpoint: dict[str, Any], path: Path, *, checksums: bool) -> None:
    tensors, rest = _split(checkpoint)
    staging = on_rank0(lambda: _start_sharded(path, rest))
    # Every rank writes its shards; DCP gathers their outcome, so a failure raises on all ranks.
    dcp.save(tensors, checkpoint_id=str(staging), no_dist=not dist.is_initialized())
    # Sizes (a stat); checksums only when asked for: each rank reads back a slice of the files, in parallel.
    records = on_every_rank(
        lambda: {n: layout.file_record(staging / n, checksum=checksums) for n in layout.data_files(staging)[rank() :: world_size()]}
    )
    gathered: list[Any] = [records]
    if dist.is_initialized():
        gathered = [None] * world_size()
        dist.all_gather_object(gathered, records)
    files = {name: record for part in gathered for name, record in part.items()}
    on_rank0(lambda: _finish_sharded(staging, path, files, tensors, checksums))


class AsyncSaves:
    """Sharded saves that write while training goes on, at most one in flight (``async_save=True``).

    :meth:`save` stalls training only to copy the state to host memory (DCP's ``async_save``
    stager) and to write the small ``meta.pt``; a background thread writes the shards. DCP's own
    finish step (its coordinator, rank 0, gathers every rank's write result) completes rank 0's
    future only when every rank's files are written, so rank 0 then records the sizes, writes the
    manifest and publishes, with no collective. Until then the checkpoint exists only under its
    staging name: a kill leaves the previous checkpoint in place and the staging directory is
    cleared by the next save. Removals asked for meanwhile (``ModelCheckpoint`` dropping an older
    top-k save) wait for the publish, so the previous checkpoint outlives an interrupted write.

    A save due while another is in flight first waits for it (the rest of that write is then a
    stall), as torchtitan does; so does a synchronous save. The background DCP collectives run on
    a gloo group of their own, created at the first save, so they never interleave with training's.

    The host copy is kept between saves (DCP's ``DefaultStager`` reuses its buffers, pinned when
    CUDA is there): each save after the first copies into memory already mapped instead of
    allocating and faulting in a fresh copy of the state, at the price of one host copy of this
    rank's shards held for the run (:meth:`close` frees it).
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

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def save(self, checkpoint: dict[str, Any], path: Path, *, checksums: bool = False) -> None:
        """Start a sharded save of Lightning's ``checkpoint`` dict; every rank calls it."""
        self.wait()
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend=devices.default_backend(devices.CPU))  # host copies: gloo
        if self._stager is None:  # synchronous copy: training may change the state right after save() returns
            pinned = devices.cuda_available()  # DCP pins host memory with CUDA only
            self._stager = DefaultStager(StagingOptions(pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False))
        tensors, rest = _split(dict(checkpoint))
        path = Path(path)
        staging = on_rank0(lambda: _start_sharded(path, rest))
        if rank() == 0:
            self._published.clear()
        try:
            future = dcp.async_save(
                tensors, checkpoint_id=str(staging), process_group=self._group, async_stager=self._stager, no_dist=not dist.is_initialized()
            )
        except BaseException:
            self._published.set()
            raise
        self._future = future
        if rank() == 0:
            future.add_done_callback(lambda done: self._publish(done, staging, path, tensors, checksums))

    def _publish(self, done: Future, staging: Path, path: Path, tensors: Mapping[str, Any], checksums: bool) -> None:
        """Rank 0, on DCP's background thread: publish the finished save, then the removals it held back.

        ``wait()`` returns only once the removals are done too (``_published`` is set last, under
        the lock, when none is left), so a removal is never lost or racing the next save.
        """
        try:
            try:
                done.result()
                files = {n: layout.file_record(staging / n, checksum=checksums) for n in layout.data_files(staging)}
                _finish_sharded(staging, path, files, tensors, checksums)
            except BaseException as exc:  # noqa: BLE001 - re-raised on every rank by wait()
                self._failure = exc
                try:
                    layout.remove(staging)
                except OSError:
                    pass  # the next save's clean-up removes it
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
        """Block until the save in flight is written and published; its error is raised on every rank.

        Every rank calls it (the outcome is agreed in one collective). After a failure, when the
        other ranks may not come, do not call it: an unpublished save stays a staging directory.
        """
        future, self._future = self._future, None
        if future is None:
            return
        error: Optional[BaseException] = None
        try:
            future.result()
        except Exception as exc:  # noqa: BLE001 - shared with every rank below
            error = exc
        if rank() == 0:
            self._published.wait()
            error, self._failure = error or self._failure, None
        agree(error)

    def close(self) -> None:
        """Free the kept host copy (a write in flight keeps what it is writing until it ends); no collective."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def write_file_atomically(path: Path, write: Callable[[Path], Any], *, overwrite: bool = True, what: str = "Cannot save a checkpoint") -> None:
    """``write(staging)`` one file under a staging name, then publish it: ``path`` never holds half a file."""
    staging = prepare_target(path, overwrite=overwrite, what=what)
    try:
        write(staging)
        layout.fsync_file(staging)
    except (OSError, RuntimeError) as exc:
        layout.remove(staging)
        raise layout.write_error(exc, path) from None
    layout.publish(staging, path)


def _save_full(checkpoint: dict[str, Any], path: Path) -> None:
    checkpoint[FULL_INFO_KEY] = {**producer_record(), "format": "full"}
    on_rank0(lambda: write_file_atomically(path, lambda staging: torch.save(checkpoint, staging)))


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint of either format (a sharded one is a whole directory), in one rename first."""
    layout.remove(Path(path))
