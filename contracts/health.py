"""grpc.health.v1 from the client side: `check_health` (is the server at an address SERVING?),
`check` on an open channel, and the protocol's names for the scheduler's peer monitor and the
HTTP gateway. Servers add grpcio-health-checking's servicer (contracts.rpc).
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2

SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
HealthCheckRequest = health_pb2.HealthCheckRequest
HealthCheckResponse = health_pb2.HealthCheckResponse
SERVING, NOT_SERVING = HealthCheckResponse.SERVING, HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = HealthCheckResponse.SERVICE_UNKNOWN


def check(channel: grpc.Channel, service: str = "", timeout: float = 1.0) -> int:
    """The status a server reports for `service` (raises grpc.RpcError when it cannot say)."""
    call = channel.unary_unary(
        f"/{SERVICE_NAME}/Check",
        request_serializer=HealthCheckRequest.SerializeToString,
        response_deserializer=HealthCheckResponse.FromString,
    )
    return call(HealthCheckRequest(service=service), timeout=timeout).status


def check_health(address: str, service: str = "", timeout: float = 1.0, root_certificates: bytes | None = None) -> bool:
    """True when the server at `address` answers SERVING for `service` (over TLS trusting
    `root_certificates` when given)."""
    channel = (
        grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates))
        if root_certificates
        else grpc.insecure_channel(address)
    )
    with channel:
        try:
            return check(channel, service, timeout) == SERVING
        except grpc.RpcError:
            return False


def main(argv: list[str] | None = None) -> int:
    """`python -m contracts.health HOST:PORT [SERVICE]`: exit 0 when it answers SERVING
    (the containers' healthcheck)."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m contracts.health HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    return 0 if check_health(args[0], args[1] if len(args) > 1 else "", timeout=3.0) else 1


if __name__ == "__main__":
    raise SystemExit(main())
