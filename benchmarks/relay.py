"""The baseline for the passthrough benchmark: a bare nats-py relay.

It subscribes to ``P.chunks.>`` and republishes every message, with the same headers, to
``P.results.<request_id>``: the least a processor could do. Same client library, same
subscription limits and connection options as ``streamproc run``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import nats


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--prefix", default="streamproc")
    args = parser.parse_args()

    nc = await nats.connect(args.nats_url)
    head = f"{args.prefix}.chunks."
    out = f"{args.prefix}.results."
    cut = len(head)
    publish = nc.publish

    async def relay(msg) -> None:
        request_id = msg.subject[cut:].rpartition(".")[0]
        await publish(out + request_id, msg.data, headers=msg.headers)

    await nc.subscribe(f"{head}>", cb=relay, pending_msgs_limit=4 * 1024 * 1024, pending_bytes_limit=1 << 30)
    await nc.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await nc.drain()


if __name__ == "__main__":
    asyncio.run(main())
