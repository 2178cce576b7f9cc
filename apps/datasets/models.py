"""Datasets, data nodes and per-job slice states arrive with DiLoCo training end to end."""
