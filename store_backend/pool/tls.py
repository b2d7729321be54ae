"""The pool transport's TLS contexts, built from ``pool.tls`` (:class:`~store_backend.pool.config.TlsConfig`).

Mutual TLS: :func:`server_context` (for :class:`~store_backend.pool.tcp_server.TcpTransportServer`)
shows this node's certificate and requires one from every peer that dials it, signed by
``ca_file``; :func:`client_context` (for :class:`~store_backend.pool.tcp_client.TcpTransport`) shows
the same certificate and requires the server's to be signed by ``ca_file``. So a node's
certificate is used both ways: if it carries extendedKeyUsage, that must list serverAuth and
clientAuth. TLS 1.2 at least. The shared-secret handshake still runs inside the TLS session.

Host names are not checked (``check_hostname`` off, on both sides): peers are dialled by the
address they advertise in the directory (often a bare IP, behind NAT a different one from the one
they bind), so a name in the certificate would tie it to one address without naming a pool
member any better. A peer is trusted because its certificate is signed by ``ca_file``: give the
pool a CA of its own, one that signs node certificates only, never a public or company-wide CA.

Blocking (reads the files); each call returns a new context. ValueError naming the field
(``tls.key_file: ...``) for a file that is missing, unreadable, not PEM, or (the key) readable by
group or other.
"""

from __future__ import annotations

import ssl

from store_backend.pool.config import TlsConfig
from store_backend.pool.private_file import check_private_file


def _checked_key_file(cfg: TlsConfig) -> str:
    path = cfg.key_file
    assert path is not None  # TlsConfig requires it
    check_private_file(path, "tls.key_file: ")
    return path


def _load(ctx: ssl.SSLContext, cfg: TlsConfig) -> ssl.SSLContext:
    key_file = _checked_key_file(cfg)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(cafile=cfg.ca_file)
    except (OSError, ssl.SSLError) as e:  # FileNotFoundError, or no PEM certificate in it
        raise ValueError(f"tls.ca_file: cannot load {cfg.ca_file}: {e}") from None
    try:
        ctx.load_cert_chain(certfile=cfg.cert_file, keyfile=key_file)
    except FileNotFoundError as e:
        # ssl says only "No such file" without the name: the key was stat'ed above, so it is the cert.
        raise ValueError(f"tls.cert_file: cannot read {cfg.cert_file}: {e.strerror}") from None
    except (OSError, ssl.SSLError) as e:  # not PEM, or the key does not match the certificate
        raise ValueError(f"tls.cert_file: cannot load {cfg.cert_file} with tls.key_file {key_file}: {e}") from None
    # Both sides: the peer must show a certificate signed by ca_file (see the module docstring).
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def server_context(cfg: TlsConfig) -> ssl.SSLContext:
    """The listener's context: this node's certificate; a client certificate signed by ``ca_file``
    is required (a peer without one fails the handshake, counted as ``handshake_failures``)."""
    return _load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), cfg)


def client_context(cfg: TlsConfig) -> ssl.SSLContext:
    """The dialling side's context: this node's certificate shown to the peer; the peer's
    certificate must be signed by ``ca_file`` (host names unchecked, see the module docstring)."""
    return _load(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), cfg)
