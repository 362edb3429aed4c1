"""A training loader that resumes mid-epoch where the checkpoint left off, instead of restarting the epoch.

Lightning restores a plain ``DataLoader`` at the start of its epoch (batches seen before the
checkpoint are trained on again); it resumes a loader with ``state_dict`` / ``load_state_dict``,
which :class:`ResumableLoader` adds to any sized loader. It counts the batches handed out and on
resume skips them at the sampler, so they are never loaded. The order must be reproducible (a
seeded ``DistributedSampler``) with the same global batch size; the world size may change.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized
from typing import Any, Optional

from torch.utils.data import DataLoader, Sampler


class _StartAt(Sampler):
    """A sampler (or batch sampler) that skips its first ``skip`` items."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return max(len(self.inner) - self.skip, 0)


def loader_starting_at(loader: DataLoader, skip: int) -> DataLoader:
    """The same loader for one epoch, starting ``skip`` batches in (nothing before that is loaded)."""
    common: dict[str, Any] = dict(
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order,
    )
    if loader.num_workers > 0:
        common["prefetch_factor"] = loader.prefetch_factor
    if loader.batch_sampler is not None:
        return DataLoader(loader.dataset, batch_sampler=_StartAt(loader.batch_sampler, skip), **common)
    return DataLoader(loader.dataset, sampler=_StartAt(loader.sampler, skip), batch_size=None, **common)


class ResumableLoader:
    """Wraps a sized training loader so that a resumed run continues its epoch.

    Everything but iteration and the two state methods is forwarded to the wrapped loader, so
    Lightning sets the sampler's epoch as usual. Example::

        trainer.fit(model, ResumableLoader(DataLoader(dataset, batch_size=8, sampler=sampler)))
    """

    # Set with object.__setattr__ (every other attribute is forwarded to the wrapped loader).
    loader: Any
    _served: int
    _resume_at: int

    def __init__(self, loader: Any) -> None:
        if not isinstance(loader, Sized):
            raise TypeError(
                f"ResumableLoader needs a loader with a length (map-style dataset); got {type(loader).__name__}. "
                f"An IterableDataset must keep its own position (e.g. torchdata's StatefulDataLoader)."
            )
        object.__setattr__(self, "loader", loader)
        object.__setattr__(self, "_served", 0)
        object.__setattr__(self, "_resume_at", 0)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets e.g. worker_init_fn on the loader it was given: it belongs to the wrapped one.
        if name in ("loader", "_served", "_resume_at"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __iter__(self) -> Iterator[Any]:
        # Eager: a checkpoint taken before the first batch of this iteration (e.g. by a run that
        # resumed at its last step) still records the position the iteration starts from.
        skip, self._resume_at = self._resume_at, 0
        self._served = skip
        if skip and isinstance(self.loader, DataLoader):
            batches: Any = loader_starting_at(self.loader, skip)
        else:
            batches = itertools.islice(iter(self.loader), skip, None)  # not a DataLoader: read and drop
        return self._count(batches)

    def _count(self, batches: Any) -> Iterator[Any]:
        for batch in batches:
            self._served += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """Batches handed out so far in this epoch, and the epoch's length (saved in checkpoints)."""
        return {"batches_served": self._served, "batches_per_epoch": len(self)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Start the next iteration after the batches the checkpoint's run had already served (same epoch length only)."""
        served, length = int(state["batches_served"]), int(state["batches_per_epoch"])
        if length != len(self):
            raise ValueError(
                f"ResumableLoader: the checkpoint's epoch had {length} batches per rank, this loader has {len(self)}. "
                f"Resume with the same dataset and global batch size (batch_size x world size) to continue the "
                f"data order, or use a plain loader to restart the epoch."
            )
        self._resume_at = served if served < length else 0
        self._served = self._resume_at


#: Key of the saving run's data-parallel size in a Trainer checkpoint.
DATA_PARALLEL_KEY = "hp_lightning_data_parallel_size"


def loader_resume_warning(checkpoint: dict[str, Any], data_parallel_size: int) -> Optional[str]:
    """Why a mid-epoch resume of a stateful loader's position may not continue the same data, or None.

    torchdata's ``StatefulDataLoader`` records the samples *this rank* drew, which on another number
    of ranks points elsewhere in the epoch (:class:`ResumableLoader` counts global batches).
    """
    saved = checkpoint.get(DATA_PARALLEL_KEY, (checkpoint.get("hp_lightning") or {}).get("world_size"))
    loops = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    states = (loops.get("state_dict") or {}).get("combined_loader") or []
    mid_epoch = any(isinstance(s, dict) and s.get("_num_yielded") and not s.get("_iterator_finished") for s in states)
    if saved is None or saved == data_parallel_size or not mid_epoch:
        return None
    return (
        f"This checkpoint was saved mid-epoch by {saved} data-parallel ranks and resumes on {data_parallel_size}: a StatefulDataLoader "
        f"records the samples each rank drew, so on another number of ranks its position no longer matches the "
        f"global data order (some samples of this epoch are skipped or repeated). Resume from an end-of-epoch "
        f"checkpoint, on the same number of ranks, or use HSDPStrategy(resumable_dataloaders=True) with a plain "
        f"DataLoader (its position is in global batches)."
    )
