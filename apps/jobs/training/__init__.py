"""Training workflows of a RUNNING job: dispatch, the sync protocol, data slices, rounds and the final model.

The order of events is in ``docs/training.md``. In short: once every lease of a job with a DiLoCo spec is
ACTIVE, the parameter server is dispatched first; when it reports ``ready`` with its URL the trainers are
dispatched; trainers report every step and are told when to sync (after a fixed H steps per round, or, with
a sample target, when :mod:`apps.jobs.sync` projects that all of them finish together); the parameter
server reports every round and asks whom to wait for when a round's first update arrives; the job completes
when the last round is applied, the final model is stored and the parameter server exited cleanly.

These functions run inside the caller's transaction (``apps.jobs.services`` wraps them and owns every
workflow that ends leases or jobs); messages to daemons go out after commit.

The package, by concern (each module imports only those above it):

* :mod:`.tokens` — transfer keys and tokens; the check of a parameter server's token
* :mod:`.plans` — a running job's parsed spec
* :mod:`.pools` — an elastic pool below its min: grace, pause, resume, failure
* :mod:`.dispatch` — dispatch, lost and replaced tasks, the end of the training
* :mod:`.reports` — what daemons report about their tasks (ownership, exits, output)
* :mod:`.task_logs` — each task's full output, size-capped and rotated
* :mod:`.status` — the sync protocol (status reports and their replies; rounds)
* :mod:`.slices` — data slices for trainers
* :mod:`.storage`, :mod:`.model_files`, :mod:`.checkpoints`, :mod:`.uploads` — files sent to the control plane

Tests that drive the sync clock patch :data:`apps.jobs.training.status.sync_clock`, where it is read.
"""

from __future__ import annotations

from apps.jobs.training import pools, task_logs, transfers
from apps.jobs.training.checkpoints import (
    CHECKPOINT_FILES,
    CHECKPOINT_MANIFEST,
    checkpoint_directory,
    checkpoint_file,
    discard_checkpoint,
    store_checkpoint_file,
)
from apps.jobs.training.dispatch import (
    CONTROL_PLANE_PEER,
    MAX_REPLACEMENTS_PER_TRAINER,
    MAX_SERVER_RESTARTS,
    MODEL_FILES,
    TRAINER_EXIT_GRACE,
    completion_reason,
    current_server,
    dispatch_replacements,
    evaluation_indices,
    jobs_waiting_for_trainers,
    max_rejections,
    model_stored,
    pending_dispatches,
    repeatedly_rejected,
    replaces,
    server_lost,
    slice_urls,
    start,
    trainer_lost,
    trainers_running,
    training_finished,
    wants_replacements,
)
from apps.jobs.training.model_files import (
    FINAL_MODEL_FILES,
    authorise_model_upload,
    model_archive,
    model_directory,
    store_model_file,
)
from apps.jobs.training.plans import Plan, is_training_job, plan
from apps.jobs.training.reports import (
    LOG_TAIL_LINES,
    append_output,
    cancel_tasks,
    describe_exit,
    lease_not_held,
    own_task,
    record_exit,
    task_role,
)
from apps.jobs.training.slices import SLICE_RETRY_SECONDS, acknowledge_slice, assign_slice
from apps.jobs.training.status import (
    MAX_CONTINUE_GRANT,
    MAX_CONTINUE_SECONDS,
    handle_status,
    locked_round,
    ready_url,
    round_reported,
    task_started,
)
from apps.jobs.training.storage import MODEL_FILENAME
from apps.jobs.training.tokens import (
    FreshToken,
    fresh_tokens,
    transfer_key,
    transfer_token,
    transfer_token_lifetime,
)
from apps.jobs.training.uploads import authorise_upload_download, resolve_upload, store_upload

__all__ = [
    "CHECKPOINT_FILES",
    "CHECKPOINT_MANIFEST",
    "CONTROL_PLANE_PEER",
    "FINAL_MODEL_FILES",
    "LOG_TAIL_LINES",
    "MAX_CONTINUE_GRANT",
    "MAX_CONTINUE_SECONDS",
    "MAX_REPLACEMENTS_PER_TRAINER",
    "MAX_SERVER_RESTARTS",
    "MODEL_FILENAME",
    "MODEL_FILES",
    "SLICE_RETRY_SECONDS",
    "TRAINER_EXIT_GRACE",
    "FreshToken",
    "Plan",
    "acknowledge_slice",
    "append_output",
    "assign_slice",
    "authorise_model_upload",
    "authorise_upload_download",
    "cancel_tasks",
    "checkpoint_directory",
    "checkpoint_file",
    "completion_reason",
    "current_server",
    "describe_exit",
    "discard_checkpoint",
    "dispatch_replacements",
    "evaluation_indices",
    "fresh_tokens",
    "handle_status",
    "ready_url",
    "task_logs",
    "transfers",
    "is_training_job",
    "jobs_waiting_for_trainers",
    "locked_round",
    "model_archive",
    "model_directory",
    "model_stored",
    "own_task",
    "lease_not_held",
    "max_rejections",
    "pending_dispatches",
    "pools",
    "plan",
    "record_exit",
    "repeatedly_rejected",
    "replaces",
    "resolve_upload",
    "round_reported",
    "server_lost",
    "slice_urls",
    "start",
    "store_checkpoint_file",
    "store_model_file",
    "store_upload",
    "task_role",
    "task_started",
    "trainer_lost",
    "trainers_running",
    "training_finished",
    "transfer_key",
    "transfer_token",
    "transfer_token_lifetime",
    "wants_replacements",
]
