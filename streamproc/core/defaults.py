"""Every default that more than one component reads, declared once.

The correlator's bounds, the codecs' byte budget, the streams' retention and the readers'
reorder bound are read from here by :mod:`streamproc.config` (processor and edge settings), the
correlator's and codecs' own option records, and :mod:`streamproc.nats.streams`, so a default can
never differ between the component that applies it and the one that validates against it.
"""

NATS_URL = "nats://127.0.0.1:4222"
PREFIX = "streamproc"  # subject prefix P
FORMAT = "sglang"
# The reply subjects a migrate may name: nats-py's (and every NATS client's) request inboxes. The
# processor publishes its answer there with its own rights, so another reply would let whoever may
# send a migrate publish on subjects only the processor may (results, KV buckets, the JS API).
CONTROL_REPLY_PREFIX = "_INBOX."
# The inbox prefix of the processor's and the edge's own connections (JetStream pull and consumer
# inboxes, PubAck replies, request replies): still under _INBOX.> (the shipped permissions), and a
# migrate naming a reply there is refused, since an answer published into them would be read as a
# pull status or a PubAck (a frontend may subscribe to _INBOX.> and learn those subjects).
OWN_INBOX_PREFIX = "_INBOX.streamproc"
# The edge's own, one token deeper: still never a migrate's reply, and apart from the processor's
# (whose pulls deliver every chunk and whose lookups get stored results), so the shipped permissions
# let the edge subscribe to its own inboxes only.
EDGE_INBOX_PREFIX = OWN_INBOX_PREFIX + ".edge"
# Where a Migrator (client/migration.py) asks for a migrate's reply: a Sealed reply carries the token
# ids a client was sent, so the shipped permissions deny the workers (who may subscribe to _INBOX.>
# for their PubAcks) every inbox under it, and give the frontend these inboxes only. A valid
# migrate reply (under CONTROL_REPLY_PREFIX, not under OWN_INBOX_PREFIX).
FRONTEND_INBOX_PREFIX = "_INBOX.frontend"

