"""Hypha's DiLoCo parameter server: averages the trainers' pseudo-gradients and takes the outer Nesterov step.

Modules:

* ``math``         pure functions on ``dict[str, torch.Tensor]``: ``StreamingMean``, ``mean``, ``nesterov_step``.
* ``buffers``      ``BufferPool``: the round's model-sized tensors, reused once nothing holds them.
* ``weights``      the only file I/O on tensors: safetensors ``load`` / atomic ``save`` / ``validate``.
* ``checkpoints``  one directory per round (weights + momentum), written atomically; ``load_latest``.
* ``exceptions``   the package's errors, hierarchy in its docstring.
* ``job``          the job JSON (``aggregate`` envelope + ``model``, ``rounds``, ``eval``) → ``JobConfig``.
* ``model``        the initial model: built from a config or fetched (Hugging Face, URL); tied-weight names.
* ``rounds``       ``RoundCoordinator``: who may send, when a round closes, the outer step (no HTTP;
                   a package: coordinator, step, records); streaming rounds sync one fragment each.
* ``server``       the HTTP API trainers use (aiohttp), transfer-token checks.
* ``evaluation``   eval slices and the eval loss after each round.
* ``reporting``    the bridge client (``ready``/``round`` reports) and the final model's upload.
* ``service``      the whole life of one job's parameter server; ``__main__`` is its command line.

Runs on GPU hosts without Django: never import ``apps``, ``hypha_site`` or ``django`` here
(``scripts/check_imports.py`` enforces it).
"""
