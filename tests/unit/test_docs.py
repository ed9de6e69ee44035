"""The documentation holds together: every link in the README and docs/ resolves, every file
path they name exists, the results index is current, and no file refers to pages outside the
repository or carries development history."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sparsekv.bench import results_index

ROOT = Path(__file__).resolve().parents[2]
HAND_WRITTEN = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
ALL_DOCS = HAND_WRITTEN + sorted((ROOT / "docs" / "results").rglob("*.md"))
TEXT_SUFFIXES = {".py", ".md", ".toml", ".h", ".cpp", ".txt", ".cfg", ".json", ".csv", ""}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\s]+)`")
PATH_LIKE = re.compile(r"^[\w.][\w./-]*/[\w./-]*$|^[\w-]+\.(py|md|toml|h|cpp)$")
# Names of design pages that live outside the repository, and the section sign that cited them.
OUTSIDE_PAGES = [
    "CONTRACTS" + ".md",
    "DESIGN" + ".md",
    "REFERENCE" + ".md",
    "STYLE" + ".md",
    "\u00a7",
]
HISTORY = re.compile(
    "sess" + r"ion [0-9]|iss" + r"ue ?#?[0-9]+|this sess" + "ion|previous sess" + "ion",
    re.IGNORECASE,
)


def _repo_text_files() -> list[Path]:
    files = [p for p in ROOT.iterdir() if p.is_file()]
    for folder in ("sparsekv", "tests", "docs", ".ci", "scripts"):
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file()]
    keep = []
    for path in files:
        if "__pycache__" in path.parts or path.suffix not in TEXT_SUFFIXES:
            continue
        if "fixtures" in path.parts or path.name.startswith("tokenizer"):
            continue  # model data (tokenizer vocabularies hold every symbol)
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        keep.append(path)
    return keep


def _repo_paths() -> set[str]:
    """Every file and folder under the repository's own folders, as ``/``-joined relative paths."""
    paths = {p.name for p in ROOT.iterdir()}
    for folder in ("sparsekv", "tests", "docs", ".ci", "scripts"):
        paths |= {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*")}
    return paths


REPO_PATHS = _repo_paths()


def _resolves(doc: Path, target: str) -> bool:
    """``target`` is a repository path, a path relative to ``doc``, or the tail of a repository
    path (``cpu/csrc/kernels.h``, ``manager.py``: docs name files within the package they are
    describing)."""
    target = target.rstrip("/")
    if (doc.parent / target).exists() or target in REPO_PATHS:
        return True
    return any(path.endswith("/" + target) for path in REPO_PATHS)


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(doc):
    missing = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"^(https?:|mailto:|#)", target):
            continue
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            missing.append(target)
    assert missing == [], f"{doc.relative_to(ROOT)} links to missing files: {missing}"


@pytest.mark.parametrize("doc", HAND_WRITTEN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_exists(doc):
    """Paths in `code spans` (repo-relative, package-relative or doc-relative) exist; user
    paths (``./out``, ``~/...``, ``/tmp/...``, ``.venv/...``) and patterns are not checked."""
    missing = []
    for token in CODE_SPAN.findall(doc.read_text(encoding="utf-8")):
        token = token.rstrip(".,:;")
        if not PATH_LIKE.match(token) or re.search(r"[*<>{}]|^\.{1,2}/|^\.venv/|://", token):
            continue
        if not _resolves(doc, token.split("::")[0]):
            missing.append(token)
    assert missing == [], f"{doc.relative_to(ROOT)} names missing paths: {missing}"


def test_the_docs_cover_what_the_readme_promises():
    for name in ("design.md", "compression.md", "benchmarks.md", "results/index.md"):
        assert (ROOT / "docs" / name).is_file(), name
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 260


def test_results_index_is_current():
    assert results_index.main([str(ROOT / "docs" / "results"), "--check"]) == 0, (
        "docs/results/index.md is stale: run `make results-index`"
    )


def test_no_reference_to_pages_outside_the_repository():
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in _repo_text_files()
        for name in OUTSIDE_PAGES
        if name in path.read_text(encoding="utf-8")
    ]
    assert found == []


def test_no_development_history_in_the_repository():
    found = []
    for path in _repo_text_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}")
    assert found == []


def _readme_blocks(language: str) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def test_readme_python_uses_only_names_it_defines_or_imports():
    import ast
    import builtins

    blocks = _readme_blocks("python")
    assert blocks
    for code in blocks:
        tree = ast.parse(code)
        defined = set(dir(builtins))
        loaded = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                (defined if isinstance(node.ctx, ast.Store) else loaded).add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
        assert loaded - defined == set(), code
        imported = {
            a.asname or a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            for a in n.names
        }
        assert imported <= loaded, f"unused imports: {imported - loaded}"


def test_readme_examples_are_greedy():
    """Sampled output of a 135M model reads as nonsense: every example asks for temperature 0."""
    for code in _readme_blocks("python"):
        for call in re.findall(r"SamplingParams\(([^)]*)\)", code):
            assert "temperature=0" in call, call
    for command in _readme_blocks("bash"):
        for body in re.findall(r"-d '(\{.*?\})'", command, flags=re.DOTALL):
            assert '"temperature": 0' in body, body
