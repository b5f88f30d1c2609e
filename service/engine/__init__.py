"""hybrid-serve engine: NemotronH on our own torch/Triton engine. Knows neither Ray nor HTTP."""

from service.engine.async_engine import AsyncEngine
from service.engine.config import EngineConfig, ModelConfig
from service.engine.engine import Engine
from service.engine.request import FinishReason, RequestOutput, SamplingParams

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "FinishReason", "ModelConfig", "RequestOutput", "SamplingParams"]
