"""Argument parsers whose ``--help`` reads as plain text: a command's module docstring (reST,
written for the API docs) becomes its description with the markup taken out and its own line
breaks kept, and every option with a help line shows its default."""

from __future__ import annotations

import argparse
import re

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :mod:`x`, :func:`~a.b` -> `x`, `a.b`


def plain_text(doc: str) -> str:
    """``doc`` with reST inline markup reduced to single backquotes (``x`` and :role:`x` ->
    `x`); line breaks and everything else unchanged."""
    return _ROLE.sub(r"`\1`", doc).replace("``", "`")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (paragraphs and lists keep their lines); a help line that
    does not mention its default gets ``(default: X)`` where X is set (not None or False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        default = action.default
        if (
            text
            and "default" not in text
            and default not in (None, False, argparse.SUPPRESS)
            and action.option_strings
        ):
            text += " (default: %(default)s)"
        return text


def doc_parser(prog: str | None, doc: str | None) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` for a command documented by ``doc`` (its module docstring).

    Args:
        prog: the command as typed (``"sparsekv bench serve"``); ``None``: argparse's default.
        doc: the module docstring (``None`` under ``python -OO``: no description).
    """
    description = plain_text(doc.strip()) if doc else None
    return argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=HelpFormatter
    )
