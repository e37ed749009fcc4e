"""The distribution plugs into streamproc through entry points alone and inherits the SGLang codec."""

from __future__ import annotations

from importlib.metadata import entry_points

from streamproc.catalog import Catalog, codec_class, codec_names, describe, worker_for
from streamproc.codec import CodecOptions
from streamproc_sglang import SGLangCodec, SGLangWorker
from streamproc_sglang_zstd import Base64ZstdRows, SGLangZstdCodec, SGLangZstdWorker


def test_entry_points_register_the_codec_and_its_simulated_worker():
    codecs = {ep.name: ep.value for ep in entry_points(group="streamproc.codecs")}
    workers = {ep.name: ep.value for ep in entry_points(group="streamproc.workers")}
    assert codecs["sglang-zstd"] == "streamproc_sglang_zstd:SGLangZstdCodec"
    assert workers["sglang-zstd"] == "streamproc_sglang_zstd:SGLangZstdWorker"
    assert "sglang-zstd" in codec_names()
    assert codec_class("sglang-zstd") is SGLangZstdCodec
    assert type(worker_for("sglang-zstd")) is SGLangZstdWorker
    assert ("sglang-zstd", "streamproc-sglang-zstd", SGLangZstdCodec.description) in describe()


def test_only_the_routed_experts_encoding_is_overridden():
    assert issubclass(SGLangZstdCodec, SGLangCodec) and issubclass(SGLangZstdWorker, SGLangWorker)
    base, ours = SGLangCodec.sequence_codecs, SGLangZstdCodec.sequence_codecs
    overridden = {field for field, cls in ours.items() if base[field] is not cls}
    assert overridden == {"routed_experts"}
    own = {k for k in vars(SGLangZstdCodec) if not k.startswith("_")}
    assert own == {"name", "description", "sequence_codecs", "option_keys"}
    # the option keys it reads: the sglang codec's, plus its encoding's (sequence.py)
    assert SGLangZstdCodec.option_keys == SGLangCodec.option_keys | {"zstd_level", "zstd_threads", "zstd_splice"}
    codec = Catalog(CodecOptions(max_decompressed_bytes=1234))("sglang-zstd")
    assert isinstance(codec.sequences["routed_experts"], Base64ZstdRows)
    assert codec.sequences["routed_experts"].options.max_decompressed_bytes == 1234
