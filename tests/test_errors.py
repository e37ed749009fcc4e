"""One home and one base class for every exception streamproc raises on purpose."""

import importlib
import inspect
import pkgutil

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
