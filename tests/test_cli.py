"""`picovllm` as a new user meets it: --version, help that explains every flag and its
default, -v after the subcommand, --model as a Hugging Face repo id from the local cache
(never downloaded), the temperature defaults, and bench commands without matplotlib or
outside a source checkout."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from contracts.service_config import BUNDLED_MODEL
from scheduler_svc.cli import build_parser
from scheduler_svc.cli import main as cli_main
from scheduler_svc.config import EngineConfig, ModelNotFoundError, resolve_model

REPO = Path(__file__).resolve().parents[1]
REPO_ID = "acme/tiny-story"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def run_cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "scheduler_svc.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def hf_cache(tmp_path) -> Path:
    """A Hugging Face hub cache laid out as huggingface_hub writes it, holding the bundled
    model as REPO_ID: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = tmp_path / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(BUNDLED_MODEL, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return tmp_path / "hub"


# ------------------------------------------------------------------ version and help
def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"picovllm \S+", proc.stdout.strip()), proc.stdout


@pytest.mark.parametrize(
    "argv",
    [[], ["generate"], ["serve"], ["client"], ["bench"], ["bench", "experiments"], ["bench", "throughput"]],
    ids=lambda a: " ".join(a) or "picovllm",
)
def test_help_of_every_subcommand(argv):
    proc = run_cli(*argv, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout and "Traceback" not in proc.stderr
    for cited in re.findall(r"[\w./*-]+\.md\b", proc.stdout):  # every file the help points at exists
        assert list(REPO.glob(cited)), f"{' '.join(argv)} --help cites {cited}, which is not in the repository"


def _parsers(parser: argparse.ArgumentParser, prog: str = "picovllm"):
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def test_every_flag_has_help_that_states_its_default():
    seen = 0
    for prog, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            assert action.help and action.help.strip() and action.help != argparse.SUPPRESS, f"{prog} {name}: no help"
            if action.option_strings:
                assert "default" in formatter._get_help_string(action), (
                    f"{prog} {name}: the help does not state the default"
                )
            seen += 1
    assert seen > 60  # every subcommand was walked


def test_serve_help_shows_the_default_ports():
    out = run_cli("serve", "--help").stdout
    for text in ("127.0.0.1:50051", "127.0.0.1:50052", "127.0.0.1:50053", "9400"):
        assert text in out


@pytest.mark.parametrize(
    "argv, verbose, level",
    [
        (["serve", "all"], False, None),
        (["-v", "serve", "all"], True, None),
        (["serve", "all", "-v"], True, None),
        (["serve", "model", "--log-level", "debug"], False, "DEBUG"),
        (["--log-level", "error", "generate", "x"], False, "ERROR"),
        (["client", "x", "--verbose"], True, None),
        (["bench", "experiments", "-v"], True, None),
    ],
)
def test_log_flags_before_or_after_the_subcommand(argv, verbose, level):
    args = build_parser().parse_args(argv)
    assert (args.verbose, args.log_level) == (verbose, level)


# ------------------------------------------------------------------ temperature
def test_temperature_defaults_are_documented():
    from scheduler_svc import SamplingParams

    assert SamplingParams().temperature == 1.0  # vLLM's default, for the API
    for command in ("generate", "client"):
        args = build_parser().parse_args([command, "x"])
        assert args.temperature == 0.0
    out = run_cli("generate", "--help").stdout
    assert "greedy" in out and "1.0" in out


# ------------------------------------------------------------------ --model as a repo id
def test_repo_id_not_in_the_cache_is_one_line(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    for argv in (
        ["generate", "x", "--model", "acme/not-downloaded"],
        ["serve", "model", "--model", "acme/not-downloaded"],
    ):
        proc = run_cli(*argv, env=env)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert "not a local directory and not in the local Hugging Face cache" in lines[0]
        assert "never downloads" in lines[0] and "hf download acme/not-downloaded" in lines[0]


def test_a_path_that_is_no_repo_id_says_directory_not_found():
    with pytest.raises(ModelNotFoundError, match="model directory not found: ./no/such/dir"):
        resolve_model("./no/such/dir")


def test_repo_id_in_the_cache_resolves_offline(hf_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_cache))
    snapshot = hf_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert Path(resolve_model(REPO_ID)) == snapshot
    assert Path(EngineConfig(model=REPO_ID).model) == snapshot  # LLM() and generate go through EngineConfig


def test_generate_with_a_cached_repo_id(hf_cache):
    proc = run_cli(
        "generate",
        "Once upon a time",
        "--model",
        REPO_ID,
        "--max-tokens",
        "8",
        "--device",
        "cpu",
        env={"HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon a time, there was a little girl")


# ------------------------------------------------------------------ other one-line errors
def test_client_without_a_prompt_is_one_line():
    proc = run_cli("client")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "prompt" in proc.stderr


def test_bench_experiments_without_matplotlib_fails_before_any_work(tmp_path, monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a)
    )
    out = tmp_path / "report"
    assert cli_main(["bench", "experiments", "--out", str(out), "--only", "memory"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matplotlib" in err[0] and "pip install -e .[bench]" in err[0]
    assert not out.exists()


@pytest.mark.parametrize("argv", [["bench", "experiments"], ["bench", "throughput"]])
def test_bench_outside_a_source_checkout_is_one_line(argv, tmp_path, monkeypatch, capsys):
    """An installed copy has no bench/ folder: its parser still builds (the experiments' flags
    live in bench_cli) and a bench command says what it needs."""
    from scheduler_svc import bench_cli

    monkeypatch.setattr(bench_cli, "BENCH_DIR", tmp_path / "bench")
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a source checkout" in err[0]
