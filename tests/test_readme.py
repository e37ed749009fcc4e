"""Every ```python snippet in README.md runs as written, in order, against a real nats-server and
a running processor (top-level ``await`` allowed, as in an asyncio REPL)."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]

README = Path(__file__).resolve().parents[1] / "README.md"


def python_snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def readme_run_format() -> str:
    """The ``--format`` of the README's ``streamproc run`` line: the processor its reader starts."""
    found = re.findall(r"^streamproc run\b.*?--format\s+(\S+)", README.read_text(), re.M)
    return found[0] if found else "sglang"


def test_readme_has_python_snippets():
    assert len(python_snippets()) >= 2


async def test_readme_python_snippets_run_against_a_real_processor(nats_url, start_processor):
    import streamproc

    nc = await streamproc.connect(nats_url)  # as the README says (its URL is this test's server)
    namespace: dict = {"nc": nc}
    out = io.StringIO()
    # The processor the README's "Using it for real" starts, so the snippets work against it as written.
    async with start_processor("in-process", mode="core", format=readme_run_format()):
        for snippet in python_snippets():
            code = compile(snippet, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            with contextlib.redirect_stdout(out):
                result = eval(code, namespace)  # noqa: S307 - our own README
                if result is not None:
                    await result
    await nc.close()
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["""0 passthrough b'{"text": "Hello"}'""", """1 passthrough b'{"text": " world"}'"""]
    verdicts = ast.literal_eval(lines[2])
    assert verdicts and set(verdicts) == {"joined"}


def test_edge_docs_name_every_verdict_in_the_order_the_edge_ranks_them():
    from streamproc.edge.app import _VERDICT_RANK

    docs = (README.parent / "docs" / "edge.md").read_text()
    ranked = " > ".join(v.value for v in sorted(_VERDICT_RANK, key=_VERDICT_RANK.get, reverse=True))
    assert docs.count(ranked) == 2
    assert '"passthrough"|"joined"|"stitched"|"omitted"|null' in docs


def test_docs_link_only_to_files_that_exist():
    root = README.parent
    for doc in [README, root / "CHANGELOG.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def test_docs_cite_no_notes_outside_the_repository():
    root = README.parent
    for doc in [README, *sorted((root / "docs").glob("*.md"))]:
        text = doc.read_text()
        for outside in ("native-formats.md", "stream-anchors.md", "seed-pr.md", "/work/"):
            assert outside not in text, f"{doc.name} refers to {outside}, which is not in the repository"
