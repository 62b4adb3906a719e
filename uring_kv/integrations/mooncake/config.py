"""How a Mooncake tier reaches its cluster, and its own settings: :class:`MooncakeConfig` (checked,
with defaults), and :class:`MooncakeError`. Imports nothing from Mooncake."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from dataclasses import dataclass

from uring_kv.errors import UringKVError


class MooncakeError(UringKVError, RuntimeError):
    """The Mooncake client could not be set up, or a call into it failed as a whole."""


@dataclass(frozen=True)
class MooncakeConfig:
    """How to reach the Mooncake cluster, and the tier's own settings.

    ``master_address`` (``host:port`` of ``mooncake_master``) and ``metadata_server`` (its HTTP
    metadata URL, or etcd) are the cluster's. ``local_hostname``: this process's address as the
    other clients reach it (its segment is read from there). ``segment_bytes``: memory this
    process lends to the cluster's pool (0: lends none; values then live in other processes'
    segments or in a ``mooncake_client`` store node). ``protocol``/``rdma_devices``: Mooncake's
    transport. ``namespace``: the prefix of every remote key (processes sharing a prefix cache
    use the same). ``staging_rows``: blocks in flight to or from Mooncake at once.
    ``timeout``: seconds a call may take before its keys count as misses or unstored;
    ``retry_after``: seconds the tier leaves Mooncake alone after it was unreachable;
    ``quarantine``: seconds a row rests after a call that may still be moving its bytes.
    ``bind_address``: ``MC_TCP_BIND_ADDRESS`` for this process, set on open (the address Mooncake's
    transfer engine uses); by default ``local_hostname`` when that is a loopback address. The
    client 0.3.13 still listens on 0.0.0.0 whatever it says: see docs/distributed.md."""

    master_address: str
    metadata_server: str
    local_hostname: str = "127.0.0.1"
    segment_bytes: int = 512 << 20
    local_buffer_bytes: int = 16 << 20
    protocol: str = "tcp"
    rdma_devices: str = ""
    namespace: str = "uring-kv"
    staging_rows: int = 64
    timeout: float = 2.0
    retry_after: float = 1.0
    quarantine: float = 120.0
    bind_address: str | None = None

    def __post_init__(self) -> None:
        for name in ("segment_bytes", "local_buffer_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MooncakeConfig.{name} must be a non-negative integer, got {value!r}")
        if isinstance(self.staging_rows, bool) or not isinstance(self.staging_rows, int) or self.staging_rows < 1:
            raise ValueError(f"MooncakeConfig.staging_rows must be a positive integer, got {self.staging_rows!r}")
        for name in ("timeout", "retry_after", "quarantine"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MooncakeConfig.{name} must be positive, got {getattr(self, name)!r}")
        if not self.namespace or "/" in self.namespace:
            raise ValueError(f"MooncakeConfig.namespace must be non-empty and without '/', got {self.namespace!r}")

    def resolved_bind_address(self) -> str | None:
        if self.bind_address is not None:
            return self.bind_address
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(self.local_hostname).is_loopback:
                return self.local_hostname
        return None


def check_reachable(what: str, address: str, timeout: float) -> None:
    """MooncakeError unless a TCP connection to ``host:port`` opens within ``timeout`` seconds."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as exc:
        raise MooncakeError(f"the Mooncake {what} at {address} is not reachable ({exc})") from exc
