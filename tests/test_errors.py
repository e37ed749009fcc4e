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
