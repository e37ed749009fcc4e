"""Whole client path of a passthrough message, in one process: the processor beside the bare relay.

``benchmarks/passthrough.py`` is the headline figure, but on a shared 2-core machine its load
generator, nats-server and sink compete with the contender. Here each contender runs in this
process on a real connection, and the chunk messages are fed as wire bytes (``HMSG`` frames)
straight into its nats-py protocol parser, so what is timed is exactly its per-message work:
parse, header decode, message object, subscription queue, callback, result encoding and the
client's write to the socket. CPU µs per message (``time.process_time``; nats-server runs
elsewhere), rounds interleaved, paired medians.

Usage: python benchmarks/passthrough_inproc.py [--messages 100000] [--rounds 7] [--cprofile]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import nats

from streamproc.config import load
from streamproc.nats.processor import Processor
from streamproc.sim.embedded import EmbeddedNats
from streamproc.wire import Role, Subjects, chunk_headers
from streamproc.nats.fast_client import _stock_header_block


def frames(prefix: str, sid: int, messages: int, stream: bool) -> list[bytes]:
    """HMSG frames of aggregated chunks: streamed requests of 8 chunks, or unary ones."""
    subjects = Subjects(prefix)
    out = []
    per = 8 if stream else 1
    body = b'{"text": " token", "meta_info": {"id": "x", "completion_tokens": 3}, "index": 0}'
    for i in range(messages):
        rid, seq = f"r{i // per}", i % per
        hdr = _stock_header_block(chunk_headers(rid, Role.AGG, seq, final=seq == per - 1))
        subject = subjects.chunk(rid, Role.AGG)
        out.append(b"HMSG %s %d %d %d\r\n%s%s\r\n" % (subject.encode(), sid, len(hdr), len(hdr) + len(body),
                                                      hdr, body))
    return out


async def relay(url: str, prefix: str):
    nc = await nats.connect(url)
    head, out = f"{prefix}.chunks.", f"{prefix}.results."
    cut = len(head)
    publish = nc.publish
    done = [0]

    async def cb(msg) -> None:  # benchmarks/relay.py's callback, plus a counter
        request_id = msg.subject[cut:].rpartition(".")[0]
        await publish(out + request_id, msg.data, headers=msg.headers)
        done[0] += 1

    sub = await nc.subscribe(f"{head}>", cb=cb, pending_msgs_limit=4 * 1024 * 1024, pending_bytes_limit=1 << 30)
    await nc.flush()
    return nc, sub._id, lambda: done[0], nc.close


async def processor(url: str, prefix: str):
    settings = load({}, {"nats_url": url, "prefix": prefix, "format": "sglang", "mode": "core"})
    p = Processor(settings)
    await p.start()
    return p.nc, p.input._sub._id, lambda: p.stats.results, p.stop


async def measure(kind: str, url: str, prefix: str, messages: int, stream: bool) -> float:
    nc, sid, count, close = await (relay if kind == "relay" else processor)(url, prefix)
    try:
        data = frames(prefix, sid, messages, stream)
        parse = nc._ps.parse
        start = count()
        t0 = time.process_time()
        for i in range(0, len(data), 200):  # socket-read sized batches, the loop runs in between
            await parse(b"".join(data[i:i + 200]))
            await asyncio.sleep(0)
        while count() - start < messages:
            await asyncio.sleep(0.001)
        await nc.flush()
        return (time.process_time() - t0) / messages * 1e6
    finally:
        await close()


async def run(args) -> None:
    with EmbeddedNats(jetstream=False) as server:
        print(f"{args.messages} messages per run, {args.rounds} rounds interleaved; CPU µs/msg in-process")
        for stream in (True, False):
            cpu: dict[str, list[float]] = {"relay": [], "streamproc": []}
            for r in range(args.rounds):
                order = ("relay", "streamproc") if r % 2 == 0 else ("streamproc", "relay")
                for kind in order:
                    cpu[kind].append(await measure(kind, server.url, f"ip{r}{kind[0]}{int(stream)}",
                                                   args.messages, stream))
            ratios = [o / r for o, r in zip(cpu["streamproc"], cpu["relay"])]
            print(f"{'streamed' if stream else 'unary':9} relay {statistics.median(cpu['relay']):6.2f}  "
                  f"streamproc {statistics.median(cpu['streamproc']):6.2f}  paired ratio {statistics.median(ratios):.2f} "
                  f"(range {min(ratios):.2f}-{max(ratios):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cprofile", choices=["relay", "streamproc"], help="profile one streamed run instead")
    args = parser.parse_args()
    if args.cprofile:
        import cProfile
        import pstats

        async def one() -> None:
            with EmbeddedNats(jetstream=False) as server:
                prof = cProfile.Profile()
                prof.enable()
                await measure(args.cprofile, server.url, "prof", args.messages, True)
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)

        asyncio.run(one())
        return
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
