"""Real text that ships with every CPython install and Debian image, read offline.

Two kinds of text are found here, never downloaded:

* prose paragraphs from ``pydoc_data.topics`` (the Python language reference that ``help()``
  shows), used as the essay haystack;
* whole files: license texts (``/usr/share/common-licenses/*``, the stdlib ``LICENSE.txt``) and
  stdlib source files, used as long documents for fidelity runs.

Every listing is sorted, so the same machine gives the same texts in the same order.
"""

from __future__ import annotations

import os
import re
import sysconfig
from pathlib import Path

COMMON_LICENSES_DIR = Path("/usr/share/common-licenses")

_INDENTED = re.compile(r"^\s")
_HEADING_RULE = re.compile(r"^[*=\-~^]{3,}$")


def stdlib_dir() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def license_files() -> list[Path]:
    """License texts present on this machine, deduplicated by real path, sorted by name.

    Debian's ``base-files`` ships ``/usr/share/common-licenses``; CPython ships
    ``LICENSE.txt`` in its stdlib directory. Either may be absent (then it is skipped).
    """
    found: dict[str, Path] = {}
    if COMMON_LICENSES_DIR.is_dir():
        for path in sorted(COMMON_LICENSES_DIR.iterdir()):
            real = os.path.realpath(path)
            if path.is_file() and real not in found:
                found[real] = path
    python_license = stdlib_dir() / "LICENSE.txt"
    if python_license.is_file():
        found.setdefault(os.path.realpath(python_license), python_license)
    return list(found.values())


def stdlib_sources() -> list[Path]:
    """Top-level ``*.py`` files of the standard library, sorted by name."""
    root = stdlib_dir()
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("*.py") if p.is_file())


def read_text(path: Path) -> str:
    """A file's text, undecodable bytes replaced, so odd encodings never raise."""
    return path.read_text(encoding="utf-8", errors="replace")


def _prose_paragraphs(text: str, min_words: int = 12) -> list[str]:
    """Paragraphs of running prose from reStructuredText-like help text.

    Code blocks, grammar rules and tables are indented or short in ``pydoc_data``; they are
    dropped, and each kept paragraph is joined onto one line.
    """
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip("\n").split("\n")
        if any(_INDENTED.match(line) or _HEADING_RULE.match(line.strip()) for line in lines):
            continue
        paragraph = " ".join(line.strip() for line in lines)
        words = paragraph.split()
        if len(words) < min_words or not paragraph.rstrip().endswith((".", ":")):
            continue
        letters = sum(ch.isalpha() or ch.isspace() for ch in paragraph)
        if letters < 0.85 * len(paragraph):
            continue
        paragraphs.append(" ".join(words))
    return paragraphs


def essay_paragraphs() -> list[str]:
    """Prose paragraphs for the essay haystack, in a fixed order; empty if none is found.

    Source order: ``pydoc_data.topics`` (about 460k characters of reference prose, sorted by
    topic), then the license texts of :func:`license_files`.
    """
    paragraphs: list[str] = []
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    for key in sorted(topics):
        paragraphs.extend(_prose_paragraphs(topics[key]))
    for path in license_files():
        paragraphs.extend(_prose_paragraphs(read_text(path)))
    return paragraphs
