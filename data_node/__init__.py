"""Hypha's data node: prepares datasets as safetensors slices (``hypha-data``) and serves them over HTTP to
trainers (``hypha-data-node``), after registering them with the control plane.

Runs without Django (like ``worker_daemon/``): it talks to the control plane only over its REST API.
"""
