"""Former import path of :mod:`streamproc.core.decoding`, kept so codecs written against it work unchanged.

The name is bound to the very same module object, so ``isinstance`` checks and monkeypatching
see one module, not a copy.
"""

import sys

from .core import decoding as _home

sys.modules[__name__] = _home
