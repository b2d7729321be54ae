"""The `pool.tls` section: its validation, and mutual TLS between a TcpTransportServer and a
TcpTransport built from the contexts store_backend.pool.tls makes of it (certificates made here)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from store_backend.config_loader import ConfigError
from store_backend.node.config import load_node_config
from store_backend.pool.config import TlsConfig
from store_backend.pool.tcp_client import TcpTransport
from store_backend.pool.tls import client_context, server_context
from store_backend.types import ReadResult, Status
from tests.store_backend.pool.pool_nodes import SECRET as NODES_SECRET
from tests.store_backend.pool.pool_nodes import make_payload, put_all, read_ok, started_pool, wait_located
from tests.store_backend.pool.redis_server import RedisProcess
from tests.store_backend.pool.transport_helpers import MiB, payload, served, tls_round_trip, transport, wait_for


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _make_ca(tmp: Path, cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    path = tmp / f"{cn}-ca.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, str(path)


def _make_node(tmp: Path, cn: str, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
               ca_file: str) -> TlsConfig:
    """A node certificate signed by the CA, usable both ways (serverAuth and clientAuth), with a
    SAN that is not the address dialled (host names are not checked)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("10.255.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                  x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = tmp / f"{cn}.pem", tmp / f"{cn}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key_path, key)
    return TlsConfig(cert_file=str(cert_path), key_file=str(key_path), ca_file=ca_file)


@pytest.fixture
def pool_ca(tmp_path):
    ca_key, ca_cert, ca_file = _make_ca(tmp_path, "pool")
    return lambda cn: _make_node(tmp_path, cn, ca_key, ca_cert, ca_file)


def test_no_tls_by_default_and_the_section_loads() -> None:
    assert load_node_config({"pool": {"secret": "s"}}).pool.tls is None
    tls = {"cert_file": "/etc/mkv/node.pem", "key_file": "/etc/mkv/node.key", "ca_file": "/etc/mkv/ca.pem"}
    cfg = load_node_config({"pool": {"secret": "s", "tls": tls}}).pool
    assert cfg.tls == TlsConfig(**tls)


@pytest.mark.parametrize(("tls", "field"), [
    ({"key_file": "/k", "ca_file": "/c"}, "pool.tls.cert_file"),
    ({"cert_file": "/c", "ca_file": "/c"}, "pool.tls.key_file"),
    ({"cert_file": "/c", "key_file": "/k"}, "pool.tls.ca_file"),
    ({"cert_file": "node.pem", "key_file": "/k", "ca_file": "/c"}, "pool.tls.cert_file"),
    ({"cert_file": "/c", "key_file": "./node.key", "ca_file": "/c"}, "pool.tls.key_file"),
    ({"cert_file": "/c", "key_file": "/k", "ca_file": "ca.pem"}, "pool.tls.ca_file"),
    ({"cert_file": "/c", "key_file": "/k", "ca_file": "/c", "verify": False}, "verify"),
])
def test_bad_tls_sections_name_the_field(tls, field) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_node_config({"pool": {"secret": "s", "tls": tls}})


def test_a_key_file_group_or_other_can_read_is_refused(pool_ca) -> None:
    cfg = pool_ca("node-a")
    os.chmod(cfg.key_file, 0o640)
    for make in (server_context, client_context):
        with pytest.raises(ValueError, match=r"tls\.key_file: .* readable by group or other \(mode 0640\)"):
            make(cfg)
    os.chmod(cfg.key_file, 0o600)
    assert server_context(cfg).verify_mode == ssl.CERT_REQUIRED


def test_missing_or_wrong_files_name_the_field(pool_ca, tmp_path) -> None:
    cfg = pool_ca("node-a")
    with pytest.raises(ValueError, match=r"tls\.key_file: cannot read .*missing\.key"):
        server_context(TlsConfig(cfg.cert_file, str(tmp_path / "missing.key"), cfg.ca_file))
    with pytest.raises(ValueError, match=r"tls\.ca_file: cannot load .*missing-ca\.pem"):
        client_context(TlsConfig(cfg.cert_file, cfg.key_file, str(tmp_path / "missing-ca.pem")))
    with pytest.raises(ValueError, match=r"tls\.cert_file: cannot read .*missing\.pem"):
        server_context(TlsConfig(str(tmp_path / "missing.pem"), cfg.key_file, cfg.ca_file))
    other = pool_ca("node-b")  # node-b's key does not match node-a's certificate
    with pytest.raises(ValueError, match=r"tls\.cert_file: cannot load"):
        client_context(TlsConfig(cfg.cert_file, other.key_file, cfg.ca_file))


