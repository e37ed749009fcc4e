"""streamproc codec ``sglang-zstd``: SGLang native bodies with zstd-compressed routed experts."""

from .codec import SGLangZstdCodec
from .sequence import Base64ZstdRows
from .worker import SGLangZstdWorker, zstd_bomb

__all__ = ["Base64ZstdRows", "SGLangZstdCodec", "SGLangZstdWorker", "zstd_bomb"]
