"""``python -m streamproc.edge`` runs ``streamproc edge``."""

import sys

from .command import main

sys.exit(main())
