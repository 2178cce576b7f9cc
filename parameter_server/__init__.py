"""Hypha's DiLoCo parameter server: averages the trainers' pseudo-gradients and takes the outer Nesterov step.

Modules:

* ``math``         pure functions on ``dict[str, torch.Tensor]``: ``StreamingMean``, ``mean``, ``nesterov_step``.
* ``weights``      the only file I/O on tensors: safetensors ``load`` / atomic ``save`` / ``validate``.
* ``checkpoints``  one directory per round (weights + momentum), written atomically; ``load_latest``.
* ``exceptions``   the package's errors, hierarchy in its docstring.

Runs on GPU hosts without Django: never import ``apps``, ``hypha_site`` or ``django`` here
(``scripts/check_imports.py`` enforces it).
"""
