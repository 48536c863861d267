"""specbatch: speculative decoding inside continuous batching over a paged KV cache."""

from specbatch.config import EngineArgs
from specbatch.engine.llm import LLM
from specbatch.engine.llm_engine import LLMEngine
from specbatch.errors import EngineError, InvalidInputError
from specbatch.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specbatch.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "EngineError",
    "InvalidInputError",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
