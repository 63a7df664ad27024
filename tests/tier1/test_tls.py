"""shardgrid/common/tls.py: contexts, the dev PKI, and the rules around them (no processes)."""
from __future__ import annotations

import argparse
import ssl
import stat
import subprocess
import sys
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from gateway.router import RoutingTable
from meta.client import MetaClient, TokenInClear
from shardgrid import topoctl
from shardgrid.common.auth import write_secret
from shardgrid.common.tls import (NO_TLS, DevPki, Tls, TlsConfigError, add_tls_arguments, base_url, client_context,
                           connector_ssl, dev_pki, scheme, server_context, tls_from_args)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return dev_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return dev_pki(tmp_path_factory.mktemp("other"))


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


@pytest.fixture
async def https_port(pki: DevPki) -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_get("/", _ok)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_context(pki.cert, pki.key))
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield port
    finally:
        await runner.cleanup()


def test_dev_pki_files_and_modes(pki: DevPki) -> None:
    from cryptography import x509

    assert stat.S_IMODE(pki.key.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(pki.cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    ca = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_contexts(pki: DevPki) -> None:
    server = server_context(pki.cert, pki.key)
    assert server.minimum_version == ssl.TLSVersion.TLSv1_2
    client = client_context(pki.ca)
    assert client.minimum_version == ssl.TLSVersion.TLSv1_2
    assert client.verify_mode == ssl.CERT_REQUIRED and client.check_hostname
    # Only the given CA: the system store is not loaded as well.
    assert len(client.get_ca_certs()) == 1
    assert scheme(client) == "https" and scheme(None) == "http"
    assert Tls(client=client).scheme == "https" and NO_TLS.scheme == "http"
    assert base_url("127.0.0.1:1", client) == "https://127.0.0.1:1"
    assert base_url("127.0.0.1:1", None) == "http://127.0.0.1:1"
    assert base_url("http://127.0.0.1:1", client) == "http://127.0.0.1:1"  # an explicit scheme is kept
    assert connector_ssl(client) is client and connector_ssl(None) is True


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_handshake_verifies_against_the_ca(pki: DevPki, https_port: int, host: str) -> None:
    conn = aiohttp.TCPConnector(ssl=client_context(pki.ca))
    async with aiohttp.ClientSession(connector=conn) as s:
        async with s.get(f"https://{host}:{https_port}/") as r:
            assert r.status == 200 and await r.json() == {"ok": True}


async def test_a_wrong_ca_fails_verification(other_pki: DevPki, https_port: int) -> None:
    conn = aiohttp.TCPConnector(ssl=client_context(other_pki.ca))
    async with aiohttp.ClientSession(connector=conn) as s:
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            async with s.get(f"https://127.0.0.1:{https_port}/"):
                pass


async def test_plain_http_to_the_tls_port_fails(https_port: int) -> None:
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientError):
            async with s.get(f"http://127.0.0.1:{https_port}/", timeout=aiohttp.ClientTimeout(total=5)) as r:
                await r.read()


async def test_a_name_outside_the_certificate_fails(pki: DevPki, https_port: int) -> None:
    # The right CA, but the certificate names 127.0.0.1, ::1 and localhost only.
    conn = aiohttp.TCPConnector(ssl=client_context(pki.ca))
    async with aiohttp.ClientSession(connector=conn) as s:
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            async with s.get(f"https://127.0.0.1:{https_port}/", server_hostname="meta.example"):
                pass


def test_bad_configurations(pki: DevPki, tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    add_tls_arguments(p)
    with pytest.raises(TlsConfigError, match="go together"):
        tls_from_args(p.parse_args(["--tls-cert", str(pki.cert)]))
    loose = tmp_path / "loose.key"
    loose.write_bytes(pki.key.read_bytes())
    loose.chmod(0o644)
    with pytest.raises(TlsConfigError, match="chmod 600"):
        tls_from_args(p.parse_args(["--tls-cert", str(pki.cert), "--tls-key", str(loose)]))
    with pytest.raises(TlsConfigError, match="CA certificate"):
        client_context(tmp_path / "missing.pem")
    with pytest.raises(TlsConfigError, match="cannot load certificate"):
        server_context(pki.ca, pki.key)  # the key does not match the certificate
    tls = tls_from_args(p.parse_args(["--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-ca", str(pki.ca)]))
    assert tls.server is not None and tls.client is not None
    assert tls_from_args(p.parse_args([])) == NO_TLS


async def test_meta_client_never_sends_the_token_in_clear(pki: DevPki) -> None:
    ctx = client_context(pki.ca)
    with pytest.raises(TlsConfigError, match="http://127.0.0.1:2 is plain http"):
        MetaClient(["127.0.0.1:1", "http://127.0.0.1:2"], admin_token="t", tls=ctx)
    client = MetaClient(["127.0.0.1:1"], admin_token="t", tls=ctx, deadline_s=1)
    assert client.addrs == ["https://127.0.0.1:1"]
    client.prefer("127.0.0.1:3")  # a leader meta names: the client's own scheme
    assert client.addrs[-1] == "https://127.0.0.1:3"
    # Should an http:// address get in later all the same, the token is not sent there.
    client.addrs.append("http://127.0.0.1:4")
    client._preferred = 2
    try:
        with pytest.raises(TokenInClear):
            await client.request("PUT", "/v1/topology", data=b"x", admin=True)
    finally:
        await client.close()


def test_topoctl_refuses_plain_http_with_a_ca(pki: DevPki, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SHARDGRID_ADMIN_TOKEN", "secret-token")
    monkeypatch.setenv("SHARDGRID_TLS_CA", str(pki.ca))
    assert topoctl.main(["--meta", "http://127.0.0.1:1", "--timeout", "1", "transfer", "1"]) == topoctl.EXIT_REJECTED
    err = capsys.readouterr().err
    assert "http://127.0.0.1:1 is plain http" in err and "secret-token" not in err


def test_the_routing_table_dials_workers_with_the_scheme() -> None:
    view = {"revision": 1, "workers": {"w1": {"addr": "127.0.0.1:7201"}}, "groups": {}}
    assert RoutingTable.from_view(view, "https").workers["w1"].base == "https://127.0.0.1:7201"
    assert RoutingTable.from_view(view).workers["w1"].base == "http://127.0.0.1:7201"


def test_processes_exit_2_on_bad_tls_flags(pki: DevPki, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardgrid import cli

    loose = tmp_path / "loose.key"
    loose.write_bytes(pki.key.read_bytes())
    loose.chmod(0o640)
    secret = tmp_path / "cluster.secret"
    write_secret(secret, "a-cluster-secret-of-some-length")
    gateway = ["gateway", "--http", "127.0.0.1:1", "--meta", "127.0.0.1:2", "--secret-file", str(secret)]
    assert cli.main([*gateway, "--tls-cert", str(pki.cert)]) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    assert cli.main([*gateway, "--tls-cert", str(pki.cert), "--tls-key", str(loose)]) == 2
    assert "chmod 600" in capsys.readouterr().err
    worker = ["worker", "--id", "w1", "--http", "127.0.0.1:1", "--meta", "127.0.0.1:2", "--data", str(tmp_path / "w"),
              "--secret-file", str(secret)]
    assert cli.main([*worker, "--tls-ca", str(tmp_path / "nope.pem")]) == 2
    assert "shardgrid worker: cannot load CA certificate" in capsys.readouterr().err
    # A gateway forwards callers' admin tokens to meta: with a CA, never to an http:// address.
    # In a process of its own: its serve() configures logging onto this process's stderr.
    gw = subprocess.run([sys.executable, "-m", "shardgrid.cli", "gateway", "--http", "127.0.0.1:1", "--meta",
                         "http://127.0.0.1:2", "--tls-ca", str(pki.ca), "--secret-file", str(secret)], capture_output=True, text=True, timeout=60)
    assert gw.returncode == 2 and "http://127.0.0.1:2 is plain http" in gw.stderr, gw.stderr


def test_topoctl_without_a_ca_probes_before_sending_a_token(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """An operator forgot --tls-ca against an HTTPS meta: the token must not reach the wire.

    The fake meta records every byte it receives and hangs up, as a TLS
    listener does when plain HTTP arrives."""
    import socketserver
    import threading

    received: list[bytes] = []

    class HangUp(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            received.append(self.request.recv(65536))

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), HangUp) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            monkeypatch.setenv("SHARDGRID_ADMIN_TOKEN", "secret-token")
            monkeypatch.delenv("SHARDGRID_TLS_CA", raising=False)
            addr = f"127.0.0.1:{server.server_address[1]}"
            assert topoctl.main(["--meta", addr, "--timeout", "1", "transfer", "1"]) == topoctl.EXIT_UNREACHABLE
        finally:
            server.shutdown()
    assert received and all(b"GET /healthz" in r for r in received if r)
    assert not any(b"secret-token" in r for r in received)
    assert "pass --tls-ca" in capsys.readouterr().err
