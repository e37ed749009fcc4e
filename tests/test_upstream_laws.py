"""The property laws again, with the simulator rendering upstream-shaped SGLang bodies.

The default simulator streams incrementally with int32 rows and prompt logprobs; these runs cover
SGLang's default cumulative streaming (with the matching ``streaming`` codec option), uint16 rows
advertised in ``meta_info`` and empty logprob windows, end to end through the correlator. The
incremental run renders SGLang 0.5.23's bodies (``num_retractions``, ``weight_versions``, decode's
reserved ``null`` token-ids-logprob row, flat prompt top logprobs); the cumulative run the older ones.
"""

from streamproc.codec import CodecOptions
from streamproc.testing.laws import CodecLaws
from streamproc_sglang import SGLangWorker
from streamproc_sglang.upstream import Shape

LIMIT = CodecLaws.options.max_decompressed_bytes


class TestSGLangIncrementalUint16Laws(CodecLaws):
    codec_name = "sglang"
    worker = SGLangWorker(CodecLaws.options, shape=Shape(streaming="incremental", dtype="uint16",
                                                          advertise_dtype=True, logprob_start_len=0,
                                                          version="0.5.23", top_logprobs="flat",
                                                          token_ids_logprob=True))


class TestSGLangCumulativeLaws(CodecLaws):
    codec_name = "sglang"
    options = CodecOptions(max_decompressed_bytes=LIMIT, format_options=(("streaming", "cumulative"),))
    worker = SGLangWorker(options, shape=Shape(streaming="cumulative", logprob_start_len=-1))
