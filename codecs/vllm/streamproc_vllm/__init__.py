from .codec import VLLMCodec
from .worker import VLLMWorker
__all__ = ["VLLMCodec", "VLLMWorker"]
