from .codec import SGLangCodec
from .worker import SGLangWorker
__all__ = ["SGLangCodec", "SGLangWorker"]
