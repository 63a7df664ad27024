"""Optional TLS: the listeners' server context, the clients' verifying context, URL schemes.

One switch per direction. With `--tls-cert` and `--tls-key` a process's
HTTP listener serves HTTPS; with `--tls-ca` its outgoing calls (to meta, to
workers, worker to worker: replication stream, snapshot downloads) use
https/wss and verify the peer against that CA only, host name included.
Meta's PySyncObj port is not HTTP and keeps its own encryption (the cluster
secret), so none of this touches it.

`dev_pki` makes the throwaway CA and server certificate of `shardgrid dev --tls`.
"""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import ssl
import stat
from dataclasses import dataclass, field
from pathlib import Path

from shardgrid.common.auth import write_secret_bytes

CA_ENV = "SHARDGRID_TLS_CA"
DEV_HOSTS = ("127.0.0.1", "::1", "localhost")


class TlsConfigError(ValueError):
    """TLS flags or files that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class Tls:
    """A process's TLS: `server` for its listener, `client` for its outgoing calls (None: plain HTTP)."""

    server: ssl.SSLContext | None = field(default=None, repr=False)
    client: ssl.SSLContext | None = field(default=None, repr=False)

    @property
    def scheme(self) -> str:
        return scheme(self.client)


NO_TLS = Tls()


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The listener's context: TLS 1.2 at least, no client certificate asked for."""
    _check_key_private(key)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"cannot load certificate {cert} with key {key}: {exc}") from None
    return ctx


def client_context(ca: Path) -> ssl.SSLContext:
    """The outgoing calls' context: peers must present a certificate `ca` signed for the
    address dialled. Only `ca` is trusted, not the system store: a certificate some
    public CA issued for a cluster address proves nothing about being a cluster member."""
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"cannot load CA certificate {ca}: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def scheme(client: ssl.SSLContext | None) -> str:
    """The scheme of intra-cluster URLs for a process with this client context."""
    return "https" if client is not None else "http"


def base_url(addr: str, client: ssl.SSLContext | None) -> str:
    """`host:port` -> `scheme://host:port`; an address that carries its scheme keeps it."""
    return addr if addr.startswith(("http://", "https://")) else f"{scheme(client)}://{addr}"


def connector_ssl(client: ssl.SSLContext | None) -> ssl.SSLContext | bool:
    """What aiohttp.TCPConnector(ssl=...) takes: our context, or aiohttp's default."""
    return client if client is not None else True


def _check_key_private(key: Path) -> None:
    # The same rule as secret files (shardgrid/common/auth.py): a key others can read
    # or replace proves nothing about who holds it.
    try:
        mode = stat.S_IMODE(os.stat(key).st_mode)
    except OSError as exc:
        raise TlsConfigError(f"cannot read TLS key {key}: {exc.strerror}") from None
    if mode & 0o077:
        raise TlsConfigError(f"TLS key {key} is readable or writable by other users (mode {mode:04o}): "
                             f"run `chmod 600 {key}`")


# -- command line -----------------------------------------------------------------------------------


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """--tls-cert/--tls-key (the listener) and --tls-ca (outgoing calls) of a server process.

    No environment fallback here, unlike topoctl's SHARDGRID_TLS_CA: a variable
    exported for topoctl would otherwise turn on https in every process started
    from that shell, against peers that serve plain http."""
    parser.add_argument("--tls-cert", default=None, metavar="PEM",
                        help="serve HTTPS with this certificate (chain); needs --tls-key")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert (mode 0600)")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="call meta and workers over https, verifying them against this CA")


def tls_from_args(args: argparse.Namespace) -> Tls:
    cert, key, ca = args.tls_cert, args.tls_key, args.tls_ca
    if (cert is None) != (key is None):
        raise TlsConfigError("--tls-cert and --tls-key go together")
    return Tls(server=server_context(Path(cert), Path(key)) if cert and key else None,
               client=client_context(Path(ca)) if ca else None)


# -- the dev cluster's throwaway PKI --------------------------------------------------------------


@dataclass(frozen=True)
class DevPki:
    ca: Path
    cert: Path
    key: Path


def dev_pki(directory: Path, hosts: tuple[str, ...] = DEV_HOSTS, days: int = 30) -> DevPki:
    """A CA and one server certificate (for `hosts`: IPs and DNS names) under `directory`.

    Made anew every time: the CA key is thrown away once the certificate is
    signed, so a copied dev CA can sign nothing more. Keys are written 0600."""
    # Here, not at the top: every process imports this module, only `shardgrid dev --tls` makes certificates.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    # Backdated a little: a child process's clock read a moment earlier must still accept it.
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shardgrid dev CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False, key_agreement=False,
                                            key_cert_sign=True, crl_sign=True, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(ca_ski, critical=False)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shardgrid dev")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pki = DevPki(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    write_secret_bytes(pki.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    # Certificates are public; written the same atomic way, so a reader never sees half of one.
    write_secret_bytes(pki.cert, cert.public_bytes(serialization.Encoding.PEM))
    write_secret_bytes(pki.ca, ca_cert.public_bytes(serialization.Encoding.PEM))
    return pki
