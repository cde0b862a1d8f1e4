"""TLS for laproxd's --listen port: laprox.tls_credentials."""

from __future__ import annotations

from typing import Optional

import grpc

from .errors import LaproxError


def tls_credentials(ca_file: Optional[str] = None, cert_file: Optional[str] = None,
                    key_file: Optional[str] = None) -> grpc.ChannelCredentials:
    """Channel credentials for laproxd's TLS port: the PEM CA bundle that signed its
    certificate (None: the system roots) and, for mutual TLS (--tls_client_ca_file), this
    client's PEM certificate chain and key."""
    def read(path: Optional[str]) -> Optional[bytes]:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise LaproxError(grpc.StatusCode.NOT_FOUND, f"{path} cannot be read: {e}") from None
    return grpc.ssl_channel_credentials(root_certificates=read(ca_file),
                                        private_key=read(key_file),
                                        certificate_chain=read(cert_file))
