"""Secrets and their checks without processes: where a secret is read from, what is refused,
what the token interceptor lets through, what a public caller is told, and what `serve all`
hands its children (docs/SECURITY.md)."""

from __future__ import annotations

import argparse

import grpc
import pytest

from contracts.auth import (
    Credentials,
    SecretError,
    TokenAuthInterceptor,
    call_metadata,
    mask_url,
    read_secret,
    url_has_credentials,
)
from contracts.errors import InvalidArgument, Unavailable, public_message
from contracts.service_config import ServiceConfig, load_config
from scheduler_svc.serve_cli import _addresses, child_argv, child_env

TOKEN = "a-token-of-enough-length"


def test_read_secret_from_env_file_or_flag(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert read_secret("X", env={}) is None
    assert read_secret("X", env={"X": f"  {TOKEN} "}) == TOKEN
    assert read_secret("X", env={"X_FILE": str(path)}) == TOKEN  # the trailing newline dropped
    assert read_secret("X", str(path), env={"X": "another-token-of-length"}) == TOKEN  # the flag wins
    with pytest.raises(SecretError, match="both"):
        read_secret("X", env={"X": TOKEN, "X_FILE": str(path)})
    with pytest.raises(SecretError, match="shorter than 16"):
        read_secret("X", env={"X": "short"})
    with pytest.raises(SecretError, match="printable"):
        read_secret("X", env={"X": "with a space inside it"})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SecretError, match="empty"):
        read_secret("X", str(tmp_path / "empty"), env={})
    with pytest.raises(SecretError, match="cannot read") as err:
        read_secret("X", str(tmp_path / "missing"), env={})
    assert TOKEN not in str(err.value)


def test_urls_are_masked():
    assert mask_url("redis://:hunter2secret@10.0.0.5:6379/0") == "redis://***@10.0.0.5:6379/0"
    assert mask_url("rediss://user:pw@h:1/0") == "rediss://***@h:1/0"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert (
        url_has_credentials("redis://:pw@h:1/0")
        and not url_has_credentials("redis://h:1/0")
        and not url_has_credentials(None)
    )
    with pytest.raises(ValueError) as err:
        load_config(env={"PICOVLLM_REDIS_URL": "http://:hunter2secret@h:1/0"})
    assert "hunter2secret" not in str(err.value)
    config = load_config(env={"PICOVLLM_REDIS_URL": "redis://:hunter2secret@h:1/0"})
    assert "hunter2secret" not in repr(config)


def test_redis_url_from_a_file(tmp_path):
    path = tmp_path / "url"
    path.write_text("redis://:pw@h:1/0\n")
    assert load_config(env={"PICOVLLM_REDIS_URL_FILE": str(path)}).kvcache.redis_url == "redis://:pw@h:1/0"


def test_interceptor_lets_through_the_token_health_and_reflection_only():
    check = TokenAuthInterceptor(TOKEN).allowed
    step = "/picovllm.model.v1.ModelService/Step"
    assert check(step, (("authorization", f"Bearer {TOKEN}"),))
    assert check(step, (("authorization", f"bearer {TOKEN}"),))
    assert check(step, (("x-picovllm-token", TOKEN),))
    assert check(step, (("user-agent", "x"), ("authorization", "Bearer wrong"), ("x-picovllm-token", TOKEN)))
    for metadata in (
        None,
        (),
        (("authorization", TOKEN),),
        (("authorization", f"Bearer {TOKEN}x"),),
        (("x-other", TOKEN),),
    ):
        assert not check(step, metadata)
    assert check("/grpc.health.v1.Health/Check", None)
    assert check("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", None)
    assert call_metadata(None) is None and call_metadata("") is None


def test_public_callers_are_told_no_internal_detail():
    down = Unavailable(
        "kvcache 10.1.2.3:50052 ApplyStep: UNAVAILABLE: metadata store unavailable: Error 111 connecting"
    )
    assert (
        public_message(down, grpc.StatusCode.UNAVAILABLE) == "the service is temporarily unavailable; try again later"
    )
    assert "10.1.2.3" not in public_message(RuntimeError("at 10.1.2.3:50053"), grpc.StatusCode.INTERNAL)
    bad = InvalidArgument("prompt too long for model at kvcache:50052")
    assert public_message(bad, grpc.StatusCode.INVALID_ARGUMENT) == "prompt too long for model at <internal>"

    class Draining(Unavailable):
        public = True

    assert (
        public_message(Draining("the server is shutting down"), grpc.StatusCode.UNAVAILABLE)
        == "the server is shutting down"
    )


def test_every_default_listener_is_loopback():
    addresses = _addresses(ServiceConfig())
    assert set(addresses) == {"scheduler", "kvcache", "model", "metrics", "http"}
    assert all(a.rpartition(":")[0] == "127.0.0.1" for a in addresses.values()), addresses


def _args(**kw) -> argparse.Namespace:
    from scheduler_svc.serve_cli import FLAGS

    values = {flag[2:].replace("-", "_"): None for flag in FLAGS}
    values.update(
        verbose=False,
        log_level=None,
        config=None,
        no_prefix_caching=False,
        async_scheduling=None,
        insecure_no_auth=False,
        publish_prefixes=False,
    )
    values.update(kw)
    return argparse.Namespace(**values)


def test_serve_all_hands_secrets_by_environment_only(monkeypatch):
    url = "redis://:hunter2secret@127.0.0.1:6379/0"
    for var in ("PICOVLLM_REDIS_URL_FILE", "PICOVLLM_API_KEY", "PICOVLLM_LISTEN"):
        monkeypatch.setenv(var, "from-the-parent-environment")
    config = load_config(env={"PICOVLLM_REDIS_URL": url})
    creds = Credentials(TOKEN, "an-api-key-of-enough-length")
    envs = {kind: child_env(kind, config, creds) for kind in ("kvcache", "model", "scheduler", "http")}
    assert {e.get("PICOVLLM_INTERNAL_TOKEN") for e in envs.values()} == {TOKEN, None}
    assert "PICOVLLM_INTERNAL_TOKEN" not in envs["http"]  # the gateway calls the public API only
    assert envs["kvcache"]["PICOVLLM_REDIS_URL"] == url
    assert not any("PICOVLLM_REDIS_URL" in envs[k] for k in ("model", "scheduler", "http"))
    assert envs["scheduler"]["PICOVLLM_API_KEY"] == envs["http"]["PICOVLLM_API_KEY"] == creds.api_key
    assert "PICOVLLM_API_KEY" not in envs["kvcache"] and "PICOVLLM_API_KEY" not in envs["model"]
    assert not any("PICOVLLM_REDIS_URL_FILE" in e or "PICOVLLM_LISTEN" in e for e in envs.values())
    argv = " ".join(child_argv(_args(redis_url="redis://127.0.0.1:6379/0", insecure_no_auth=True), "kvcache"))
    assert "--redis-url" not in argv and "--insecure-no-auth" in argv
    assert "hunter2secret" not in repr(creds) and TOKEN not in repr(creds)
