"""Scheduler service: requests, policy, streaming and the public API.

from scheduler_svc import LLM, SamplingParams
LLM().generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40))
"""

from contracts.sampling_params import SamplingParams
from scheduler_svc.outputs import CompletionOutput, RequestOutput

__all__ = ["AsyncLLM", "CompletionOutput", "EngineConfig", "LLM", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # The engine pulls in torch; keep `import scheduler_svc` light for the CLI and clients.
    if name in ("LLM", "AsyncLLM"):
        from scheduler_svc import llm

        return getattr(llm, name)
    if name == "LLMEngine":
        from scheduler_svc.engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from scheduler_svc.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
