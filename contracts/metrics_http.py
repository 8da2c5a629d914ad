"""The /metrics endpoint of a service's Prometheus registry, on an HTTP port of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

from contracts.rpc import ListenError, check_can_listen


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> str:
    """Serve /metrics on host:port; returns its URL. ListenError when the port is taken."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    check_can_listen(address, "metrics")
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:  # taken since the check
        raise ListenError(f"cannot listen on {address} (metrics): {(exc.strerror or str(exc)).lower()}") from None
    host_part = address.rpartition(":")[0]
    return f"http://{host_part}:{server.server_port}/metrics"
