"""Per-step cost of one aggregated passthrough message, the general path beside the fused one.

In-process, no NATS: each step runs on the same pre-built chunk (headers as a worker sends them),
timed over ``--n`` calls, steps interleaved over ``--rounds`` rounds, median µs per call. Two loads:
a streamed chunk (seq 1 of a request in progress: the correlator's per-request state, the reorder
check) and a unary one (seq 0, final, a new request id every call: the finished-set bookkeeping).
"before" is what a message cost on the stock nats-py path + the general streamproc path; "after"
is FastClient + the fused PassthroughPath. The sum is an estimate: the event loop, the message
queue and the socket are not in it (benchmarks/passthrough.py measures the whole process).

Usage: python benchmarks/passthrough_steps.py [--n 50000] [--rounds 5] [--load streamed|unary]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Callable

from nats.aio.client import Client

from streamproc.catalog import Catalog
from streamproc.core.correlator import Correlator, CorrelatorConfig
from streamproc.core.passthrough import PassthroughPath
from streamproc.core.wire import ChunkParser, Result, Role, Verdict, Subjects, chunk_headers, result_header_block, result_headers
from streamproc.nats.fast_client import FastClient, _stock_header_block, encode_header_block, parse_header_block


def make_clients() -> tuple[Client, FastClient]:
    """Two clients that accept publishes without a server: commands pile up in ``_pending``."""
    out = []
    for cls in (Client, FastClient):
        nc = cls()
        nc._status = Client.CONNECTED
        nc._flush_queue = None
        out.append(nc)
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--load", action="append", choices=["streamed", "unary"], default=[])
    args = parser.parse_args()
    for load in args.load or ["streamed", "unary"]:
        measure(args, load == "streamed")


def measure(args: argparse.Namespace, streamed: bool) -> None:
    n = args.n
    subjects = Subjects("bench")
    subject = subjects.chunk("r1", Role.AGG)
    body = b'{"text": "hello", "meta_info": {"id": "r1"}}'
    seq, final = (1, False) if streamed else (0, True)
    wire_headers = _stock_header_block(chunk_headers("r1", Role.AGG, seq, final=final))
    stock, fast = make_clients()
    loop = asyncio.new_event_loop()
    headers = loop.run_until_complete(stock._process_headers(wire_headers))

    def correlator() -> Correlator:
        c = Correlator(Catalog(), "sglang", CorrelatorConfig(max_retained_bytes=1 << 62))
        if streamed:
            c.receive(ChunkParser(subjects)(subject, {**headers, "Streamproc-Seq": "0"}, body), 0.0)
        return c

    parse = ChunkParser(subjects)
    chunk = parse(subject, headers, body)
    result = Result("r1", seq, body, final, Verdict.PASSTHROUGH, None, None, ())
    result_subject = subjects.result("r1")
    block = result_header_block("r1", seq, final, None)
    c_general, c_fused = correlator(), correlator()
    fused = PassthroughPath(subjects, c_fused)
    if streamed:  # stateful steps rewind their request to seq 1 before every call
        req_g, req_f = c_general._active["r1"], c_fused._active["r1"]

        def receive() -> None:
            req_g.next_seq = 1
            c_general.receive(chunk, 0.0)

        def receive_agg() -> None:
            req_f.next_seq = 1
            c_fused.receive_agg("r1", 1, False, body, None, 0.0)

        def fused_path() -> None:
            req_f.next_seq = 1
            fused(subject, headers, body, 0.0)
    else:  # a new request every call: ids cycle through more than the finished set holds
        ids = [f"u{i}" for i in range(2 * c_fused._max_finished + 1)]
        chunks = [parse(subjects.chunk(rid, Role.AGG), headers, body) for rid in ids]
        subs = [subjects.chunk(rid, Role.AGG) for rid in ids]
        count = len(ids)
        k = [0, 0, 0]

        def receive() -> None:
            k[0] = (k[0] + 1) % count
            c_general.receive(chunks[k[0]], 0.0)

        def receive_agg() -> None:
            k[1] = (k[1] + 1) % count
            c_fused.receive_agg(ids[k[1]], 0, True, body, None, 0.0)

        def fused_path() -> None:
            k[2] = (k[2] + 1) % count
            fused(subs[k[2]], headers, body, 0.0)

    async def pub_stock() -> None:
        await stock.publish(result_subject, body, headers=result_headers(result))
        stock._pending.clear()

    async def pub_fast() -> None:
        await fast.publish_header_block(result_subject, body, block)
        fast._pending.clear()

    async def parse_stock() -> None:
        await stock._process_headers(wire_headers)

    steps: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        ("nats-py: parse received header block", parse_stock, lambda: parse_header_block(wire_headers)),
        ("streamproc: chunk parse + correlator + result headers", lambda: (parse(subject, headers, body), receive(),
                                                                          result_headers(result)), fused_path),
        ("  chunk parse", lambda: parse(subject, headers, body), None),
        ("  correlator", receive, receive_agg),
        ("  result headers", lambda: result_headers(result), lambda: result_header_block("r1", 1, False, None)),
        ("nats-py: encode header dict", lambda: _stock_header_block(result_headers(result)),
         lambda: encode_header_block(result_headers(result))),
        ("nats-py: publish (header dict / pre-formatted block)", pub_stock, pub_fast),
    ]

    async def timed(fn: Callable[[], object]) -> float:
        if asyncio.iscoroutinefunction(fn):
            t = time.perf_counter()
            for _ in range(n):
                await fn()
        else:
            t = time.perf_counter()
            for _ in range(n):
                fn()
        return (time.perf_counter() - t) / n * 1e6

    async def run() -> dict[str, tuple[list[float], list[float]]]:
        times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _, _ in steps}
        for _ in range(args.rounds):
            for name, before, after in steps:
                times[name][0].append(await timed(before))
                if after is not None:
                    times[name][1].append(await timed(after))
        return times

    times = loop.run_until_complete(run())
    print(f"{'streamed' if streamed else 'unary'} chunk: {n} calls per step, {args.rounds} interleaved rounds, "
          f"median µs per call")
    print(f"{'step':56}{'before':>9}{'after':>9}{'ratio':>8}")
    total_b = total_a = 0.0
    for name, _, after in steps:
        b = statistics.median(times[name][0])
        if after is None:
            print(f"{name:56}{b:9.2f}{'(none)':>9}")
            continue
        a = statistics.median(times[name][1])
        if not name.startswith(" ") and not name.startswith("nats-py: encode"):
            total_b += b
            total_a += a
        print(f"{name:56}{b:9.2f}{a:9.2f}{a / b:8.2f}")
    print(f"{'sum of the top-level steps (encode is inside publish)':56}{total_b:9.2f}{total_a:9.2f}"
          f"{total_a / total_b:8.2f}")
    loop.close()


if __name__ == "__main__":
    main()
