"""``--mode durable``: chunks read from a JetStream stream through per-partition pull consumers,
results published to the results stream before the chunks that made them are acknowledged.

:class:`~streamproc.nats.durable.input.DurableInput` wires the modules here: the partitions this
instance owns (``partitions``, taken through ``leases``), their pulls (``pulls``) and message
handlers (``deliveries``), requests adopted from the stores and the durable migrate (``recovery``,
``migrations``), the I/O around the pure outbox (``outbox_pump``) and the stray-chunk sweeper
(``strays``). The decisions are the pure core's (``streamproc.core``: correlator, outbox, credit,
handback, lookups); nothing here decides what a result is.
"""
