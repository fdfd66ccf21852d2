"""What a reader of the code meets: tests and code say what they check and why, not which issue asked for them
(an issue number means nothing to a reader of the code); no pickle-style weights among the project's files; and a
README that is a short front door whose links, like the docs', all lead somewhere."""

from __future__ import annotations

import re
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
# The front door, the docs, and the lab's results logs and READMEs (the dated measurements the docs link to).
DOCS = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "ddl_lab").glob("*/results/README.md")),
    ROOT / "ddl_lab" / "benchmarks" / "results" / "performance_log.md",
]
README_MAX_LINES = 200
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_no_source_test_or_doc_names_an_issue_number():
    files = [
        *ROOT.glob("*.py"),
        *ROOT.glob("ddl_hf/**/*.py"),
        *ROOT.glob("tests/**/*.py"),
        *ROOT.glob("ddl_lab/benchmarks/*.py"),
        *ROOT.glob("ddl_lab/studies/*.py"),
        *ROOT.glob("ddl_lab/checks/*.py"),
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
    folders = ("tests", "ddl_hf", "examples", "benchmarks", "studies", "checks", "docs", "conversion")
    found = [
        str(path.relative_to(ROOT))
        for folder in folders
        for path in (ROOT / folder).rglob("*")
        if path.suffix in {".bin", ".pt", ".pth", ".ckpt", ".pkl"} and "__pycache__" not in path.parts
    ]
    assert not found, found


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    headings = re.findall(r"^#+\s+(.+?)\s*$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_of_the_readme_and_docs_resolves():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(FENCE.sub("", doc.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_short_front_door_that_starts_with_set_up_demo_and_tests():
    """Its first block sets everything up and runs the demo, then the tests, with the command CI runs."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES, "README.md grew: move the long version into docs/"
    first_block = FENCE.search(readme).group(0).splitlines()[1:-1]
    assert len(first_block) == 2, first_block
    demo, tests = (line.split("#")[0].strip() for line in first_block)
    assert demo.startswith("pip install") and demo.endswith("python examples/demo.py"), demo
    command = "python -m pytest -n 2 --dist loadfile"  # two workers (pytest-xdist), each test file on one
    assert tests.startswith("pip install") and tests.endswith(command), tests
    # the main job installs what it needs (tests/integrations/test_workflow_demo.py runs it without the dev extra)
    assert "[dev]" not in demo and '".[dev]"' in tests
    assert command in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


BLOCKS = {"modeling_delta_gpt.py": "DeltaGPTBlock", "modeling_delta_llama.py": "DeltaLlamaDecoderLayer"}
BLOCK_FORWARD_MAX_LINES = 15


def test_each_block_forward_is_eq_2_5_in_a_dozen_lines_without_closures():
    """A Delta block reads straight down as the paper's equation (read, norm, sublayer, Delta update; twice): its
    `forward` body, docstring aside, stays short and hands no function to another module. The mutant this catches is
    the earlier form, which built `attention` / `mlp` closures and passed them to the residual."""
    import ast

    for file, block in BLOCKS.items():
        tree = ast.parse((ROOT / file).read_text(encoding="utf-8"))
        (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == block]
        (forward,) = [node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "forward"]
        body = forward.body[1:] if isinstance(forward.body[0], ast.Expr) else forward.body  # the docstring
        lines = body[-1].end_lineno - body[0].lineno + 1
        assert lines <= BLOCK_FORWARD_MAX_LINES, f"{block}.forward has {lines} lines"
        nested = [n for n in ast.walk(forward) if isinstance(n, (ast.FunctionDef, ast.Lambda)) and n is not forward]
        assert not nested, f"{block}.forward defines a function: {[type(n).__name__ for n in nested]}"


def test_every_entry_of_the_compatibility_subset_names_a_test():
    """CI runs `pytest -m compat` on the oldest transformers and the torch range: an entry that no longer names a
    file or a test (a file moved or renamed) would shrink that subset without an error."""
    from tests.conftest import COMPAT_SUBSET

    files = {path.name: path.read_text(encoding="utf-8") for path in ROOT.glob("tests/**/test_*.py")}
    missing = []
    for entry in COMPAT_SUBSET:
        file, _, test = entry.partition("::")
        if file not in files or (test and f"def {test}(" not in files[file]):
            missing.append(entry)
    assert not missing, missing


def test_ruff_lints_each_hub_file_once():
    """The ddl_hf/ copies of the Hub files are symlinks to the root files: ruff's exclude globs match every one of them
    (or ruff lints that file twice) and no real file of ddl_hf (or that file goes unlinted)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    excluded = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["extend-exclude"]
    files = sorted((ROOT / "ddl_hf").rglob("*.py"))
    matched = [path for path in files if any(fnmatch(path.relative_to(ROOT).as_posix(), glob) for glob in excluded)]
    symlinks = [path for path in files if path.is_symlink()]
    assert symlinks and matched == symlinks
