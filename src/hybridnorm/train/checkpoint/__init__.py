"""Checkpoints of a training run: what the trainer, ``train.run`` and ``hf.export`` call, and nothing else.

The package, lowest first (each module imports only those above it in this list, plus ``train.distributed``,
``train.preflight`` and ``train.tensor_check``):

- :mod:`.layout`     the file names of the single and the sharded layout, and the format version
- :mod:`.counters`   the counters of ``state.json`` (data-loader position, tokens, AdamW's step) and their bounds
- :mod:`.format`     reading and checking a checkpoint's files: manifest, sha256, schema; ``CheckpointError``
- :mod:`.shards`     FSDP pieces: which slice of each tensor a rank holds, keyed ``name@offset``
- :mod:`.load`       loading either layout into either kind of run (``TrainState``, weights, optimizer, RNG)
- :mod:`.retention`  keep-last-k, corrupt checkpoints set aside (never deleted), the checkpoint to resume
- :mod:`.save`       writing a checkpoint atomically, every rank its own shards, in the foreground or (the
                     files) in a background thread, published only when complete
- :mod:`.lock`       the run folder's lock (one training process group per folder)

The format is our own and not torch.distributed.checkpoint's: docs/architecture.md says why.
"""

from hybridnorm.train.checkpoint.format import (
    FILES,
    CheckpointError,
    check_checkpoint,
    checked_own_run_file,
    checked_run_file,
    checked_tokenizer_file,
    list_checkpoints,
    verify_checkpoint,
)
from hybridnorm.train.checkpoint.layout import FORMAT_VERSION, RUN_FILES, NewerFormatError
from hybridnorm.train.checkpoint.load import TrainState, load_checkpoint, load_weights
from hybridnorm.train.checkpoint.lock import LOCK_NAME, claim_run_dir
from hybridnorm.train.checkpoint.retention import ResumePoint, checkpoint_for_resume, prune_checkpoints
from hybridnorm.train.checkpoint.save import (
    CheckpointSaveError,
    PendingSave,
    latest_checkpoint,
    save_checkpoint,
    start_checkpoint,
)

__all__ = ["FILES", "FORMAT_VERSION", "LOCK_NAME", "RUN_FILES", "CheckpointError", "CheckpointSaveError",
           "NewerFormatError", "PendingSave", "ResumePoint",
           "TrainState", "check_checkpoint", "checked_own_run_file", "checked_run_file", "checked_tokenizer_file",
           "checkpoint_for_resume", "claim_run_dir",
           "latest_checkpoint", "list_checkpoints", "load_checkpoint", "load_weights", "prune_checkpoints",
           "save_checkpoint", "start_checkpoint", "verify_checkpoint"]
