"""Plan a sharded training run before renting the hardware: which mesh, what it costs, does it fit.

:func:`plan` runs hp_lightning's own sharding recipe for each candidate on a fake world
(:mod:`~hp_lightning.planner.simulate`), reads memory and collectives from that run, models the
step time and ranks the candidates. ``python -m hp_lightning plan --help`` is the command line;
``--validate`` measures a candidate on CPU ranks (:mod:`~hp_lightning.planner.validate`). See ``docs/planning.md``.
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
