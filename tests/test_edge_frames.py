"""The SSE frame the edge writes per result (``result_event``), held to ``sse.event``'s framing
byte for byte: the one-line fast case must never take a body that holds a line break."""

from __future__ import annotations

import pytest

from streamproc.core.events import ResultInfo, Verdict
from streamproc.edge import sse
from streamproc.edge.app import result_event


@pytest.mark.parametrize("body", [
    b"", b"plain", b'{"text":" token"}', b"a\nb", b"a\rb", b"a\r\nb", b"\n", b"\r", b"end\n", b"\rstart",
    b"\x0b\x0c\x85 not line breaks", "caf\u00e9\u2028".encode(),
])
def test_a_result_frame_is_sse_event_framing_for_any_body(body):
    result = ResultInfo(request_id="r", seq=7, final=False, verdict=Verdict.PASSTHROUGH, error=None, body=body)
    assert result_event(result) == sse.event(body, id=7)
