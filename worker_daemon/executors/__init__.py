"""Built-in executors started by the worker daemon.

* ``training``         the DiLoCo trainer: ``python -m worker_daemon.executors.training --socket … --work-dir …``
                       (the ``trainer`` runtime, forked warm; or under ``accelerate launch`` as a ``process``
                       executor); talks only to the job bridge. Its parts: ``setup`` (model, preprocessor,
                       data loader, optimizer, LR schedule) and ``rounds`` (inner loop, outer step).
* ``ranks``            a trainer of several processes (``training.processes``): the launcher, the process group,
                       rank 0 leading the others; ``several`` is one rank's DiLoCo loop.
* ``inference``        the batch inference executor (class ``inference``, name ``batch-inference``;
                       docs/inference.md): ``python -m worker_daemon.executors.inference --socket … --work-dir …
                       --job …`` (the daemon's ``inference`` runtime, always started cold, the job JSON in
                       ``$JOB_JSON``). Fetches the model once, then slice after slice through the bridge until
                       its fetch answers ``[]``, uploading one result file per slice; a process executor on the
                       bridge's documented endpoints only, so a third party can write its own like it.
                       ``inference_tasks``: its job JSON and ``generate`` / ``classify`` / ``embed``.
* ``bridge_client``    a client of the job bridge's documented endpoints (HTTP over the Unix socket).
* ``overlap``          eager updates: round r's communication overlapped with round r+1's steps.
* ``streaming``        Streaming DiLoCo: one fragment of the model synced a round, mixed in when it arrives.
* ``pseudo_gradient``  delta out, update in: tied-weight-aware, never corrupts the live model.
* ``job``              the train job JSON, parsed and checked.
* ``data``             endless samples from the data slices the bridge fetches.
* ``exceptions``       the executors' errors and their exit codes, hierarchy in its docstring.

Importing this package is cheap: torch, transformers and accelerate are imported only when training (or
inference) starts.
"""
