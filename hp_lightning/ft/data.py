"""Each step's global batch, split by the groups that take part in that step.

torchft's own ``DistributedSampler`` shards the data by a fixed replica-group id, so while a group
is down its share of every batch is skipped. Here the split follows the quorum instead: global
batch ``b`` (``b`` = committed steps, the same on every participant and healed with the state) is
always the same samples, cut into ``count`` participant shares and each share into the group's
ranks. With every group present that is exactly plain HSDP's split (replicate index = participant
rank); with fewer, the survivors read the missing shares too, so every global batch is trained on
whole and the averaged gradient is that of the whole batch.
"""

from __future__ import annotations

import torch

__all__ = ["ParticipantBatches"]


class ParticipantBatches:
    """Indices of this rank's share of global batch ``step``.

    Args:
        dataset_size: samples in the dataset.
        global_batch_size: samples per optimizer step over all participants; must divide by
            ``count x group_world_size`` for every participant count the run may see, so every
            rank's share has the same size and averaging is exact.
        shuffle: a fresh permutation per epoch (seeded by ``seed + epoch``, the same everywhere).
        seed: the permutation seed.

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
        """This rank's contiguous share of global batch ``step``.

        Raises:
            ValueError: when the batch does not split evenly over ``participants x group_world_size``
                ranks, or the ranks are out of range (e.g. a group not in the quorum).
        """
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
