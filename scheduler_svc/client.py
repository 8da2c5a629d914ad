"""A small Python client of the scheduler service, and `picovllm client "prompt"`.

    from scheduler_svc.client import Client
    with Client("127.0.0.1:50051") as c:
        for msg in c.generate("Once upon a time", max_tokens=32, temperature=0):
            print(msg.text, end="", flush=True)

The API key, when the server requires one, comes from `api_key`, else $PICOVLLM_API_KEY (or
the file named by $PICOVLLM_API_KEY_FILE); `tls_ca` (PEM bytes or a file) makes the channel
TLS, trusting that CA.

Needs grpcio and protobuf only (no torch). Sampling parameters left out take the server's
defaults, which are SamplingParams' (vLLM's): temperature 1.0. `picovllm client` passes its
own flags' defaults instead, temperature 0 (greedy).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc

from contracts.auth import API_KEY_ENV, call_metadata, read_secret
from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
from protos.picovllm.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.cli_args import UsageError, add_log_flags, add_sampling_flags, sampling_kwargs

DEFAULT_ADDRESS = "127.0.0.1:50051"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SchedulerService"].full_name
_REPEATED = ("stop", "stop_token_ids")


def sampling_to_pb(**sampling: Any) -> pb.SamplingParams:
    """Keyword arguments named as in SamplingParams; None means 'server default'."""
    m = pb.SamplingParams()
    for name, value in sampling.items():
        if value is None:
            continue
        if name in _REPEATED:
            getattr(m, name).extend([value] if isinstance(value, (str, int)) else value)
        elif not hasattr(m, name):
            raise TypeError(f"unknown sampling parameter {name!r}")
        else:
            setattr(m, name, value)
    return m


def generate_request(
    prompt: str | list[int], request_id: str = "", cache_salt: str = "", **sampling: Any
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id, cache_salt=cache_salt, sampling=sampling_to_pb(**sampling))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(prompt)
    return req


class Client:
    def __init__(
        self,
        address: str | None = None,
        timeout: float | None = None,
        api_key: str | None = None,
        tls_ca: bytes | str | None = None,
    ) -> None:
        self.address = address or os.environ.get("PICOVLLM_SCHEDULER_ADDR", DEFAULT_ADDRESS).replace(
            "0.0.0.0", "127.0.0.1"
        )
        self.timeout = timeout
        self.metadata = call_metadata(api_key if api_key is not None else read_secret(API_KEY_ENV, check=False))
        if isinstance(tls_ca, str):
            with open(tls_ca, "rb") as f:
                tls_ca = f.read()
        self.channel = (
            grpc.secure_channel(self.address, grpc.ssl_channel_credentials(tls_ca))
            if tls_ca
            else grpc.insecure_channel(self.address)
        )
        self.stub = pb_grpc.SchedulerServiceStub(self.channel)

    def generate(
        self,
        prompt: str | list[int],
        *,
        request_id: str = "",
        cache_salt: str = "",
        timeout: float | None = None,
        **sampling: Any,
    ) -> Iterator[pb.GenerateResponse]:
        """Stream the completion, one message per step; the last one has a finish reason.
        Closing the iterator early cancels the call (the server aborts the request)."""
        call = self.stub.Generate(
            generate_request(prompt, request_id, cache_salt, **sampling),
            timeout=timeout or self.timeout,
            metadata=self.metadata,
        )
        try:
            yield from call
        finally:
            call.cancel()

    def complete(self, prompt: str | list[int], **kwargs: Any) -> tuple[str, list[int], pb.GenerateResponse]:
        """The whole completion: (text, token ids, last message). Keywords as `generate`'s;
        sampling left out takes the server's defaults (temperature 1.0, as vLLM's). One
        completion only: generate() streams those of n > 1, each message with its index."""
        if kwargs.get("n") not in (None, 1):
            raise ValueError("complete() returns one completion; use generate() for n > 1")
        text, ids, last = [], [], None
        for last in self.generate(prompt, **kwargs):
            text.append(last.text)
            ids.extend(last.token_ids)
        assert last is not None
        return "".join(text), ids, last

    def abort(self, request_id: str, timeout: float = 10.0) -> None:
        self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout, metadata=self.metadata)

    def model_info(self, timeout: float = 10.0) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def load(self, timeout: float = 10.0) -> pb.GetLoadResponse:
        """Waiting and running requests, KV usage and replica id (a router's: the fleet's sum)."""
        return self.stub.GetLoad(pb.GetLoadRequest(), timeout=timeout, metadata=self.metadata)

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the scheduler's grpc.health.v1 says SERVING; False after `timeout` s."""
        from contracts import health

        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                if health.check(self.channel, SERVICE_NAME, timeout=max(0.05, min(1.0, left))) == health.SERVING:
                    return True
            except grpc.RpcError:  # not up yet, or still starting
                pass
            if time.monotonic() + 0.1 >= deadline:
                return False
            time.sleep(0.1)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ----------------------------------------------------------------- CLI
