"""prefixgate's paged-KV inference engine with radix prefix caching.

    from engine import Engine, EngineConfig, SamplingParams
    eng = Engine(EngineConfig())
    outs = eng.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
"""

from engine.async_engine import AsyncEngine, RequestError
from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.outputs import EngineStats, RequestOutput, StreamDelta
from engine.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "StreamDelta",
]
