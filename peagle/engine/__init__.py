"""The speculative decoding engine."""
from peagle.engine.engine import LLMEngine
from peagle.engine.errors import RequestError
from peagle.engine.request import RequestOutput
from peagle.engine.sampling import SamplingParams
from peagle.engine.stats import SpecDecodeStats

__all__ = ["LLMEngine", "RequestError", "RequestOutput", "SamplingParams", "SpecDecodeStats"]
