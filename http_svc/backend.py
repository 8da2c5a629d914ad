"""The gateway's side of the scheduler: one grpc.aio channel (its requests on one stream,
http_svc.multiplex), the model it serves, the tokenizer.

The gateway is ready once the scheduler has answered GetModelInfo and the tokenizer has
loaded; until then every API call gets 503. Both are fetched in the background from start-up
on, so the HTTP port answers (503, /health) while the scheduler is still starting.

The tokenizer is the scheduler's (the same directory: scheduler.tokenizer, else the model);
the gateway uses it only to render chat templates into token ids and to spell out the tokens
of logprobs. Counts come from the scheduler's usage.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import grpc

from contracts import health as grpc_health
from contracts.auth import call_metadata
from contracts.tokenizer import Tokenizer, load_tokenizer
from http_svc.multiplex import Multiplexer
from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
from protos.picovllm.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# A restarted scheduler is noticed within about a second (gRPC's reconnect backoff otherwise
# grows to two minutes, and every call meanwhile fails at once with UNAVAILABLE).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 << 20),
]
_RETRY_S = 0.5


class ChatTokenizer:
    """The scheduler's tokenizer (contracts.tokenizer), used for chat templates and token
    strings only. The render pool's threads share it: encoding changes no state in it
    (transformers' tokenizer, used before, set its truncation on every call)."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template or tokenizer.chat_template
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: dict[str, Any] | None
    ) -> list[int]:
        """The prompt's token ids: the template renders text, which is tokenized without
        special tokens of its own (the template already wrote them), as vLLM does."""
        # transformers' own renderer (its sandbox, filters and globals), as its apply_chat_template
        # calls it: the named special tokens are template variables, the request's kwargs win.
        from transformers.utils.chat_template_utils import render_jinja_template

        # transformers annotates it `-> str`, but it returns (rendered, generation indices).
        rendered, _ = render_jinja_template(  # type: ignore[str-unpack]
            [messages],
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **{**self.tokenizer.special_tokens, **(kwargs or {})},
        )
        return self.tokenizer.encode(rendered[0], add_special_tokens=False)

    def _token_text(self, token_id: int) -> str:
        """The token as text. A SentencePiece token's leading space (U+2581) is kept: decoding
        it alone would drop it, as at the start of a text."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        return (
            " " + text if isinstance(piece, str) and piece.startswith("\u2581") and not text.startswith(" ") else text
        )


def load_chat_tokenizer(directory: str, chat_template_file: str | None) -> ChatTokenizer:
    template = Path(chat_template_file).read_text() if chat_template_file else None
    return ChatTokenizer(load_tokenizer(directory), template)


@dataclass(frozen=True, slots=True)
class Serving:
    """What the endpoints read of a ready backend."""

    model_name: str
    max_model_len: int
    tokenizer: ChatTokenizer


class SchedulerBackend:
    def __init__(
        self,
        address: str,
        api_key: str | None,
        tokenizer_dir: str,
        *,
        served_model_name: str | None = None,
        chat_template_file: str | None = None,
        root_certificates: bytes | None = None,
    ) -> None:
        self.address = address
        self.metadata = call_metadata(api_key)
        self.tokenizer_dir, self.chat_template_file = tokenizer_dir, chat_template_file
        self.served_model_name = served_model_name
        self.root_certificates = root_certificates
        self.info: pb.GetModelInfoResponse | None = None
        self.tokenizer: ChatTokenizer | None = None
        self.created = int(time.time())
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.SchedulerServiceStub | None = None
        self._tasks: list[asyncio.Task] = []
        self._mux: Multiplexer | None = None
        self.failed: BaseException | None = None  # the tokenizer could not load: the server stops
        # Chat templates render here, off the event loop, one at a time.
        self.render_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chat-template")

    @property
    def model_name(self) -> str | None:
        if self.served_model_name:
            return self.served_model_name
        return os.path.basename(self.info.model.rstrip("/")) if self.info is not None else None

    @property
    def ready(self) -> bool:
        return self.info is not None and self.tokenizer is not None

    def serving(self) -> Serving | None:
        """The model facts and tokenizer once ready; None while starting."""
        name = self.model_name
        if self.info is None or self.tokenizer is None or name is None:
            return None
        return Serving(name, self.info.max_model_len, self.tokenizer)

    async def start(self) -> None:
        """Open the channel; fetch the model info and load the tokenizer in the background."""
        if self.root_certificates is not None:
            self.channel = grpc.aio.secure_channel(
                self.address, grpc.ssl_channel_credentials(self.root_certificates), CHANNEL_OPTIONS
            )
        else:
            self.channel = grpc.aio.insecure_channel(self.address, CHANNEL_OPTIONS)
        self.stub = pb_grpc.SchedulerServiceStub(self.channel)
        self._tasks = [asyncio.ensure_future(self._load_tokenizer()), asyncio.ensure_future(self._fetch_info())]

    async def _load_tokenizer(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            tokenizer = await loop.run_in_executor(
                self.render_pool, load_chat_tokenizer, self.tokenizer_dir, self.chat_template_file
            )
        except Exception as exc:  # noqa: BLE001 - a missing or unreadable file: said once, then the server stops
            self.failed = exc
            raise
        self.tokenizer = tokenizer
        logger.info(
            "tokenizer loaded from %s (chat template: %s)",
            self.tokenizer_dir,
            "yes" if tokenizer.chat_template else "none",
        )

    async def _fetch_info(self) -> None:
        assert self.stub is not None
        while self.info is None:
            try:
                self.info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=2.0, metadata=self.metadata)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                    logger.error("the scheduler refused the gateway's API key: give both the same PICOVLLM_API_KEY")
                await asyncio.sleep(_RETRY_S)
        logger.info("the scheduler serves %s (max_model_len %d)", self.info.model, self.info.max_model_len)

    async def wait_ready(self) -> None:
        """Returns once ready; raises what stopped the tokenizer from loading."""
        await asyncio.gather(*self._tasks)

    async def scheduler_serving(self, timeout: float = 1.0) -> bool:
        """Whether the scheduler's grpc.health.v1 says SERVING."""
        assert self.channel is not None
        check = self.channel.unary_unary(
            f"/{grpc_health.SERVICE_NAME}/Check",
            request_serializer=grpc_health.HealthCheckRequest.SerializeToString,
            response_deserializer=grpc_health.HealthCheckResponse.FromString,
        )
        try:
            reply = await check(grpc_health.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
        return reply.status == grpc_health.SERVING

    def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """The scheduler's messages for one request, on the gateway's one GenerateStream
        (http_svc.multiplex); leaving the loop early (an error, a client that went away) drops
        the request, and the scheduler aborts it."""
        assert self.stub is not None
        if self._mux is None or self._mux.broken:
            self._mux = Multiplexer(self.stub, self.metadata)
        return self._mux.generate(request)

    async def close(self) -> None:
        if self._mux is not None:
            await self._mux.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.channel is not None:
            await self.channel.close()
        self.render_pool.shutdown(wait=False)
