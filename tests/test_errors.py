"""One home and one base class for every exception streamproc raises on purpose."""

import importlib
import inspect
import json
import pkgutil

import msgspec
import pytest

import streamproc
from streamproc.core import errors
from streamproc.core.errors import StreamprocError


def _modules():
    for info in pkgutil.walk_packages(streamproc.__path__, "streamproc."):
        if info.name.endswith(".__main__"):
            continue  # runs the command when imported
        yield importlib.import_module(info.name)


def test_every_exception_class_in_streamproc_is_defined_in_core_errors_under_one_base():
    defined_elsewhere = []
    for module in _modules():
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.startswith("streamproc"):
                if obj.__module__ != errors.__name__:
                    defined_elsewhere.append(f"{obj.__module__}.{name}")
                assert issubclass(obj, StreamprocError), f"{obj.__module__}.{name} is not a StreamprocError"
    assert defined_elsewhere == []


def test_errors_keep_the_builtin_bases_existing_except_clauses_rely_on():
    assert issubclass(errors.ContractError, ValueError)
    assert issubclass(errors.CorruptPayload, ValueError)
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.UnknownFormat, LookupError)
    assert issubclass(errors.StartupError, RuntimeError)
    assert issubclass(errors.ResultsStreamMismatch, errors.StreamMismatch)


def test_no_streamproc_error_is_an_oserror_so_network_retries_do_not_retry_a_refusal():
    """Code that retries a network failure catches ``OSError`` (``ConnectionError``, ``TimeoutError``
    and ``PermissionError`` are all OSErrors). ``ReplayRefused`` was a ``PermissionError``: such a
    loop retried a missing grant or import, which no retry fixes. The refusals are RuntimeErrors,
    as ``PublishRefused`` and ``StoredResultsRefused`` were."""
    oserrors = [name for name, obj in vars(errors).items()
                if inspect.isclass(obj) and issubclass(obj, StreamprocError) and issubclass(obj, OSError)]
    assert oserrors == []
    for refusal in (errors.ReplayRefused, errors.PublishRefused, errors.StoredResultsRefused):
        assert issubclass(refusal, RuntimeError), refusal


HOSTILE_TEXTS = {
    "control": "\x01" * 5000,  # \u0001: 6 bytes as JSON each
    "astral": "\U0001F600" * 5000,  # 4 bytes of UTF-8, a 12-byte surrogate pair escape
    "latin": "\u00e9" * 5000,
    "quotes": '"\\' * 3000,
    "surrogate": "ab\ud800c" * 300,  # no UTF-8 encoder takes a lone surrogate
    "mixed": ("x\x1f\U000E0001\u2028\"") * 2000,
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEXTS))
def test_a_cut_error_text_fits_its_byte_bound_as_json_under_any_encoder(name):
    """An error result's text is bounded in bytes as a codec writes it (msgspec's UTF-8 or an
    ``ensure_ascii`` encoder's escapes), not in characters: 512 control characters were ~3 KiB and an
    error result over a 2 KiB max_payload. The cut keeps a start of the text on a character boundary
    (valid UTF-8, valid JSON) and says how long the text was."""
    text = HOSTILE_TEXTS[name]
    cut = errors.cut_error_text(text)
    encoders = (msgspec.json.encode, lambda t: json.dumps(t).encode(),
                lambda t: json.dumps(t, ensure_ascii=False).encode())
    for encoded in (encode(cut) for encode in encoders):
        assert len(encoded) - 2 <= errors.MAX_ERROR_TEXT, (name, len(encoded))
        assert json.loads(encoded) == cut
    suffix = f"... ({len(text)} characters)"
    assert cut.endswith(suffix)
    kept = cut[:-len(suffix)]
    assert kept and kept == text[:len(kept)].replace("\ud800", "\ufffd")


def test_an_error_text_within_the_bound_is_kept_whole():
    kept = ("unknown role 'x' (expected agg, prefill or decode)", "é" * 80, "x" * errors.MAX_ERROR_TEXT)
    for text in kept:
        assert errors.cut_error_text(text) == text