# Correlation (seconds, counts)
PREFILL_TIMEOUT = 30.0
REQUEST_TIMEOUT = 300.0
FINISHED_GRACE = 60.0
MAX_INFLIGHT = 10_000
MAX_BUFFERED_CHUNKS = 4096
MAX_FINISHED = 200_000
# Bytes the finished-id table may take, each entry charged FINISHED_ENTRY_BYTES + len(id): an id's
# str, its expiry float and the ordered dict's slot measured 164 bytes + the id on CPython 3.11
# (tracemalloc, 100k entries of 16-256 chars). 200,000 ids of 256 chars took ~78 MiB; the default
# keeps 200,000 uuid-sized ids and ~80,000 of the longest (256 chars).
MAX_FINISHED_BYTES = 32 * 1024 * 1024
FINISHED_ENTRY_BYTES = 164
# Seconds without progress before a request in flight may be ended to admit a new one at
# max_inflight: held requests that send nothing cannot keep newcomers out, and a burst of new
# requests (each progressing within this) does not evict one another.
SHED_MIN_IDLE = 1.0
MAX_RETAINED_BYTES = 256 * 1024
# Memory budgets that hold under attack (docs/operations.md, "limits and abuse"): bytes of buffered
# chunk bodies per request, and buffered bodies + decoded payloads kept by join sessions across all
# requests. Sized so a processor stays under ~200 MiB RSS whatever its clients send.
MAX_BUFFERED_BYTES = 32 * 1024 * 1024
MAX_TOTAL_BYTES = 96 * 1024 * 1024
# CPU seconds the joins of one request that decode sequence data may take (the process's CPU minus
# the event loop's over each join, so zstd's compression threads count; logprob copies are not
# charged): bounds what payloads that inflate can cost. Measured (benchmarks/decode_cpu.py,
# docs/operations.md "limits and abuse", 2-vCPU machine): a legitimate request's expert join with
# legs at max_payload 21.5 ms, one per SGLang request; an inflating join (47 MiB of rows from 2 KB)
# 43 ms, ~690 of them per request at 30 s. 30 s was sized when logprob copies were charged too (one
# expert join + 32,768 chunks with a 4,096-token prompt's logprobs: 8.7-9.4 s on a faster machine);
# it is kept here, a lower default is a separate decision.
MAX_DECODE_CPU = 30.0
# Migrations one request may have (its attempts after the first). Each migrate seals the attempt
# and sends back everything the client was sent (the token ids): one frontend repeating migrates
# of a 96,000-token request cost the processor 11-12 ms of CPU and a 672 KB reply each, unbounded
# (docs/security.md). A worker lost 32 times during one request is past any real failover.
MAX_MIGRATIONS = 32
# Bytes a request holds per migration for its seal list (the result seq where each later attempt
# starts, an array('q') item), charged with its migration progress state to max_buffered_bytes and
# max_total_bytes: at max_migrations 1,000,000, 10,000 requests in flight held ~80 GB of seal lists
# outside every budget (as a list of ints it was 36 bytes a seal: sys.getsizeof, CPython 3.11).
SEAL_BYTES = 8
# What a seal record's seals cost while it is decoded (msgspec builds a list of ints: a pointer
# and an int object each, measured 36 bytes with sys.getsizeof): a record read back from the
# migrations bucket may hold no more seals than fit max_buffered_bytes at this figure, counted
# before the list is built (wire.decode_seal_record), else it is unreadable.
SEAL_DECODED_BYTES = 36
# Migrates answered per second, process-wide, and how many at once (MIGRATE_BURST_SECONDS of the
# rate): past them a migrate is answered ``unavailable`` with a retry_after, untouched
# (core/migrate_rate.py). A failover migrates every request its lost worker served at once (a few
# hundred each), so the burst holds a few such workers; an honest processor sees no more. Without a
# bound, one connection's flood of migrates of made-up ids (about 120,000 a second) kept an honest
# request's one result waiting 6.1 s and the control subscription's queue took the processor to a
# VmHWM of 245 MiB (core mode; docs/operations.md, limits and abuse). 0: no limit.
MIGRATE_RATE = 500.0
MIGRATE_BURST_SECONDS = 4.0
# Migrates waiting in the control subscription's client-side queue, at most (its count and their
# bytes): past them nats-py drops a migrate unanswered (slow_consumer; the Migrator asks again). At
# nats-py's defaults (524,288 messages, 128 MiB) a flood faster than the processor reads (one
# connection sent ~120,000 a second) queued until the processor's VmHWM was 245 MiB. Four bursts of
# the migrate rate fit, with small bodies; a migrate's body is a few hundred bytes unless its free-text
# reason is long.
CONTROL_PENDING_MSGS = 8192
CONTROL_PENDING_BYTES = 16 * 1024 * 1024

# Codecs
# A ceiling, not the working bound: codecs decode at most what a body's token counts allow
# (rows x row width). 512 MiB holds a 128k-token capture of the widest open MoE models at int32
# (Qwen3-235B: 94 layers x top-8 = 394 MB; DeepSeek-V3/Kimi-K2: 61 x 8 = 256 MB).
MAX_DECOMPRESSED_BYTES = 512 * 1024 * 1024

# Streams (JetStream)
RESULTS_MAX_AGE = 3600.0  # seconds a result can still be replayed
CHUNKS_MAX_AGE = 3600.0
DUPLICATE_WINDOW = 120.0  # seconds within which a republished Nats-Msg-Id is dropped

