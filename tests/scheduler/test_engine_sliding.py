"""The sliding-window models of the parity tests (tests.scheduler.test_engine_parity's
TINY_MODELS: a Mistral-style all-sliding model and a Qwen3 hybrid) are what they say: the
windows are read, and the same weights without them give other tokens, so the parity there
checks the window."""

from __future__ import annotations

import json
import shutil

import pytest

from scheduler_svc import LLM
from tests.model.tiny_models import make_tiny_hf_model
from tests.scheduler.test_engine_parity import MAX_NEW, SLIDING_WINDOW, TINY_MODELS, _hf_greedy, _mixed_prompts

SLIDING = {"mistral-all-sliding": (SLIDING_WINDOW, SLIDING_WINDOW), "qwen3-hybrid": (0, SLIDING_WINDOW)}


@pytest.mark.parametrize("name", list(SLIDING))
def test_the_window_matters(name, tmp_path):
    family, overrides = TINY_MODELS[name]
    path = make_tiny_hf_model(str(tmp_path), family, **overrides)
    assert LLM(path, num_gpu_blocks=64).engine.model_config.layer_windows == SLIDING[name]
    full = tmp_path / "full"
    shutil.copytree(path, full)
    config = json.loads((full / "config.json").read_text())
    config.pop("layer_types", None)
    config.update(sliding_window=None, use_sliding_window=False)
    (full / "config.json").write_text(json.dumps(config))
    prompts = _mixed_prompts(vocab=512, block_size=16, seed=5)[10:]  # the longer ones
    windowed = [tokens for tokens, _ in _hf_greedy(str(path), prompts, MAX_NEW)]
    assert [tokens for tokens, _ in _hf_greedy(str(full), prompts, MAX_NEW)] != windowed
