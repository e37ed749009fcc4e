"""nats-py's protocol parser against streamproc's FastParser, frame for frame (issue 14, target 2).

Feeds the same bytes (the edge's result frames: ``HMSG P.results.<id> 1 <h> <n>`` with the
processor's result headers, 50 subjects round robin) in 32 KiB reads, as nats-py's read loop hands
them over, to nats-py 2.16's ``Parser`` (with robust.py's grammar, as every streamproc connection
parses) and to ``FastParser``, on a client stub that only counts: the figure is the parser's own
CPU per frame, without the ``Msg``, queue or fan-out after it. Rounds alternate; process CPU time.

Usage: python benchmarks/nats_parser.py [--frames 20000] [--rounds 5] [--payload 120,2000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from nats.protocol.parser import Parser

from streamproc.nats.fast_parser import FastParser
from streamproc.nats.robust import install_parser_fix

HEADERS = (b"NATS/1.0\r\nStreamproc-Seq: 12\r\nNats-Msg-Id: req-000012.12\r\n"
           b"Streamproc-Join: passthrough\r\n\r\n")


def frames(count: int, payload_len: int) -> bytes:
    body = b'{"text":"' + b"x" * payload_len + b'"}'
    return b"".join(b"HMSG P.results.req-%06d 1 %d %d\r\n%s%s\r\n" % (
        i % 50, len(HEADERS), len(HEADERS) + len(body), HEADERS, body) for i in range(count))


class Counter:
    """The client side: counts the messages either parser hands over."""

    n = 0

    def _msg_now(self, sid, subject, reply, payload, hdr) -> None:
        self.n += 1

    async def _process_msg(self, sid, subject, reply, payload, hdr) -> None:
        self.n += 1


async def one(parser_class: type, reads: list[bytes], count: int) -> float:
    nc = Counter()
    parser = parser_class(nc)
    t = time.process_time()
    for read in reads:
        await parser.parse(read)
    cpu = time.process_time() - t
    assert nc.n == count, (parser_class, nc.n)
    return cpu / count * 1e6


async def run(args) -> None:
    install_parser_fix()
    for size in (int(s) for s in args.payload.split(",")):
        data = frames(args.frames, size)
        reads = [data[i:i + 32768] for i in range(0, len(data), 32768)]
        got: dict[str, list[float]] = {"stock": [], "fast": []}
        for _ in range(args.rounds):
            got["stock"].append(await one(Parser, reads, args.frames))
            got["fast"].append(await one(FastParser, reads, args.frames))
        ratios = [f / s for f, s in zip(got["fast"], got["stock"])]
        print(f"payload {size:>5} B: stock {statistics.median(got['stock']):.2f} us/frame "
              f"({min(got['stock']):.2f}-{max(got['stock']):.2f}), fast {statistics.median(got['fast']):.2f} "
              f"({min(got['fast']):.2f}-{max(got['fast']):.2f}), paired fast/stock x{statistics.median(ratios):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--payload", default="120,2000", help="payload sizes in bytes, comma separated")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
