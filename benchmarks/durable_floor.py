"""The least CPU a Python durable relay can spend per chunk (issue 14, target 4's floor).

A contender for ``durable.py --floor``: one asyncio ``Protocol`` on a raw NATS connection (no
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

PAUSE_READS_BELOW = 8 * 1024  # as streamproc/nats/fast_client.py
INBOX = "_INBOX.dfloor"


class DurableFloor(asyncio.Protocol):
    SEQ = re.compile(rb"Streamproc-Seq: (\d+)")

    def __init__(self, stream: str, consumer: str, prefix: str, batch: int, interval: float,
                 ready: asyncio.Future) -> None:
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

    # -- writes -------------------------------------------------------------------------------
    def connection_made(self, transport):  # type: ignore[override]
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        transport.write(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n'
                        + f"SUB {INBOX}.pull 1\r\nSUB {INBOX}.ack.* 2\r\nPING\r\n".encode())

    def send(self, data: bytes) -> None:
        self.out.append(data)
        if self.timer is None:
            due = self.last_write + self.interval
            now = self.loop.time()
            if now >= due:
                self.write()
            else:
                self.timer = self.loop.call_at(due, self.write)

    def write(self) -> None:
        self.timer = None
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
        self.send(b"HPUB " + self.results + rid + b" " + INBOX.encode() + b".ack." + token + b" "
                  + str(len(headers)).encode() + b" " + str(len(headers) + len(body)).encode() + b"\r\n"
                  + headers + body + b"\r\n")

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
        queue = self.waiting[rid]
        if queue:
            self.publish(rid, *queue.popleft())
        else:
            del self.waiting[rid]

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
                self.on_puback(parts[0].rsplit(b".", 1)[1], buf[start:start + n])
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
    args = parser.parse_args()
    loop = asyncio.get_running_loop()
    host, port = args.nats_url.rsplit("//", 1)[1].rsplit(":", 1)
    ready = loop.create_future()
    await loop.create_connection(
        lambda: DurableFloor(args.stream, args.consumer, args.prefix, args.batch, args.interval, ready),
        host, int(port))
    await ready
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


if __name__ == "__main__":
    asyncio.run(main())
