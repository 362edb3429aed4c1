"""Meta-device models made real: every tensor initialized by its module's own rule, or a clear error.

Building a model on the meta device costs no memory, which is what lets a model larger than one
device be sharded before it exists; but ``to_empty`` then hands back *uninitialized* memory, and
whatever is not written afterwards trains as garbage (HF ``RMSNorm`` weights of 1e16, GPT-2
``Conv1D`` weights, ``MultiheadAttention.in_proj_weight``, rotary ``inv_freq`` buffers). This
module guarantees that never happens:

1. **Record construction** (:func:`meta_init_context`, the strategy's init context): while the
   module is built on the meta device, every tensor operation it performs (``torch.ones``,
   ``nn.init.kaiming_uniform_``, ``arange(...) ** -x``, the ``clone`` of ``copy.deepcopy``, ...)
   is recorded in order, with the random-number-generator state at the start.
2. **Replay it on real memory** (:func:`materialize`, after sharding): the recorded operations
   run again, in the same order and from the same RNG state, on full-size tensors, one tensor at
   a time; each sharded parameter keeps only its local shard. Random draws thus consume the
   generator exactly as an unsharded build would: the result equals the same model built on the
   init device with the same seed, parameter for parameter, on any mesh.
3. **Run the rules construction skipped on meta**: Hugging Face ``PreTrainedModel.init_weights``
   (its ``post_init`` skips initialization on the meta device; it also rebuilds rotary
   ``inv_freq``) at the point its constructor would have run it, then the LightningModule's
   ``init_weights()`` hook. Modules built on the meta device outside the recording context are
   initialized by their rules alone: ``reset_parameters()``, ``_reset_parameters()``
   (``nn.MultiheadAttention``, ``nn.Transformer``), HF ``init_weights`` and ``init_weights()``.
4. **Refuse what nothing covers**: before anything is allocated, a parameter or buffer that no
   recording and no rule can write is a ``ValueError`` naming the tensor, its module class and
   the fix, on every rank (the decision is made from module structure, identical everywhere).
   Memory is filled with NaN rather than left uninitialized, and a last check after
   initialization (one small all-reduce) names any tensor that is still NaN, infinite or absurdly
   large, on every rank.

Memory: besides the local shards, one full-size tensor at a time (two while one is copied into
another) lives on the init device during initialization; tensors shared by several operations
may be all-gathered again from their shards when an operation reads them after another tensor
was touched in between (HF's post-construction pass does, once per tensor).

Inside init rules, sharded parameters behave like ordinary full tensors (:class:`_FullTensorWrites`);
DTensor random operators are never used, so their CPU warnings cannot appear.

**A pipeline stage** (a model cut by :func:`hp_lightning.parallel.pipeline.split_stage`) gets the
values its tensors get in the whole model: the replay computes the removed units' tensors as
temporaries (consuming the generator as the whole build does), and the rules that walk the model
(HF ``init_weights``, the LightningModule's hook) run with the removed units put back in place
for the duration, their tensors still on the meta device: every operation on one of them runs on
a full-size temporary that is dropped at once (:class:`_Discarded`; one at a time), so random
draws land where they land in the whole model. A rule that would carry a removed unit's values
into this stage's tensors (``head.weight.copy_(emb.weight)`` across stages) is refused: build the
model in ``__init__`` instead. Tied parameters get their source's values on every stage that
holds a copy (the removed unit sees this stage's copy in its slot).

The package by job: :mod:`.recording` (record construction), :mod:`.replay` (run it again on
real memory), :mod:`.full_tensors` (sharded parameters as whole tensors for init code),
:mod:`.rules` (per-module init rules), :mod:`.stage_units` (pipeline stages), :mod:`.checks`
(coverage and values), :mod:`.allocation` (memory and RNG), :mod:`.apply` (the entry point).
"""

from hp_lightning.core.materialize.allocation import _agreed_rng_state, _allocate, _metric_defaults, _restore_metrics, refuse_metrics_on_meta  # noqa: F401
from hp_lightning.core.materialize.apply import _adopt_replaced, _run_program, materialize, move_unsharded_states  # noqa: F401
from hp_lightning.core.materialize.checks import _defined_groups, _meta_slots, _uncovered_message, _written_refs, check_coverage, check_values  # noqa: F401
from hp_lightning.core.materialize.full_tensors import _Cached, _FullTensorWrites, _Slot  # noqa: F401
from hp_lightning.core.materialize.ops import (  # noqa: F401
    _ALIASING_PROPERTIES,
    _AUGMENTED,
    _DTENSOR_RANDOM_WARNING,
    _DTYPE_FACTORIES,
    _EMPTY_FACTORIES,
    _LINKS_ATTR,
    _METADATA,
    _NOT_DATA_WRITES,
    _OVERWRITING,
    _RECORD_ATTR,
    _SEQUENCE,
    ABSURD_MAGNITUDE,
    _func_name,
    _is_float,
    _is_inplace,
    _leaves,
    _local,
    _map_leaves,
    _poison,
    _target,
    _written,
    has_meta_tensors,
)
from hp_lightning.core.materialize.recording import (  # noqa: F401
    ConstructionRecord,
    _forget_construction,
    _Links,
    _memory_key,
    _Node,
    _Recorder,
    _Ref,
    _unreplayable,
    link_construction,
    meta_init_context,
)
from hp_lightning.core.materialize.replay import _Replay, _ReplayError  # noqa: F401
from hp_lightning.core.materialize.rules import (  # noqa: F401
    _CLONING_CONTAINERS,
    _clone_layers,
    _constructor_rule,
    _covering_rules,
    _hf_init_weights,
    _is_hf_pretrained,
    _owns_state,
    _parents,
    _retie,
    _root_hook,
    _rule_program,
    _Step,
    _untie,
)
from hp_lightning.core.materialize.stage_units import (  # noqa: F401
    _DETACHED_ATTR,
    _VALUE_READS,
    _VIEW_METHODS,
    DetachedUnit,
    _Discarded,
    _units_put_back,
    record_detached_units,
)

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
