"""The least CPU a Python durable relay can spend per chunk (issue 14, target 4's floor).

A contender for ``durable.py --floor``: one asyncio ``BufferedProtocol`` on a raw NATS connection (no
nats-py), doing the durable processor's per-chunk wire work and nothing else:

- pull requests on the same durable pull consumer as ``jsrelay.py`` (all partitions), kept topped up;
- per chunk, a result (the chunk's body, ``Streamproc-Seq`` and ``Nats-Msg-Id`` headers) published
  to ``P.results.<request_id>`` with a reply subject for its PubAck;
- the processor's ordering rule: one result of a request in flight at a time, the next one leaving
  on its predecessor's PubAck (the PubAck chain);
- the chunk acknowledged (``+ACK``) only after its result's PubAck;
- the processor's write coalescing: at least ``--interval`` between two socket writes (a write after
  a quiet spell leaves at once), and reads paused for the interval after a write under 8 KiB.

No join, no correlator, no partitions or leases, no recovery, no bounds, no metrics, no
validation: what is left is the NATS work any durable processor in Python has to do, cut from
``data_received`` with ``find``/slices. Its CPU per chunk at 2,000 chunks/s is the floor under
target 4's 60 µs on the machine of the run, as ``sse_floor.py``'s floor is under target 2's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import signal
import sys

from streamproc.nats.buffered_reads import BufferedReads  # no nats-py: the floor stays raw asyncio

PAUSE_READS_BELOW = 8 * 1024  # as streamproc/nats/fast_client.py
INBOX = "_INBOX.dfloor"


class DurableFloor(BufferedReads):
    SEQ = re.compile(rb"Streamproc-Seq: (\d+)")

    def __init__(self, stream: str, consumer: str, prefix: str, batch: int, interval: float,
                 ready: asyncio.Future, fast_batch: bool = False) -> None:
        self.pull = f"PUB $JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer} {INBOX}.pull ".encode()
        self.pull_body = f'{{"batch":{batch}}}'.encode()
        self.batch, self.interval = batch, interval
        self.results = f"{prefix}.results.".encode()
        self.buf = b""
        self.out: list[bytes] = []
        self.last_write = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False
        self.outstanding = 0  # messages asked for by pull requests and not yet delivered
        self.token = 0
        self.in_flight: dict[bytes, tuple[bytes, bytes]] = {}  # PubAck token -> (request id, chunk's ack subject)
        self.waiting: dict[bytes, collections.deque] = {}  # request id -> results behind the one in flight
        self.errors = 0
        self.ready = ready
        # --fast-batch: a request's results are staged until the next write, and those staged
        # together leave as one nats-server fast batch (a stream with allow_batched; docs/benchmarks.md,
        # "Fast batches"), the next batch once this one's PubAck is read: a request whose chunks
        # arrive within one write interval costs no hop between its results
        self.fast_batch = fast_batch
        self.busy: set[bytes] = set()  # requests with a result or a batch in flight
        self.staged: dict[bytes, None] = {}  # requests with results to send at the next write
        self.writing = False
        self.batches: dict[bytes, tuple[bytes, list[bytes]]] = {}  # batch id -> (request id, chunks' ack subjects)

    # -- writes -------------------------------------------------------------------------------
    def connection_made(self, transport):  # type: ignore[override]
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        transport.write(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n'
                        + f"SUB {INBOX}.pull 1\r\nSUB {INBOX}.ack.* 2\r\nSUB {INBOX}.fb.> 3\r\nPING\r\n".encode())

    def send(self, data: bytes) -> None:
        self.out.append(data)
        if self.timer is None and not self.writing:
            due = self.last_write + self.interval
            now = self.loop.time()
            if now >= due:
                self.write()
            else:
                self.timer = self.loop.call_at(due, self.write)

    def soon(self) -> None:
        """Write at the end of this read, or once the interval allows."""
        if self.timer is None:
            self.timer = self.loop.call_at(max(self.last_write + self.interval, self.loop.time()), self.write)

    def write(self) -> None:
        self.timer = None
        if self.staged:
            staged, self.staged = self.staged, {}
            self.writing = True
            for rid in staged:
                self.next_of(rid)
            self.writing = False
        if not self.out:
            return
        data = b"".join(self.out)
        self.out.clear()
        self.transport.write(data)
        self.last_write = self.loop.time()
        if self.interval and len(data) < PAUSE_READS_BELOW and not self.paused:
            self.paused = True
            self.transport.pause_reading()
            self.loop.call_at(self.last_write + self.interval, self.resume)

    def resume(self) -> None:
        self.paused = False
        self.transport.resume_reading()

    def ask(self) -> None:
        self.outstanding += self.batch
        self.send(self.pull + str(len(self.pull_body)).encode() + b"\r\n" + self.pull_body + b"\r\n")

    def publish(self, rid: bytes, headers: bytes, body: bytes, ack: bytes) -> None:
        self.token += 1
        token = str(self.token).encode()
        self.in_flight[token] = (rid, ack)
        self.busy.add(rid)
        self.send(b"HPUB " + self.results + rid + b" " + INBOX.encode() + b".ack." + token + b" "
                  + str(len(headers)).encode() + b" " + str(len(headers) + len(body)).encode() + b"\r\n"
                  + headers + body + b"\r\n")

    def publish_batch(self, rid: bytes, items: list[tuple[bytes, bytes, bytes]]) -> None:
        """``items`` as one fast batch (start, appends, commit; flow = its size, gap mode fail)."""
        self.token += 1
        batch = str(self.token).encode()
        self.batches[batch] = (rid, [ack for _, _, ack in items])
        self.busy.add(rid)
        head = b"HPUB " + self.results + rid + b" " + INBOX.encode() + b".fb." + batch + b"." \
            + str(len(items)).encode() + b".fail."
        last = len(items)
        for n, (headers, body, _) in enumerate(items, 1):
            op = b"0" if n == 1 else b"2" if n == last else b"1"
            self.send(head + str(n).encode() + b"." + op + b".$FI " + str(len(headers)).encode() + b" "
                      + str(len(headers) + len(body)).encode() + b"\r\n" + headers + body + b"\r\n")

    def done(self, rid: bytes) -> None:
        """The request's result or batch in flight is stored: what queued behind it goes next."""
        self.busy.discard(rid)
        if not self.fast_batch:
            self.next_of(rid)
        elif self.waiting[rid]:
            self.staged[rid] = None
            self.soon()
        else:
            del self.waiting[rid]

    def next_of(self, rid: bytes) -> None:
        queue = self.waiting[rid]
        if not queue:
            del self.waiting[rid]
        elif len(queue) == 1 or not self.fast_batch:
            self.publish(rid, *queue.popleft())
        else:
            items = list(queue)
            queue.clear()
            self.publish_batch(rid, items)

    def on_batch_reply(self, payload: bytes) -> None:
        if b'"batch"' not in payload:  # a flow ack; an error ends the batch, its PubAck follows
            if b'"error"' in payload:
                self.errors += 1
                print(f"durable_floor: batch: {payload[:200]!r}", file=sys.stderr)
            return
        batch = re.search(rb'"batch":"([^"]+)"', payload).group(1)
        rid, acks = self.batches.pop(batch)
        count = re.search(rb'"count":(\d+)', payload)
        if count is None or int(count.group(1)) != len(acks):  # stopped short: a floor does not resend
            self.errors += 1
            print(f"durable_floor: batch stored {count and int(count.group(1))} of {len(acks)}", file=sys.stderr)
        for ack in acks:
            self.send(b"PUB " + ack + b" 0\r\n\r\n")
        self.done(rid)

    # -- reads --------------------------------------------------------------------------------
    def on_chunk(self, subject: bytes, reply: bytes, headers: bytes, body: bytes) -> None:
        if not reply:  # a status message (heartbeat, 408/409): no pull of ours expires
            return
        self.outstanding -= 1
        if self.outstanding <= self.batch // 2:
            self.ask()
        rid = subject.rsplit(b".", 2)[-2]  # P.partition.<n>.<request_id>.<role>
        seq = self.SEQ.search(headers).group(1)
        result_headers = (b"NATS/1.0\r\nStreamproc-Seq: " + seq + b"\r\nNats-Msg-Id: " + rid + b"." + seq
                          + b"\r\n\r\n")
        queue = self.waiting.get(rid)
        if self.fast_batch:
            if queue is None:
                queue = self.waiting[rid] = collections.deque()
            queue.append((result_headers, body, reply))
            if rid not in self.busy:
                self.staged[rid] = None
                self.soon()
            return
        if queue is None:
            self.waiting[rid] = collections.deque()
            self.publish(rid, result_headers, body, reply)
        else:
            queue.append((result_headers, body, reply))

    def on_puback(self, token: bytes, payload: bytes) -> None:
        rid, ack = self.in_flight.pop(token)
        if b'"error"' in payload:
            self.errors += 1
            print(f"durable_floor: refused: {payload[:200]!r}", file=sys.stderr)
        self.send(b"PUB " + ack + b" 0\r\n\r\n")
        self.done(rid)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos, end = 0, len(buf)
        while pos < end:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            if buf.startswith(b"HMSG ", pos):  # HMSG <subject> <sid> [reply] <hdr len> <total len>
                parts = buf[pos + 5:eol].split()
                hlen, tlen = int(parts[-2]), int(parts[-1])
                start = eol + 2
                if start + tlen + 2 > end:
                    break
                self.on_chunk(parts[0], parts[2] if len(parts) == 5 else b"", buf[start:start + hlen],
                              buf[start + hlen:start + tlen])
                pos = start + tlen + 2
                continue
            if buf.startswith(b"MSG ", pos):  # MSG <subject> <sid> [reply] <len>: a PubAck
                parts = buf[pos + 4:eol].split()
                n = int(parts[-1])
                start = eol + 2
                if start + n + 2 > end:
                    break
                if parts[1] == b"2":
                    self.on_puback(parts[0].rsplit(b".", 1)[1], buf[start:start + n])
                else:
                    self.on_batch_reply(buf[start:start + n])
                pos = start + n + 2
                continue
            line = buf[pos:eol]
            if line == b"PING":
                self.send(b"PONG\r\n")
            elif line == b"PONG" and not self.ready.done():
                self.ready.set_result(None)
                self.ask()
            elif line.startswith(b"-ERR"):
                print(f"durable_floor: {line.decode(errors='replace')}", file=sys.stderr)
            pos = eol + 2
        self.buf = buf[pos:]

    def connection_lost(self, exc) -> None:  # type: ignore[override]
        if not self.ready.done():
            self.ready.set_exception(ConnectionError("nats-server closed the connection"))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--prefix", default="streamproc")
    parser.add_argument("--stream", required=True)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--interval", type=float, default=0.002,
                        help="least seconds between two writes (streamproc's flush_interval default)")
    parser.add_argument("--fast-batch", action="store_true",
                        help="results queued behind one in flight leave as one fast batch (allow_batched)")
    args = parser.parse_args()
    loop = asyncio.get_running_loop()
    host, port = args.nats_url.rsplit("//", 1)[1].rsplit(":", 1)
    ready = loop.create_future()
    await loop.create_connection(
        lambda: DurableFloor(args.stream, args.consumer, args.prefix, args.batch, args.interval, ready,
                             args.fast_batch),
        host, int(port))
    await ready
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


if __name__ == "__main__":
    asyncio.run(main())
