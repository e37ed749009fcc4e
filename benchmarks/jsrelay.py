"""The baseline for the durable benchmark: a plain nats-py JetStream fetch-ack-republish loop.

It reads the same chunk stream through one durable pull consumer (``fetch``), republishes every
chunk's body to ``P.results.<request_id>`` with ``publish_async`` and a ``Nats-Msg-Id``, waits for
the batch's PubAcks, then acks the batch: the textbook at-least-once relay, with nothing joined,
ordered or recovered. Same client library and connection options as ``streamproc run``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import nats
import nats.errors


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--prefix", default="streamproc")
    parser.add_argument("--stream", required=True)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()

    nc = await nats.connect(args.nats_url)
    js = nc.jetstream(publish_async_max_pending=4000)
    sub = await js.pull_subscribe_bind(args.consumer, stream=args.stream)
    out = f"{args.prefix}.results."
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def run() -> None:
        while not stop.is_set():
            try:
                msgs = await sub.fetch(args.batch, timeout=1)
            except nats.errors.TimeoutError:
                continue
            acks = []
            for msg in msgs:
                # Stored subject: P.partition.<n>.<request_id>.<role>
                request_id = msg.subject.rsplit(".", 2)[-2]
                seq = msg.headers["Streamproc-Seq"]
                headers = {"Streamproc-Seq": seq, "Nats-Msg-Id": f"{request_id}.{seq}"}
                acks.append(await js.publish_async(out + request_id, msg.data, headers=headers))
            await asyncio.gather(*acks)
            for msg in msgs:
                await msg.ack()

    task = asyncio.create_task(run())
    await stop.wait()
    task.cancel()
    await nc.drain()


if __name__ == "__main__":
    asyncio.run(main())
