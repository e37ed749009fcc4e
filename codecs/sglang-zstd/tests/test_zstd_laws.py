"""The streamproc property laws (all seven), inherited unchanged and run with the compressing worker."""

from __future__ import annotations

from streamproc.testing.laws import CodecLaws
from streamproc_sglang_zstd import SGLangZstdWorker


class TestSGLangZstdLaws(CodecLaws):
    codec_name = "sglang-zstd"
    # Sized from the laws' limit so Damage.BOMB decompresses past exactly the limit under test.
    worker = SGLangZstdWorker(CodecLaws.options)
