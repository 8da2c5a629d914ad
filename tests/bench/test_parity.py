"""bench/parity.py's fp32 reference: the margin it gives two candidate tokens is the fp32
logit difference of the 16-bit weights upcast, at the position after the given tokens."""

from __future__ import annotations

import torch

from bench.parity import reference_margins
from contracts.service_config import BUNDLED_MODEL


def test_reference_margins_score_candidates_in_fp32():
    from bench.common import build_runner
    from contracts.step import SeqStep, StepInput
    from scheduler_svc import SamplingParams

    tokens = [1, 403, 261, 378, 363, 285, 288, 7, 90, 11, 300, 2, 41, 17, 250, 199, 77]
    cases = [(tokens, 5, 9), (tokens, 9, 5), (tokens[:6], 100, 100)]
    margins = reference_margins(str(BUNDLED_MODEL), "cpu", "bfloat16", False, cases)
    assert margins[0] == -margins[1] != 0.0 and margins[2] == 0.0

    # the same logits from the bf16 weights upcast by hand and stepped in fp32
    _, plain = build_runner(
        str(BUNDLED_MODEL), "cpu", "bfloat16", num_device_blocks=4, kernel_backend="torch", enforce_eager=True
    )
    model = plain.model.float()
    from model_svc.runner import ModelRunner

    ref = ModelRunner(
        str(BUNDLED_MODEL),
        device="cpu",
        dtype=torch.float32,
        model=model,
        kernel_backend="torch",
        enforce_eager=True,
        num_device_blocks=4,
    )
    seen = []
    orig = ref.model.compute_logits
    ref.model.compute_logits = lambda hidden: seen.append(orig(hidden)) or seen[-1]
    ref.step(StepInput(seqs=[SeqStep("a", tokens, 0, True, 0, [0, 1], SamplingParams(temperature=0), tokens)]))
    logits = seen[-1][-1]
    assert abs((logits[5] - logits[9]).item() - margins[0]) < 1e-5
    assert plain.dtype == torch.bfloat16  # the weights came from a 16-bit model
