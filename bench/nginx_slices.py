"""nginx for ``bench/data_node.py``: where it is, its version, and a private configuration serving a dataset's
slices at the data node's URLs (``/datasets/<name>/slices/<index>``) with the same ``X-Sha256`` header."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

NGINX_INSTALL_HELP = """nginx is not installed (looked for `nginx` on PATH and in /usr/sbin).
Install it from Debian and run the benchmark again:

    apt-get install -y nginx-light      # as root (or with sudo); or the package nginx

The benchmark starts its own nginx with a private configuration; the system service need not run."""


def find_nginx() -> str | None:
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin:/sbin")


def nginx_config(dataset: Any, prefix: Path, port: int) -> str:
    """A private nginx configuration serving ``dataset`` at the data node's URLs, with its ``X-Sha256``."""
    # One location per index length: nginx cannot zero-pad a capture, so "/slices/7" → alias "00007…".
    locations = []
    for digits in range(1, 6):
        pattern = rf"\d{{{digits},}}" if digits == 5 else rf"\d{{{digits}}}"
        padding = "0" * (5 - digits)
        locations.append(
            f'        location ~ "^/datasets/{dataset.name}/slices/({pattern})$" {{\n'
            f"            alias {dataset.directory}/{padding}$1.safetensors;\n"
            f"            add_header X-Sha256 $slice_sha256;\n"
            f"        }}"
        )
    digests = "\n".join(
        f"        {dataset.path(index)} {digest};" for index, digest in enumerate(dataset.digests)
    )
    # Running as root (a container), workers would drop to www-data, which cannot read the private temp dir.
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""{user}daemon off;
master_process on;
worker_processes auto;
error_log {prefix}/error.log warn;
pid {prefix}/nginx.pid;
lock_file {prefix}/nginx.lock;
events {{
    worker_connections 1024;
}}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000;
    types {{ }}
    default_type application/octet-stream;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    map_hash_max_size {max(1024, 2 * dataset.count)};
    map_hash_bucket_size 128;
    map $uri $slice_sha256 {{
        default "";
{digests}
    }}
    server {{
        listen 127.0.0.1:{port};
{chr(10).join(locations)}
    }}
}}
"""


def nginx_version(binary: str) -> str:
    done = subprocess.run([binary, "-v"], capture_output=True, text=True)
    return (done.stderr or done.stdout).strip().removeprefix("nginx version: ")
