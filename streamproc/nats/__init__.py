"""The NATS shell: the only package that imports nats-py. It moves bytes between NATS and the pure
core (:mod:`streamproc.core`), reads the clock, fires timers, acknowledges input and logs."""