def test_mutual_tls_round_trip_and_a_client_without_a_certificate_is_refused(pool_ca, tmp_path) -> None:
    node_a, node_b = pool_ca("node-a"), pool_ca("node-b")
    # A client that trusts the pool's CA but shows no certificate of its own.
    no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    no_cert.load_verify_locations(cafile=node_b.ca_file)
    no_cert.check_hostname = False
    # A client whose certificate is signed by another CA.
    other_key, other_cert, other_ca = _make_ca(tmp_path, "other")
    stranger = _make_node(tmp_path, "stranger", other_key, other_cert, node_b.ca_file)
    # A client that trusts only the other CA (so not node_a's certificate).
    wary = _make_node(tmp_path, "wary", other_key, other_cert, other_ca)
    with served(ssl_context=server_context(node_a), use_sendfile=True) as (_store, srv):
        t = transport(ssl_context=client_context(node_b), streams=2, min_stream_bytes=1)
        bare = transport(ssl_context=no_cert)
        alien = transport(ssl_context=client_context(stranger))
        untrusting = transport(ssl_context=client_context(wary))
        try:
            keys = tls_round_trip(t, srv, "mtls")

            before = srv.stats()["handshake_failures"]
            miss = [np.zeros(8, np.uint8)]
            assert bare.get_into(srv.address, keys[:1], miss, timeout_s=3.0) == [ReadResult(Status.IO_ERROR)]
            assert not miss[0].any()
            assert wait_for(lambda: srv.stats()["handshake_failures"] >= before + 1)
            assert bare.stats()["failures_refused"] == 1
            assert alien.get_into(srv.address, keys[:1], miss, timeout_s=3.0) == [ReadResult(Status.IO_ERROR)]
            assert wait_for(lambda: srv.stats()["handshake_failures"] >= before + 2)
            assert alien.stats()["failures_refused"] == 1
            assert untrusting.get_into(srv.address, keys[:1], miss, timeout_s=3.0) == [ReadResult(Status.IO_ERROR)]
            assert untrusting.stats()["failures_refused"] == 1
            # The refusals cost the trusted client nothing.
            again = [np.zeros(1 * MiB, np.uint8)]
            assert t.get_into(srv.address, keys[:1], again) == [ReadResult(Status.OK, 1 * MiB)]
            assert np.array_equal(again[0], payload(keys[0], 1 * MiB))
        finally:
            t.close()
            bare.close()
            alien.close()
            untrusting.close()


def test_node_services_with_pool_tls_read_each_others_objects_and_refuse_plain_peers(
        pool_ca, redis_server: RedisProcess) -> None:
    """The wiring in PoolService: both nodes' listeners and clients use pool.tls; a peer with the
    pool's secret but no TLS is refused."""
    tls = {name: {f: getattr(pool_ca(f"node-{name}"), f) for f in ("cert_file", "key_file", "ca_file")}
           for name in ("A", "B")}
    with started_pool(redis_server.url, names=("A",), ssd=False, tls=tls["A"]) as pool_a, \
            started_pool(redis_server.url, names=("B",), ssd=False, tls=tls["B"]) as pool_b:
        (a,), d = pool_a
        (b,), _ = pool_b
        keys = [f"tls-obj-{i}" for i in range(4)]
        put_all(a.client(), {k: make_payload(k, 1, 1 * MiB) for k in keys})
        wait_located(d, keys, "A")
        read_ok(b.client(), keys, 1 * MiB, 1)  # from A, over mutual TLS
        a_addr = next(n.address for n in d.nodes() if n.node_id == "A")
        plain = TcpTransport(NODES_SECRET.encode())
        trusted = TcpTransport(NODES_SECRET.encode(), ssl_context=client_context(pool_ca("node-C")))
        try:
            out = [np.zeros(1 * MiB, np.uint8)]
            assert plain.get_into(a_addr, keys[:1], out, timeout_s=3.0) == [ReadResult(Status.IO_ERROR)]
            assert not out[0].any()
            # The same secret over TLS with a pool certificate reads it (so TLS alone refused the plain one).
            assert trusted.get_into(a_addr, keys[:1], out, timeout_s=3.0) == [ReadResult(Status.OK, 1 * MiB)]
            assert out[0].tobytes() == make_payload(keys[0], 1, 1 * MiB)
        finally:
            plain.close()
            trusted.close()
