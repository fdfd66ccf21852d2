"""What a reader of the code meets: tests and code say what they check and why, not which issue asked for them
(an issue number means nothing to a reader of the code); and no pickle-style weights among the project's files."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def test_no_source_test_or_doc_names_an_issue_number():
    files = [
        *ROOT.glob("*.py"),
        *ROOT.glob("ddl_hf/**/*.py"),
        *ROOT.glob("tests/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        *ROOT.glob("examples/*.py"),
        *ROOT.glob("conversion/*.py"),
        *ROOT.glob("docs/*.md"),
        ROOT / "README.md",
    ]
    assert len(files) > 50
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if ISSUE_NUMBER.search(line)
    ]
    assert not offenders, "\n".join(offenders)


def test_no_pickle_style_weights_are_kept_in_the_repository():
    """safetensors (and JSON) only: a pickle runs code when loaded. Trainer's own pickles are written at test time."""
    folders = ("tests", "ddl_hf", "examples", "benchmarks", "docs", "conversion")
    found = [
        str(path.relative_to(ROOT))
        for folder in folders
        for path in (ROOT / folder).rglob("*")
        if path.suffix in {".bin", ".pt", ".pth", ".ckpt", ".pkl"} and "__pycache__" not in path.parts
    ]
    assert not found, found
