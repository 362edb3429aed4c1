"""Meta-device models made real: every tensor initialized by its module's own rule, or a clear error.

Building a model on the meta device costs no memory, which is what lets a model larger than one
device be sharded before it exists; but ``to_empty`` then hands back *uninitialized* memory, and
whatever is not written afterwards trains as garbage (HF ``RMSNorm`` weights of 1e16, rotary
``inv_freq`` buffers). This package guarantees that never happens (``docs/models.md``):

1. **Record construction** (:func:`meta_init_context`, the strategy's init context): every tensor
   operation the module performs while built on the meta device is recorded in order, with the
   random-number-generator state at the start.
2. **Replay it on real memory** (:func:`materialize`, after sharding): the recorded operations run
   again, in order and from the same RNG state, on full-size tensors, one tensor at a time; each
   sharded parameter keeps only its local shard. The result equals the same model built on the
   init device with the same seed, parameter for parameter, on any mesh.
3. **Run the rules construction skipped on meta**: Hugging Face ``PreTrainedModel.init_weights``
   at the point its constructor would have run it, then the LightningModule's ``init_weights()``
   hook. Modules built on meta outside the recording context get their rules alone
   (``reset_parameters()``, ``_reset_parameters()``, HF ``init_weights`` and ``init_weights()``).
4. **Refuse what nothing covers**: before anything is allocated, a tensor that no recording and
   no rule can write is a ``ValueError`` naming it and the fix, on every rank (decided from module
   structure, identical everywhere). Memory is filled with NaN, and a last check (one small
   all-reduce) names any tensor still NaN, infinite or absurdly large.

Memory: besides the local shards, one full-size tensor at a time (two while one is copied into
another) lives on the init device during initialization (``docs/models.md``, "Memory and time").

Inside init rules, sharded parameters behave like ordinary full tensors (:class:`_FullTensorWrites`);
DTensor random operators are never used, so their CPU warnings cannot appear.

**A pipeline stage** (a model cut by :func:`hp_lightning.parallel.pipeline.split_stage`) gets the
values its tensors get in the whole model: the removed units' tensors are computed as temporaries
and the units are put back while the rules run (:mod:`.stage_units`; ``docs/models.md``).

``docs/architecture.md`` maps the package's modules.
"""

from hp_lightning.core.materialize.allocation import refuse_metrics_on_meta  # noqa: F401
from hp_lightning.core.materialize.apply import materialize, move_unsharded_states
from hp_lightning.core.materialize.ops import ABSURD_MAGNITUDE, has_meta_tensors
from hp_lightning.core.materialize.recording import link_construction, meta_init_context
from hp_lightning.core.materialize.stage_units import DetachedUnit, record_detached_units

__all__ = [
    "ABSURD_MAGNITUDE",
    "DetachedUnit",
    "record_detached_units",
    "has_meta_tensors",
    "link_construction",
    "materialize",
    "meta_init_context",
    "move_unsharded_states",
]
