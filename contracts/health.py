"""grpc.health.v1: `check_health` (is the server at an address SERVING?), and the protocol
without the grpcio-health-checking package.

Servers use that package's servicer when it is installed; where it is not (a lean GPU
image), `FallbackHealthServicer` answers the same protocol (Check and Watch), so load
balancers, `check_health` and the tests work alike. The two messages are built from a
descriptor in a private pool, so nothing clashes with the package's own generated code.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE_NAME = "grpc.health.v1.Health"
UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = 0, 1, 2, 3


def _messages() -> tuple[type, type]:
    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(
        name="picovllm/health_fallback.proto", package="grpc.health.v1", syntax="proto3"
    )
    req = fdp.message_type.add(name="HealthCheckRequest")
    req.field.add(name="service", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    resp = fdp.message_type.add(name="HealthCheckResponse")
    status = resp.enum_type.add(name="ServingStatus")
    for name, number in (
        ("UNKNOWN", UNKNOWN),
        ("SERVING", SERVING),
        ("NOT_SERVING", NOT_SERVING),
        ("SERVICE_UNKNOWN", SERVICE_UNKNOWN),
    ):
        status.value.add(name=name, number=number)
    resp.field.add(
        name="status",
        number=1,
        type=f.TYPE_ENUM,
        label=f.LABEL_OPTIONAL,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    get = message_factory.GetMessageClass
    return get(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")), get(
        pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")
    )


HealthCheckRequest, HealthCheckResponse = _messages()


class FallbackHealthServicer:
    """Check and Watch of grpc.health.v1 for an aio server; `set` as in grpc_health."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._changed = asyncio.Condition()

    async def set(self, service: str, status: int) -> None:
        async with self._changed:
            self._status[service] = status
            self._changed.notify_all()

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.service not in self._status:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return HealthCheckResponse(status=self._status[request.service])

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext):
        last = None
        while True:
            status = self._status.get(request.service, SERVICE_UNKNOWN)
            if status != last:
                yield HealthCheckResponse(status=status)
                last = status
            async with self._changed:
                await self._changed.wait()

    def add_to_server(self, server: grpc.aio.Server) -> None:
        handlers = {
            "Check": grpc.unary_unary_rpc_method_handler(
                self.Check, HealthCheckRequest.FromString, HealthCheckResponse.SerializeToString
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                self.Watch, HealthCheckRequest.FromString, HealthCheckResponse.SerializeToString
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


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
