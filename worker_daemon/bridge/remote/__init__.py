"""The daemon's :class:`~worker_daemon.bridge.backend.BridgeBackend`: one task's bridge, wired to the control
plane (over the worker websocket, through a :class:`~worker_daemon.link.ControlLink`) and to the job's
parameter server and data nodes (plain HTTP with timeouts). See ``docs/training.md`` for the contract.

* ``status``: a ``status`` frame with the progress verbatim; the reply of the same ``request_id`` is the
  executor's answer. ``{"status": {"batch_size": B}}`` values are summed for the next update's ``X-Samples``.
* ``fetch``:
  ``scheduler``        → ``fetch_slice`` / ``slice_assigned`` (asked again after ``retry_in`` while none is
                         ready), ``GET`` from the slice's URLs in order into ``.prefetch/``, size and SHA-256
                         checked, moved to ``artifacts/<index>``, then ``slice_ack``. After a hand-out up to
                         ``prefetch`` more slices are claimed and downloaded in the background; they are acked
                         only when handed out, so a task that ends returns them to the pool with its lease.
                         Small slices claimed together from one data node come in one batch request
                         (``POST <node>/datasets/<name>/slices``, each with its own token; ``batched``).
  ``parameter-server`` → ``GET <peer>/jobs/<job>/model/<filename>`` per file; ``X-Round`` (rounds completed)
                         sets the next round to send and receive.
  ``uri``              → ``GET`` into ``artifacts/<last URL segment>`` (``part-0.bin`` when empty).
  ``huggingface``      → ``huggingface_hub.hf_hub_download`` per file, copied into ``artifacts/``.
* ``send``: ``PUT <peer>/jobs/<job>/rounds/<r>/update`` (streamed, ``X-Samples``), retried on connection
  errors, timeouts and 5xx for up to ``peer_wait`` seconds at the peer's current address (a lost parameter
  server is restarted elsewhere); a 4xx is logged with the parameter server's reason and not retried. A copy
  waits in ``.sent/`` until the round's result arrives.
* ``receive``: long-polls ``GET <peer>/jobs/<job>/rounds/<r>/result?wait=…`` for r = rounds completed + 1, …,
  saving each result as ``<directory>/<peer id>.round-<r>`` (:func:`result_name`) and announcing it with
  ``"round": r``. One file per round, downloaded as soon as the round closes whether or not the executor has
  read the previous events: a round's event always points at that round's bytes, and a trainer that is busy
  never loses a result to the parameter server's pruning (it keeps two). The files of rounds the executor has
  merged (``"update-received"``: every round up to the last update it sent) are deleted then, never one it
  has not read. A result the parameter server pruned anyway (410) is skipped with a line in the task's log:
  the executor sees the gap in the rounds and fetches the full global weights. If the control plane gave the
  parameter server's address again while round r was open (a new server resumed from the last saved round,
  elsewhere or at the same address), the kept update is sent again first (a server that has it answers 409).
"""

from __future__ import annotations

from worker_daemon.bridge.remote.backend import SENT_DIR, RemoteBackend, result_name
from worker_daemon.bridge.remote.downloads import CHUNK_SIZE
from worker_daemon.bridge.remote.slices import MIN_SLICE_RETRY, PREFETCH_DIR

__all__ = ["CHUNK_SIZE", "MIN_SLICE_RETRY", "PREFETCH_DIR", "SENT_DIR", "RemoteBackend", "result_name"]
