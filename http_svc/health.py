"""`python -m http_svc.health HOST:PORT`: exit 0 when the gateway's /health answers 200 (the
container healthcheck; the gateway says 200 only while the scheduler is SERVING)."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request


def check(address: str, timeout: float = 3.0) -> bool:
    """True when http://<address>/health answers 200 (plain HTTP, stdlib only)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never goes through a proxy
    try:
        with opener.open(f"http://{address}/health", timeout=timeout) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m http_svc.health HOST:PORT", file=sys.stderr)
        return 2
    return 0 if check(args[0]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
