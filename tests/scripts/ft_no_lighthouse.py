"""A replica group whose lighthouse address is wrong, under ``torchrun --max-restarts=N``: ``ft_no_lighthouse.py OUT PORT``.

Each rank marks its attempt in ``OUT`` (``attempt.<restart>.<rank>``), forms the group's process
group, shards a small model and builds :class:`~hp_lightning.ft.FaultTolerantHSDP` against
``http://127.0.0.1:PORT``, where nothing listens. Expected: one attempt, a clear error, and
torchrun ends the job instead of restarting it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hp_lightning import fully_shard
from hp_lightning.ft import FaultTolerance, FaultTolerantHSDP


def main(out: Path, port: int) -> None:
    (out / f"attempt.{os.environ['TORCHELASTIC_RESTART_COUNT']}.{os.environ['RANK']}").touch()
    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = FaultTolerance(replica_group=0, num_replica_groups=1, lighthouse=f"http://127.0.0.1:{port}", connect_timeout=1.0)
    FaultTolerantHSDP(config, model, optimizer)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
