"""The public API: what ``streamproc.__all__`` promises, and the old paths codec authors import."""

import subprocess
import sys

import streamproc


def test_every_name_in_all_resolves():
    missing = [name for name in streamproc.__all__ if getattr(streamproc, name, None) is None]
    assert missing == []


def test_importing_streamproc_imports_no_io_library_until_a_shell_name_is_used():
    code = ("import sys, streamproc; from streamproc import Correlator, Chunk, Codec;"
            "print(sorted(m for m in ('nats', 'anyio', 'starlette', 'uvicorn') if m in sys.modules));"
            "streamproc.Processor;"
            "print('nats' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["[]", "True"]


def test_the_import_paths_codec_authors_use_keep_working():
    from streamproc.catalog import Catalog, codec_class, worker_for  # noqa: F401
    from streamproc.codec import Codec, CodecOptions, CorruptPayload, SequenceCodec  # noqa: F401
    from streamproc.correlator import Correlator, CorrelatorConfig  # noqa: F401
    from streamproc.decompress import decode_base64, encode_base64  # noqa: F401
    from streamproc.simulation import SimulatedWorker, Truth  # noqa: F401
    from streamproc.testing.harness import leg, run_pipeline  # noqa: F401
    from streamproc.testing.laws import CodecLaws  # noqa: F401
    from streamproc.wire import Chunk, Result, Role, Verdict  # noqa: F401
    import streamproc.codec
    import streamproc.core.codec

    assert streamproc.codec is streamproc.core.codec  # the same module, not a copy
    assert Codec is streamproc.Codec
