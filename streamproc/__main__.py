"""``python -m streamproc`` runs the ``streamproc`` command (``streamproc.cli``)."""

import sys

from .cli import main

sys.exit(main())
