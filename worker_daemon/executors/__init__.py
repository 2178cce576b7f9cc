"""Built-in executors started by the worker daemon (the trainer runs as ``python -m worker_daemon.executors.training``)."""
