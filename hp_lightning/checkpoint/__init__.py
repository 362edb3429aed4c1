"""Checkpoint IO: sharded (DCP directory) and full (one file) state, atomic saves, any-mesh resume.

* :func:`save_checkpoint` / :func:`load_checkpoint`: what ``HSDPStrategy`` calls, on every rank;
  :class:`AsyncSaves`: the same sharded save written in the background (``async_save=True``).
* :func:`load_weights`: pretrained weights into a sharded module; :func:`save_hf` / :func:`export_hf`:
  the model as a Hugging Face directory (:mod:`.hf`).
* :func:`load_from_checkpoint` / :class:`LoadsShardedCheckpoints`: ``MyModule.load_from_checkpoint``
  on a sharded directory, in one plain CPU process.
* :class:`ResumableLoader`: a training loader that continues its epoch on resume.
* ``python -m hp_lightning.checkpoint consolidate | shard | verify | export-hf``: offline conversion and checks.

A load checks each byte it uses once against the CRC-32s recorded at save, each tensor before it is
copied into the model (:mod:`.integrity`); every pickle is unpickled safely unless ``weights_only=False``,
and no entry may lead outside its directory (see ``docs/security.md``).
"""

from hp_lightning.checkpoint.data import DATA_PARALLEL_KEY, ResumableLoader, loader_resume_warning
from hp_lightning.checkpoint.hf import export_hf, save_hf
from hp_lightning.checkpoint.integrity import CorruptCheckpointError, UnsafeCheckpointError
from hp_lightning.checkpoint.layout import FORMAT_VERSION, CheckpointKind, classify, recover
from hp_lightning.checkpoint.load import LoadsShardedCheckpoints, load_checkpoint, load_from_checkpoint, load_weights, read_full_file
from hp_lightning.checkpoint.save import AsyncSaves, is_sharded_checkpoint, remove_checkpoint, save_checkpoint
from hp_lightning.core.state_dict import model_state_dict, optimizer_state_dict

__all__ = [
    "DATA_PARALLEL_KEY",
    "AsyncSaves",
    "FORMAT_VERSION",
    "CheckpointKind",
    "CorruptCheckpointError",
    "LoadsShardedCheckpoints",
    "ResumableLoader",
    "UnsafeCheckpointError",
    "classify",
    "export_hf",
    "is_sharded_checkpoint",
    "load_checkpoint",
    "load_from_checkpoint",
    "load_weights",
    "loader_resume_warning",
    "model_state_dict",
    "optimizer_state_dict",
    "read_full_file",
    "recover",
    "remove_checkpoint",
    "save_checkpoint",
    "save_hf",
]