# Durable outbox (settings and the outbox's own config)
MAX_RESULT_ATTEMPTS = 100  # refusals + unanswered sends of one result before it is given up
# Results of one request queued behind a stored one leave together as one nats-server fast batch,
# up to this many (docs/benchmarks.md, "Write-time fast batches"); 1: one PubAck round trip each.
RESULT_BATCH = 64
# Body bytes a batch carries beyond its first result: a PubAck releases at most this much into the
# client's write buffer (half of nats-py's 2 MiB pending limit is the FastClient's backlog mark).
RESULT_BATCH_BYTES = 256 * 1024
# Seconds results go one at a time after the server refused a whole batch (batches turned off on the
# results stream at runtime, or its open-batch slots taken): the refusal says nothing about the results.
RESULT_BATCH_PAUSE = 5.0
ACK_WAIT = 10.0  # seconds before JetStream redelivers an unacknowledged chunk
# Durable processor's writes (docs/benchmarks.md, target 4): at least FLUSH_INTERVAL seconds between
# two writes, acks/NAKs/pulls wait up to ACK_LINGER for a result's write. At 2,000 chunks/s one write
# then carries a few chunks' results, acks and pulls instead of one each. Faster than that, the gap
# shrinks (FastClient.write_gap: about a dozen commands per write, at least FLUSH_INTERVAL / 8).
FLUSH_INTERVAL = 0.002
ACK_LINGER = 0.005
# Deliveries of one chunk before it is poison: its request ends with an error result and the chunk
# is terminated. Legitimate redeliveries (hand-overs, crashes, results given up) stay far below it.
MAX_DELIVER = 20
# Stored result bodies a take-over reads back of one request, at most (MigrationLedger.history): its
# bytes and its results. The live session never holds a request's output (it counts token_ids and
# folds what it retains past MAX_RETAINED_BYTES); the heir holds what it reads at once, so it reads
# no more than a request may buffer live (MAX_BUFFERED_BYTES), and no more results than a 128k-token
# output streamed one token a chunk. Past either the bodies count as lost: the count-dependent rows
# are omitted with a reason. Unbounded, 128 MiB stored under one id took the heir's VmHWM up by
# the whole output while every other take-over of the partition that reads bodies waited.
MAX_HISTORY_BYTES = MAX_BUFFERED_BYTES
MAX_HISTORY_RESULTS = 131_072
# The bounds above count what the read keeps: the first stored copy of each seq. Copies of a result stored
# again after the duplicate window (a chunk redelivered and its result re-published by a later owner) cost
# nothing toward them, but every copy costs time: the read receives at most this many times either bound
# in all (every copy, queued ones included; 128 MiB, 524,288 results), so a store of endless copies of
# one seq ends too. A request whose results were each stored up to this many times reads whole.
MAX_HISTORY_COPIES = 4
# Recovery lookups in flight across every partition an instance owns (docs/operations.md, "Recovery
# lookups"). A lookup reads the request's whole last stored result (STREAM.MSG.GET: up to max_payload,
# Base64 in JSON; nats-server has no headers-only read). 32 per partition, 128 at once over 4
# partitions, let a worker's late chunks of forgotten ~1 MB results make each read wait behind the
# others past LOOKUP_TIMEOUT, and the ~180 MB of replies at once cost the processor its connection
# (a slow consumer) and its leases; 8 at once answered each within the timeout.
MAX_LOOKUPS = 8
# Lookups made for one delivery before a failure NAKs it (a delivery spent, towards max_deliver): a
# failed one waits for a slot again with its chunk held (in-progress acks), as a NAK would not.
LOOKUP_ATTEMPTS = 3

# Readers (client helpers and the edge)
# Bytes of one request's results a client reader (streamproc.client.results) may hold received and
# not yet read, behind a gap or ahead of its loop; past it the stream ends (ResultsOverrun). Never
# less than the connection's max_payload: one result always fits.
CLIENT_BUFFER_BYTES = 16 * 1024 * 1024
# What a reader charges each result it holds beyond its body and kept header values
# (ResultInfo.held_bytes): empty results cost memory too, so the byte bound is also a count bound.
# Below what nats-server counts for the same stored result against a pull's max_bytes (its subject,
# $JS.ACK reply and header block), so a replay pull's delivery never passes the reader's own bound.
RESULT_HELD_OVERHEAD = 96
MAX_PENDING_RESULTS = 4096  # out-of-order results buffered per request before the reader fails it

# Edge capabilities (streamproc.edge.auth verifies, streamproc.client.capability mints)
EDGE_AUDIENCE = "streamproc-edge"  # the JWT ``aud`` the edge requires
OPERATOR_SCOPE = "operator"  # ``scope`` of a capability for every request, /v1/recent and the page
CAPABILITY_TTL = 600.0  # seconds a minted capability lives by default
MAX_CAPABILITY_TTL = 366 * 86_400.0  # the longest a capability may live (mint_capability, streamproc token --ttl)

# Partition consumers a lease step reads back (consumer_info) to set back an edited tuning: bounded
# JetStream API load per step, each owned consumer in turn (nats/durable/partitions.py).
RETUNE_PER_STEP = 8
