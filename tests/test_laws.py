"""Every built-in codec runs the inherited property laws (512 examples each; sglang-zstd runs them in its own
distribution's tests), and law 7 is shown to catch a migration session that is not a function of
the published bodies."""

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from streamproc.codec import Emitted
from streamproc.testing.laws import CodecLaws, law_settings
from streamproc.testing.strategies import truths
from streamproc_sglang import SGLangCodec, SGLangWorker
from streamproc_sglang.migration import SGLangMigrationSession


class TestSGLangLaws(CodecLaws):
    codec_name = "sglang"
    # Sized from the laws' limit so Damage.BOMB exceeds exactly the limit under test.
    worker = SGLangWorker(CodecLaws.options)


class TestVLLMLaws(CodecLaws):
    codec_name = "vllm"


class StitchCountingSession(SGLangMigrationSession):
    """SGLang's session, but its seal also tells the resume hook how many bodies it stitched: a
    count of calls, not something the published bodies say, so a session rebuilt from the stored
    bodies (which stitches nothing for them) seals a different state. Every body it publishes is
    still right, so the uninterrupted-stream law (6) cannot see it."""

    def __init__(self, codec: SGLangCodec) -> None:
        super().__init__(codec)
        self.stitched = 0

    def stitch(self, body: bytes, final: bool):
        self.stitched += 1
        return super().stitch(body, final)

    def seal(self) -> Emitted:
        emitted = super().seal()
        return Emitted(emitted.token_ids, {**emitted.state, "stitched": self.stitched})


class StitchCountingCodec(SGLangCodec):
    def open_migration(self) -> StitchCountingSession:
        return StitchCountingSession(self)


class StitchCountingLaws(CodecLaws):  # not collected: only the test below runs its laws
    codec_name = "sglang"
    codec_class = StitchCountingCodec
    worker = SGLangWorker(CodecLaws.options)


# 512 examples whatever STREAMPROC_LAW_EXAMPLES says, no example database (the toy is caught from
# scratch) and no shrinking (only that it is caught matters here).
@settings(law_settings, max_examples=512, database=None, phases=(Phase.explicit, Phase.generate))
@given(truth=truths(), stream=st.booleans(), data=st.data())
def law7_of_the_stitch_counting_codec(truth, stream, data):
    StitchCountingLaws().check_law7(truth, stream, data)


def test_law7_fails_for_a_migration_session_that_depends_on_more_than_the_published_bodies():
    StitchCountingLaws().test_law6_interrupted_and_resumed_requests_give_the_uninterrupted_stream()  # bodies right
    with pytest.raises(AssertionError, match="the heir sealed .*'stitched': .*the live processor .*'stitched': "):
        law7_of_the_stitch_counting_codec()
