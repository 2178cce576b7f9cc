"""Tensors on the wire: the encodings of pseudo-gradients and of the parameter server's results.

* :mod:`hypha_tensors.formats` — what an encoding is (its name, its block size, the safetensors metadata that
  says it), without torch: the control plane validates job specs with it.
* :mod:`hypha_tensors.encoding` — the pure encode/decode functions on dicts of tensors and error feedback
  (torch); used by trainers and the parameter server alike, so that both decode bit for bit the same.

Neither touches files or the network; docs/training.md ("Encodings") has the maths.
"""
