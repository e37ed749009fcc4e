"""What OpenTelemetry tracing costs the passthrough path, beside the same processor with it off.

Contenders, each ``streamproc run`` as a subprocess on one embedded nats-server, rounds alternating
in rotated order (the load of ``benchmarks/passthrough.py``, streamed aggregated requests, every
chunk carrying a worker ``traceparent``, one trace per request):

- ``off``: no ``OTEL_*`` variable (the baseline);
- ``unsampled``: tracing on (``OTEL_TRACES_EXPORTER=console``, stdout to /dev/null), the workers'
  traceparents not sampled (flags 00): the default parent-based sampler records nothing;
- ``sampled``: tracing on, every worker traceparent sampled (flags 01): every span recorded and
  serialised by the console exporter (the SDK's batch queue may overflow and drop spans).

Needs the ``otel`` extra. Prints CPU microseconds per message (steadier than rates on a shared
machine) and the ratio to ``off``. Usage: python benchmarks/tracing.py [--messages 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from passthrough import build_load, measure  # noqa: E402  (the same load and measurement)

from streamproc.sim.embedded import EmbeddedNats  # noqa: E402

SETTINGS: dict[str, tuple[dict[str, str], str | None]] = {
    "off": ({}, "00"),
    "unsampled": ({"OTEL_TRACES_EXPORTER": "console"}, "00"),
    "sampled": ({"OTEL_TRACES_EXPORTER": "console"}, "01"),
}


def traced(load, prefix: str, flags: str):
    """The load under ``prefix``, each request's chunks with a traceparent of one trace per request."""
    out = []
    for subject, body, headers in load:
        request_id = subject.split(".")[2]
        trace_id = int.from_bytes(request_id.encode()[:16].ljust(16, b"\0"), "big") or 1
        headers = {**headers, "traceparent": f"00-{trace_id:032x}-{7:016x}-{flags}"}
        out.append((prefix + subject[len("bench") :], body, headers))
    return out


async def run(args) -> None:
    names = list(SETTINGS)
    cpus: dict[str, list[float]] = {n: [] for n in names}
    with EmbeddedNats(jetstream=False) as server:
        print(
            f"nats-server {server.url}; {os.cpu_count()} cores; {args.messages} messages per run, "
            f"{args.rounds} rounds, order rotated per round"
        )
        load = build_load(args.messages, True, "bench")
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                env, flags = SETTINGS[name]
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)  # the contender subprocess inherits it
                try:
                    prefix = f"bench{r}{name}"
                    _, cpu, _ = await measure(server.url, prefix, traced(load, prefix, flags), "streamproc")
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                cpus[name].append(cpu)
    base = statistics.median(cpus["off"])
    print(f"{'setting':12}{'cpu us/msg (median)':>22}{'x off':>8}   runs")
    for name in names:
        median = statistics.median(cpus[name])
        print(f"{name:12}{median:22.1f}{median / base:8.2f}   {', '.join(f'{c:.1f}' for c in cpus[name])}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
