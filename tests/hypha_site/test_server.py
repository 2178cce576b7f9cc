"""``hypha-server web`` with daphne's own TLS (``--endpoint ssl:…``), as docs/deploy.md describes it: a real
process on loopback, HTTPS and WSS checked against a self-signed certificate."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import websockets
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from hypha_site.server import _parser
from tests.hypha_site.server_process import free_port, running_server, server_environment

ROOT = Path(__file__).resolve().parents[2]


def test_endpoints_and_proxy_headers_are_parsed() -> None:
    args = _parser().parse_args(
        [
            "web",
            "--endpoint",
            "ssl:8443:privateKey=k.pem:certKey=c.pem",
            "--endpoint=tcp:8000",
            "--proxy-headers",
        ]
    )
    assert (args.component, args.endpoint, args.proxy_headers) == (
        "web",
        ["ssl:8443:privateKey=k.pem:certKey=c.pem", "tcp:8000"],
        True,
    )
    defaults = _parser().parse_args([])
    assert (defaults.endpoint, defaults.proxy_headers) == (None, False)


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .sign(key, hashes.SHA256())
    )
    key_file, certificate_file = directory / "key.pem", directory / "crt.pem"
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    certificate_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return key_file, certificate_file


@pytest.fixture
def tls_server(tmp_path: Path):
    """``hypha-server web --endpoint ssl:…`` (embedded default); yields its https URL and the CA file."""
    key_file, certificate_file = self_signed(tmp_path)
    port = free_port()
    environment = server_environment(tmp_path / "data")
    endpoint = f"ssl:{port}:interface=127.0.0.1:privateKey={key_file}:certKey={certificate_file}"
    with running_server(["--endpoint", endpoint], port=port, environment=environment):
        yield f"https://127.0.0.1:{port}", certificate_file


def test_daphne_serves_https_and_wss_on_an_ssl_endpoint(tls_server) -> None:
    # given
    url, certificate_file = tls_server
    context = ssl.create_default_context(cafile=str(certificate_file))

    # when: HTTPS
    response = httpx.get(f"{url}/api/schema/", verify=context, timeout=10)

    # then
    assert response.status_code == 200
    assert response.url.scheme == "https"

    # and WSS: the worker gateway answers an unknown token with its error frame and 4001
    async def gateway() -> tuple[dict, int]:
        async with websockets.connect(
            url.replace("https://", "wss://") + "/ws/worker/",
            ssl=context,
            additional_headers={"Authorization": "Bearer hw_not-a-token"},
            open_timeout=10,
        ) as connection:
            frame = json.loads(await asyncio.wait_for(connection.recv(), 10))
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(connection.recv(), 10)
            return frame, connection.close_code

    frame, code = asyncio.run(gateway())
    assert (frame["type"], frame["code"], frame["message"], code) == (
        "error",
        "refused",
        "unknown worker token",
        4001,
    )


def test_a_daemon_reaches_the_gateway_over_wss_trusting_the_certificate_by_ssl_cert_file(
    tls_server, tmp_path
):
    # given: the daemon's default TLS context honours SSL_CERT_FILE (a private CA or a self-signed certificate)
    url, certificate_file = tls_server
    environment = {name: value for name, value in os.environ.items() if not name.startswith("HYPHA_")}
    environment["SSL_CERT_FILE"] = str(certificate_file)

    # when: it connects with a token the control plane does not know
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker_daemon",
            "--server",
            url,
            "--token",
            "hw_not-a-token",
            "--work-dir",
            str(tmp_path),
            "--no-benchmark",
        ],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )

    # then: the TLS handshake passed and the gateway's refusal came back over wss (exit 3: token refused)
    assert result.returncode == 3, result.stderr
    assert "unknown worker token" in result.stderr
    assert "CERTIFICATE_VERIFY_FAILED" not in result.stderr
