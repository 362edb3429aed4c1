"""Each step's global batch, split by the groups that take part in that step.

torchft's own ``DistributedSampler`` splits by a fixed replica-group id, skipping a down group's
share. Here global batch ``b`` (committed steps, healed with the state) is always the same samples,
cut into one share per participant and rank: with fewer groups the survivors read the missing
shares too, so every global batch is trained on whole.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sized
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader

from hp_lightning.checkpoint.data import ResumableLoader, loader_starting_at

__all__ = ["ParticipantBatches", "PositionedLoader"]


class ParticipantBatches:
    """Indices of this rank's share of global batch ``step``.

    Args:
        global_batch_size: samples per optimizer step over all participants; must divide by
            ``count x group_world_size`` for every participant count the run may see.
        shuffle: a fresh permutation per epoch (seeded by ``seed + epoch``, the same everywhere).

    Raises:
        ValueError: for sizes that cannot form one global batch.
    """

    def __init__(self, dataset_size: int, global_batch_size: int, *, shuffle: bool = False, seed: int = 0) -> None:
        for name, value in (("dataset_size", dataset_size), ("global_batch_size", global_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParticipantBatches({name}=...) expects an int >= 1; got {value!r}.")
        if global_batch_size > dataset_size:
            raise ValueError(
                f"ParticipantBatches: global_batch_size={global_batch_size} exceeds dataset_size={dataset_size}; "
                f"use a smaller batch or more data."
            )
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.shuffle = shuffle
        self.seed = seed

    @property
    def batches_per_epoch(self) -> int:
        """Whole global batches per pass over the data (the remainder is dropped)."""
        return self.dataset_size // self.global_batch_size

    def global_batch(self, step: int) -> list[int]:
        """All samples of global batch ``step``, in order."""
        epoch, index = divmod(step, self.batches_per_epoch)
        if self.shuffle:
            order = torch.randperm(self.dataset_size, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.dataset_size)
        start = index * self.global_batch_size
        return order[start : start + self.global_batch_size].tolist()

    def indices(self, step: int, *, participant_rank: int, participants: int, group_rank: int, group_world_size: int) -> list[int]:
        """This rank's contiguous share of global batch ``step``; ValueError for an uneven split or ranks out of range."""
        ranks = participants * group_world_size
        if participants < 1 or not 0 <= participant_rank < participants or not 0 <= group_rank < group_world_size:
            raise ValueError(
                f"ParticipantBatches.indices: participant {participant_rank} of {participants}, group rank {group_rank} "
                f"of {group_world_size} is out of range; read data only after joining the step's quorum."
            )
        if self.global_batch_size % ranks:
            raise ValueError(
                f"ParticipantBatches: global_batch_size={self.global_batch_size} does not split evenly over "
                f"{participants} participating group(s) x {group_world_size} rank(s) = {ranks}; the average over "
                f"participants would weight samples unequally. Choose a global batch size divisible by "
                f"group_world_size x every participant count from min_replicas to num_replica_groups."
            )
        share = self.global_batch_size // ranks
        start = (participant_rank * group_world_size + group_rank) * share
        return self.global_batch(step)[start : start + share]


class PositionedLoader(ResumableLoader):
    """A training loader that knows which batch of the epoch each step holds, and can move there.

    Lightning's loader fetches a batch before the quorum is known, so a group that heals there
    holds batch 0 while the quorum is at batch ``k``: the glue then re-reads batch ``k`` from the
    dataset (:meth:`batch_at`) and continues after it (:meth:`jump`), loading nothing before ``k``.
    ``loader``: a ``DataLoader`` over a map-style dataset with ``batch_size`` set.

    Raises:
        TypeError: for an iterable-style dataset or a loader without automatic batching.
    """

    _handed: deque[tuple[int, int]]
    _jump_to: Optional[int]
    _upcoming: int
    _generation: int

    def __init__(self, loader: Any) -> None:
        if not isinstance(loader, DataLoader) or loader.batch_sampler is None or not isinstance(loader.dataset, Sized):
            raise TypeError(
                f"fault_tolerance heals a group's data position by re-reading batches, which needs a torch DataLoader over "
                f"a map-style dataset with batch_size set; got {type(loader).__name__}"
                f"{'' if not isinstance(loader, DataLoader) else ' without automatic batching or over an IterableDataset'}. "
                f"Use DataLoader(dataset, batch_size=...) (Lightning injects the replica-aware sampler)."
            )
        super().__init__(loader)
        object.__setattr__(self, "_handed", deque())
        object.__setattr__(self, "_jump_to", None)
        object.__setattr__(self, "_upcoming", 0)
        object.__setattr__(self, "_generation", -1)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_handed", "_jump_to", "_upcoming", "_generation"):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __iter__(self) -> Iterator[Any]:
        self._handed = deque()
        self._jump_to = None
        start = self._resume_at
        self._generation += 1
        return self._positioned(super().__iter__(), start)

    def _positioned(self, batches: Iterator[Any], position: int) -> Iterator[Any]:
        self._upcoming = position
        while True:
            if self._jump_to is not None:
                position, self._jump_to = self._jump_to, None
                self._upcoming = position
                self._generation += 1
                close = getattr(batches, "close", None)
                if close is not None:
                    close()
                batches = self._count(iter(loader_starting_at(self.loader, position)))
                self._served = position
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._handed.append((self._generation, position))
            position += 1
            self._upcoming = position
            yield batch

    @property
    def pending(self) -> int:
        """Batches handed out and not yet taken (the loop's prefetched ones)."""
        return len(self._handed)

    @property
    def upcoming_generation(self) -> int:
        """The generation the next batch handed out will carry."""
        return self._generation if self._jump_to is None else self._generation + 1

    @property
    def upcoming(self) -> int:
        """The position the next batch handed out will have (after a pending :meth:`jump`: its target)."""
        return self._upcoming if self._jump_to is None else self._jump_to

    def take(self) -> tuple[int, int]:
        """``(generation, position)`` of the oldest batch handed out and not yet taken (the one a step holds now).

        ``generation`` counts iterations and jumps, telling which sampler epoch the batch was read under.
        """
        if not self._handed:
            raise RuntimeError("PositionedLoader.take(): no batch handed out since the last take (one take per batch).")
        return self._handed.popleft()

    def batch_at(self, position: int) -> Any:
        """Batch ``position`` of the current sampler epoch, read from the dataset in this process (IndexError past the end)."""
        if not 0 <= position < len(self.loader):
            raise IndexError(f"PositionedLoader.batch_at({position}): the epoch has {len(self.loader)} batches.")
        indices = next(itertools.islice(iter(self.loader.batch_sampler), position, None))
        return self.loader.collate_fn([self.loader.dataset[i] for i in indices])

    def jump(self, position: int) -> int:
        """Continue the iteration at batch ``position`` (after those handed out); returns the generation they will carry."""
        self._jump_to = position
        return self._generation + 1
