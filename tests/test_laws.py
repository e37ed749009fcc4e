"""Every built-in codec runs the inherited property laws (512 examples each; sglang-zstd runs them in its own
distribution's tests)."""

from streamproc.testing.laws import CodecLaws
from streamproc_sglang import SGLangWorker


class TestSGLangLaws(CodecLaws):
    codec_name = "sglang"
    # Sized from the laws' limit so Damage.BOMB exceeds exactly the limit under test.
    worker = SGLangWorker(CodecLaws.options)


class TestVLLMLaws(CodecLaws):
    codec_name = "vllm"
