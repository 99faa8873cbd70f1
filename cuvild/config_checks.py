"""The checks of the config keys that open the daemon past its unix socket: listen.*
(addresses, TLS files, the token or mutual TLS that guards a TCP or HTTP listener),
metrics.listen and tracing.*; and ConfigError, which every check of cuvild/config.py raises
(naming the key as a dotted path)."""

from __future__ import annotations

import os
from typing import Any


class ConfigError(ValueError):
    """A config key is missing, unknown or has a bad value."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


def check_listen(listen: dict[str, Any]) -> tuple[str | None, str | None, dict[str, Any]]:  # noqa: C901 - a check per key, in the file's order
    """listen.*: addresses, TLS files, and what guards a listener off the unix socket."""
    tcp, http = listen["tcp"], listen["http"]
    for key, address in (("listen.tcp", tcp), ("listen.http", http)):
        if address is not None and (":" not in address
                                    or not address.rsplit(":", 1)[1].isdigit()):
            raise ConfigError(key, f"expected HOST:PORT, got {address!r}")
    tls = listen["tls"]
    if bool(tls["cert"]) != bool(tls["key"]):
        raise ConfigError("listen.tls", "cert and key go together")
    if tls["client_ca"] and not tls["cert"]:
        raise ConfigError("listen.tls.client_ca", "mutual TLS needs the server's cert and key")
    for key in ("cert", "key", "client_ca"):
        if tls[key] and not os.access(tls[key], os.R_OK):
            raise ConfigError(f"listen.tls.{key}", f"cannot read {tls[key]}")
    for address in (tcp, http):
        if address is None:
            continue
        host = address.rsplit(":", 1)[0].strip("[]")
        if not listen["token"] and not tls["client_ca"]:
            if not (listen["insecure_loopback"] and is_loopback(host)):
                raise ConfigError("listen.token", "a TCP or HTTP listener needs a bearer "
                                  "token or mutual TLS (listen.tls.client_ca), or "
                                  "listen.insecure_loopback: true with a loopback host")
        elif listen["token"] and not is_loopback(host):
            check_token(listen["token"])
    return tcp, http, tls


PLACEHOLDER_TOKENS = ("replace-with-a-long-random-token",)  # configs/kserve's sample
MIN_TOKEN_CHARS = 32


def check_token(token: str) -> None:
    """A token that guards a listener off this host: not the sample's, not short (a token
    is all that stands between the network and the daemon's models and memory)."""
    if token in PLACEHOLDER_TOKENS:
        raise ConfigError("listen.token", "is the sample's placeholder: put a random one "
                          "there (e.g. `openssl rand -hex 32`)")
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError("listen.token", f"{len(token)} characters: a listener off this "
                          f"host needs at least {MIN_TOKEN_CHARS} (e.g. `openssl rand -hex "
                          "32`)")


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def metrics_listen(metrics: dict[str, Any]) -> str | None:
    """metrics.listen as HOST:PORT; a bare port (or ":PORT") listens on loopback only."""
    listen = metrics["listen"]
    if listen is None:
        return None
    if not metrics["enabled"]:
        raise ConfigError("metrics.listen", "metrics.enabled is false: nothing to serve")
    text = str(listen)
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError("metrics.listen", f"expected PORT or HOST:PORT, got {listen!r}")
    return f"{host or '127.0.0.1'}:{port}"


def check_tracing(tracing: dict[str, Any]) -> None:
    exporter = tracing["exporter"]  # (one of its choices)
    if exporter == "file" and not tracing["path"]:
        raise ConfigError("tracing.path", "the file exporter writes JSON lines to a path")
    if exporter == "otlp" and not tracing["endpoint"]:
        raise ConfigError("tracing.endpoint", "the otlp exporter needs a collector's URL, "
                          "e.g. http://localhost:4318/v1/traces")
    if not 0 <= tracing["sample_rate"] <= 1:
        raise ConfigError("tracing.sample_rate", f"expected a share in [0, 1], got "
                          f"{tracing['sample_rate']!r}")
