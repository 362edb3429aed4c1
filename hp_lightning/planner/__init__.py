"""Plan a sharded training run before renting the hardware: which mesh, what it costs, does it fit.

:func:`plan` builds the model on the meta device, runs hp_lightning's own sharding recipe for each
candidate configuration on a fake world (:mod:`~hp_lightning.planner.simulate`), reads memory and
collectives from that run (:mod:`~hp_lightning.planner.memory`, :mod:`~hp_lightning.planner.comms`),
models the step time (:mod:`~hp_lightning.planner.cost`) and ranks the candidates
(:mod:`~hp_lightning.planner.report`). ``python -m hp_lightning plan --help`` is the command line;
``--validate`` trains a candidate for a few steps on CPU ranks and prints estimate vs measurement
(:mod:`~hp_lightning.planner.validate`). See ``docs/planning.md``.
"""

from hp_lightning.planner.api import ClusterTooSmall, Evaluated, PlanResult, plan
from hp_lightning.planner.candidates import Candidate, Cluster, Search, Workload
from hp_lightning.planner.model import ModelBuildError, ModelSpec, resolve_model

__all__ = [
    "Candidate",
    "Cluster",
    "ClusterTooSmall",
    "Evaluated",
    "ModelBuildError",
    "ModelSpec",
    "PlanResult",
    "Search",
    "Workload",
    "plan",
    "resolve_model",
]
