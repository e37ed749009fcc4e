"""The reference SSE edge: results from NATS to HTTP clients and a live page (``streamproc edge``).

The web stack is imported by :mod:`streamproc.edge.app` only, so the CLI can register the
command (:func:`streamproc.edge.command.add_cli`) without loading Starlette.
"""
