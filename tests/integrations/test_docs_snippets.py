"""Every ```python block of README.md and docs/*.md runs as written.

Each block runs on its own (a fresh namespace, so it must import what it uses) in an empty working directory, with
the Hub offline and the Hub id "gpt2" replaced by a tiny local GPT-2 saved with GPT-2's real tokenizer. Markers, an
HTML comment on the line right before a block:

- `<!-- no-test: REASON -->`: needs what this machine lacks (a GPU, network); the block is only compiled.
- `<!-- test: hub-recorded -->`: uploads to the Hub; runs with the Hub API replaced by a recorder, which must
  receive at least one upload.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conversion_runs import record_hub_uploads
from tests.workflow_utils import ROOT, tiny_gpt2_dir

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!--\s*(?P<marker>[^>]*?)\s*-->[ \t]*\n)?^```python[ \t]*\n(?P<code>.*?)^```", re.S | re.M)
HUB_ID = re.compile(r"""(["'])gpt2\1""")


@dataclass
class Snippet:
    path: Path
    line: int
    code: str
    marker: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def snippets() -> list[Snippet]:
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("code"))  # 1-based line of the ```python fence
            found.append(Snippet(path, line, match.group("code"), (match.group("marker") or "").strip()))
    return found


SNIPPETS = snippets()


def test_every_marker_is_known_and_skips_are_few():
    markers = [s.marker for s in SNIPPETS if s.marker]
    assert all(m.startswith("no-test:") or m == "test: hub-recorded" for m in markers), markers
    assert sum(m.startswith("no-test:") for m in markers) <= 3, markers
    assert len(SNIPPETS) >= 8  # the extraction works


@pytest.fixture(scope="module")
def local_gpt2(tmp_path_factory) -> Path:
    return tiny_gpt2_dir(tmp_path_factory.mktemp("docs") / "gpt2", dropout=0.0)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet_runs_as_written(snippet: Snippet, local_gpt2, tmp_path, monkeypatch):
    code = compile(snippet.code, snippet.id, "exec")  # every block, skipped or not, is valid Python
    if snippet.marker.startswith("no-test:"):
        pytest.skip(snippet.marker)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    uploads = record_hub_uploads(monkeypatch) if snippet.marker == "test: hub-recorded" else None
    source = HUB_ID.sub(repr(str(local_gpt2)), snippet.code)
    code = compile("\n" * (snippet.line) + source, str(snippet.path), "exec")  # tracebacks point into the doc
    exec(code, {"__name__": "__main__"})
    if uploads is not None:
        assert uploads, "the block was marked as uploading but uploaded nothing"
