"""Engine adapters. Adding an engine = one module with a Backend subclass + one line in REGISTRY."""
from .base import Backend
from .hf import HFBackend
from .llamacpp import LlamaCppBackend
from .ollama import OllamaBackend
from .openai import OpenAIBackend
from .tgi import TGIBackend
from .vllm import VLLMBackend

REGISTRY: dict[str, type[Backend]] = {cls.engine: cls for cls in (HFBackend, VLLMBackend, LlamaCppBackend, TGIBackend,
                                                                   OllamaBackend, OpenAIBackend)}


def gguf_converter(log=print):
    """What makes the HF-format copy of a GGUF (for the engines that read safetensors): transformers, in the
    hf engine's environment."""
    return HFBackend.gguf_converter(log)
