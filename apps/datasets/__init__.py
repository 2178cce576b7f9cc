"""Datasets and data nodes: per-job slice states AVAILABLE → ASSIGNED → USED (built with DiLoCo training)."""
