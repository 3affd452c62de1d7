"""Chat models for workflows: an OpenAI-compatible endpoint, or the simulated model.

The OpenAI-compatible implementation lives in :mod:`moorline.llm.openai_compat`, imported only
when an endpoint is configured, so that the simulated default needs no ``openai`` package.
"""

from moorline.llm.base import (
    LLM,
    SIMULATED_MODEL,
    LLMError,
    LLMMisconfigured,
    LLMRejected,
    LLMTimeout,
    LLMUnavailable,
    Message,
    Reply,
    Role,
    Tool,
    ToolCall,
)
from moorline.llm.factory import LazyLLM, make_llm
from moorline.llm.simulated import SimulatedLLM
from moorline.llm.streaming import DELTA_EVENT, Emit, complete

__all__ = [
    "DELTA_EVENT",
    "LLM",
    "SIMULATED_MODEL",
    "Emit",
    "LLMError",
    "LLMMisconfigured",
    "LLMRejected",
    "LLMTimeout",
    "LLMUnavailable",
    "LazyLLM",
    "Message",
    "Reply",
    "Role",
    "SimulatedLLM",
    "Tool",
    "ToolCall",
    "complete",
    "make_llm",
]