def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "client",
        help="stream a completion from a running server",
        description="Stream a completion from a running `picovllm serve` (greedy unless --temperature is given), "
        "or with --wait-ready alone, wait until the server is ready.",
    )
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text (may be left out with --wait-ready)")
    p.add_argument(
        "--addr", default=None, help=f"scheduler address (default: $PICOVLLM_SCHEDULER_ADDR, else {DEFAULT_ADDRESS})"
    )
    p.add_argument("--timeout", type=float, default=None, help="deadline of the completion in seconds (default: none)")
    p.add_argument(
        "--tls-ca",
        default=None,
        metavar="FILE",
        help="PEM file of the CA (or self-signed certificate) to trust: talk TLS to the scheduler (default: plaintext)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help=f"a file holding the API key (default: ${API_KEY_ENV}, else none; never on the command line)",
    )
    p.add_argument(
        "--wait-ready",
        type=float,
        default=None,
        metavar="SECONDS",
        help="first wait up to SECONDS for the scheduler's health to say SERVING; exit 1 if it does not "
        "(default: no wait, fail at once when the server is not up)",
    )
    add_log_flags(p)
    add_sampling_flags(p)
    p.set_defaults(func=cmd_client)


def cmd_client(args: argparse.Namespace) -> int:
    if args.prompt is None and args.wait_ready is None:
        raise UsageError("client: a prompt is required (or --wait-ready SECONDS alone)")
    if args.wait_ready is not None:
        with _client(args) as client:
            if not client.wait_ready(args.wait_ready):
                print(
                    f"picovllm: error: the scheduler at {client.address} is not ready after {args.wait_ready:g} s",
                    file=sys.stderr,
                )
                return 1
        if args.prompt is None:
            return 0
    return _complete(args)


def _complete(args: argparse.Namespace) -> int:
    sampling = sampling_kwargs(args)
    out = sys.stdout
    last = None
    with _client(args, args.timeout) as client:
        try:
            for msg in client.generate(args.prompt, **sampling):
                out.write((args.prompt if last is None else "") + msg.text)  # the prompt once the server answers
                out.flush()
                last = msg
        except grpc.RpcError as err:
            if last is not None:
                out.write("\n")
                out.flush()
            print(f"picovllm: error: {_describe(err, client.address, last is None)}", file=sys.stderr)
            return 1
    out.write("\n")
    if args.verbose and last is not None:
        reason = pb.FinishReason.Name(last.finish_reason)
        print(f"[{last.usage.completion_tokens} tokens, {reason}]", file=sys.stderr)
    return 0


def _client(args: argparse.Namespace, timeout: float | None = None) -> Client:
    """The CLI's client: the API key from --api-key-file or the environment, TLS with --tls-ca."""
    try:
        return Client(
            args.addr, timeout, api_key=read_secret(API_KEY_ENV, args.api_key_file, check=False), tls_ca=args.tls_ca
        )
    except ValueError as exc:  # an unreadable key file
        raise UsageError(str(exc)) from None
    except OSError as exc:  # the CA file
        raise UsageError(f"cannot read {exc.filename}: {exc.strerror}") from None


def _describe(err: grpc.RpcError, address: str, before_any_answer: bool) -> str:
    if err.code() == grpc.StatusCode.UNAUTHENTICATED:
        return (
            f"the scheduler at {address} refused the credentials: set ${API_KEY_ENV} (or --api-key-file) to its API key"
        )
    if err.code() == grpc.StatusCode.UNAVAILABLE and before_any_answer:
        return (
            f"the scheduler at {address} is unavailable: {err.details()} "
            "(is `picovllm serve` up? --wait-ready SECONDS waits for it)"
        )
    return f"{err.code().name}: {err.details()}"
