"""``hypha``: the command line of a Hypha control plane for people and scripts.

Log in once (``hypha login --server URL``), then submit DiLoCo jobs, watch them train, cancel them, download
their models and list workers through the REST API (``docs/openapi.yaml``). ``docs/cli.md`` is the manual.

The package talks HTTP only: it never imports Django or ``apps``, so it installs with httpx and rich alone.
"""
