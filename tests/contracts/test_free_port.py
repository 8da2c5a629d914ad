"""contracts.rpc.free_port: ports picked one after another for one stack never repeat, even
when the OS offers a port it has just released again."""

from __future__ import annotations

import socket

from contracts import rpc


class _OfferedSocket:
    """A socket whose bind(("127.0.0.1", 0)) is given the next port of a fixed sequence."""

    offers: list[int] = []

    def __enter__(self) -> _OfferedSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        self.port = self.offers.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_port_offered_again_is_skipped(monkeypatch):
    monkeypatch.setattr(rpc, "_handed_out", set())
    monkeypatch.setattr(rpc.socket, "socket", _OfferedSocket)
    _OfferedSocket.offers = [41643, 41643, 41643, 50973]
    assert [rpc.free_port(), rpc.free_port()] == [41643, 50973]
    assert _OfferedSocket.offers == []


def test_ports_are_distinct_and_free():
    ports = [rpc.free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    for port in ports[:8]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
