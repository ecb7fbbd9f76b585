"""Mutual TLS to a real redis-server (--tls-port, --tls-auth-clients yes) with certificates made here.

The buffer's config path (redis.tls, tls_ca_certs, tls_certfile, tls_keyfile) against the server: the
client with a certificate of the trusted CA reads and writes; without one, with one from another CA,
without trusting the server's CA, or in plain text, it is refused.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from asyncrl.buffer import ReplayBuffer
from asyncrl.config import load_config
from tests.conftest import small_group

cryptography = pytest.importorskip("cryptography")
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

REDIS = shutil.which("redis-server")


def _tls_supported() -> bool:
    if REDIS is None:
        return False
    r = subprocess.run([REDIS, "--port", "0", "--tls-port", "0"], capture_output=True, text=True, timeout=10)
    return "FATAL" not in r.stdout + r.stderr  # a build without TLS rejects the option


pytestmark = pytest.mark.skipif(not _tls_supported(), reason="redis-server without TLS support")


def _cert(dir: Path, name: str, issuer: tuple | None, *, ca: bool = False, server: bool = False) -> tuple:
    """Write <name>.crt/.key (EC P-256); ``issuer`` = (cert, key) of the signing CA, None = self-signed."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = b.sign(issuer[1] if issuer else key, hashes.SHA256())
    (dir / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (dir / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    (dir / f"{name}.key").chmod(0o600)
    return cert, key


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca = _cert(d, "ca", None, ca=True)
    _cert(d, "server", ca, server=True)
    _cert(d, "client", ca)
    rogue = _cert(d, "rogue-ca", None, ca=True)
    _cert(d, "rogue-client", rogue)
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [REDIS, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", "",
         "--appendonly", "no", "--requirepass", "pw", "--tls-cert-file", str(d / "server.crt"),
         "--tls-key-file", str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.crt"),
         "--tls-auth-clients", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:  # ready once a trusted client gets PONG
            try:
                c = redis.Redis(host="127.0.0.1", port=port, password="pw", ssl=True,
                                ssl_ca_certs=str(d / "ca.crt"), ssl_certfile=str(d / "client.crt"),
                                ssl_keyfile=str(d / "client.key"), socket_timeout=2)  # fmt: skip
                c.ping()
                c.close()
                break
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    "redis-server with TLS did not start"
                )
                time.sleep(0.1)
        yield d, port
    finally:
        proc.terminate()
        proc.wait(10)


def _cfg(d: Path, port: int, run: str, *, cert: str | None = "client", ca: bool = True, tls: bool = True):
    over = [f"run.name={run}", f"redis.url=redis://127.0.0.1:{port}/0", "redis.password=pw",
            f"redis.tls={str(tls).lower()}", "redis.retry_budget_s=1", "redis.socket_timeout_s=2"]  # fmt: skip
    if ca:
        over.append(f"redis.tls_ca_certs={d / 'ca.crt'}")
    if cert:
        over += [f"redis.tls_certfile={d / f'{cert}.crt'}", f"redis.tls_keyfile={d / f'{cert}.key'}"]
    return load_config(None, over)


def test_client_certificate_of_the_trusted_ca_reads_and_writes(tls_server, run_name):
    d, port = tls_server
    buf = ReplayBuffer.from_config(_cfg(d, port, run_name))
    try:
        g = small_group()
        buf.put(g)
        got = buf.read("learner-0", 1, block_ms=1000)
        assert [e.group.group_id for e in got] == [g.group_id]
        assert buf.client.connection_pool.connection_kwargs.get("ssl_certfile") == str(d / "client.crt")
    finally:
        buf.delete_run()
        buf.close()


# (client certificate, trust the server's CA, TLS at all, what the TLS layer says)
REFUSALS = [
    (None, True, True, "CERTIFICATE_REQUIRED|SSLEOF"),  # no client cert: alert or hang-up (TLS 1.3 timing)
    ("rogue-client", True, True, "SSL"),  # a client certificate of another CA: the server hangs up
    ("client", False, True, "CERTIFICATE_VERIFY_FAILED"),  # the server's CA is not trusted
    (None, False, False, "Connection|closed"),  # plain text to the TLS port
]


@pytest.mark.parametrize(("cert", "ca", "tls", "cause"), REFUSALS)
def test_refused(tls_server, run_name, cert, ca, tls, cause):
    d, port = tls_server
    t0 = time.monotonic()
    with pytest.raises((redis.ConnectionError, redis.TimeoutError)) as e:
        ReplayBuffer.from_config(_cfg(d, port, run_name, cert=cert, ca=ca, tls=tls))
    chain, c = [], e.value
    while c is not None:  # the TLS reason is the cause of the buffer's connection error
        chain.append(repr(c))
        c = c.__cause__ or c.__context__
    assert re.search(cause, " | ".join(chain[1:])), chain
    assert time.monotonic() - t0 < 15, "refused within the retry budget, not after a hang"
