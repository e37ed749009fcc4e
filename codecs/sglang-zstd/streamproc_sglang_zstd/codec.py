"""The ``sglang-zstd`` codec: everything from ``sglang`` except the ``routed_experts`` encoding.

Aggregated bodies never reach a codec, so the worker's compressed value passes through byte for
byte; only a P/D join decompresses both legs, splices the rows and recompresses the result.
"""

from __future__ import annotations

from typing import ClassVar, Mapping

from streamproc.codec import SequenceCodec
from streamproc_sglang import SGLangCodec
from streamproc_sglang.native import ROUTED_EXPERTS

from .sequence import LEVEL_OPTION, SPLICE_OPTION, THREADS_OPTION, Base64ZstdRows


class SGLangZstdCodec(SGLangCodec):
    name = "sglang-zstd"
    description = "SGLang native /generate; meta_info.routed_experts = Base64(zstd(raw int32 rows))"
    sequence_codecs: ClassVar[Mapping[str, type[SequenceCodec]]] = {
        **SGLangCodec.sequence_codecs,
        ROUTED_EXPERTS: Base64ZstdRows,
    }
    option_keys: ClassVar[frozenset[str] | None] = SGLangCodec.option_keys | {LEVEL_OPTION, THREADS_OPTION, SPLICE_OPTION}
