"""Report writer: rows of measurements to JSON, a Markdown table and a PNG figure.

Every report carries its provenance (see :func:`provenance`). Figures are
drawn on a bare :class:`matplotlib.figure.Figure` with the Agg canvas, so no pyplot state or
display is touched.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparsekv.evaluation.provenance import provenance

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["ReportFiles", "heatmap_grid", "provenance", "write_heatmap", "write_report"]


@dataclass(frozen=True)
class ReportFiles:
    """Paths written by :func:`write_report`."""

    json: Path
    markdown: Path
    png: Path


def _columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Every key of every row, in order of first appearance."""
    return list(dict.fromkeys(key for row in rows for key in row))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value).replace("|", "\\|")


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """A GitHub Markdown table of ``rows`` (floats to 4 significant digits)."""
    columns = _columns(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _sorted_points(points: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    if all(isinstance(px, (int, float)) for px, _ in points):
        return sorted(points, key=lambda p: p[0])
    return points


def _new_figure(figsize: tuple[float, float]) -> Figure:
    """A bare Agg figure; matplotlib is imported here, on the first plot, not with the module
    (every ``sparsekv bench`` and ``eval`` command imports this module for its tables)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=120, bbox_inches="tight")


def write_line_plot(
    path: Path, rows: Sequence[dict[str, Any]], *, title: str, x: str, y: str, group: str | None
) -> Path:
    """A PNG line plot of ``y`` against ``x``, one line per value of ``group`` (or one line)."""
    lines: dict[Any, list[tuple[Any, Any]]] = {}
    for row in rows:
        lines.setdefault(row.get(group) if group else None, []).append((row[x], row[y]))
    fig = _new_figure((6.4, 4.0))
    ax = fig.subplots()
    for label, points in lines.items():
        xs, ys = zip(*_sorted_points(points))
        ax.plot(xs, ys, marker="o", label=None if group is None else f"{group}={label}")
    ax.set(title=title, xlabel=x, ylabel=y)
    ax.grid(True, alpha=0.3)
    if group is not None:
        ax.legend(fontsize="small")
    _save(fig, path)
    return path


def write_report(
    out_dir: str | Path,
    name: str,
    rows: Sequence[dict[str, Any]],
    *,
    title: str,
    x: str,
    y: str,
    group: str | None = None,
    provenance: dict[str, Any],
) -> ReportFiles:
    """Write ``<name>.json``, ``<name>.md`` and ``<name>.png`` under ``out_dir``.

    Args:
        out_dir: folder, created if missing.
        name: file stem.
        rows: one dict per measurement; every row must hold ``x`` and ``y``.
        title: report and figure title.
        x: row key on the horizontal axis.
        y: row key on the vertical axis.
        group: row key that splits rows into lines (``None``: one line).
        provenance: from :func:`provenance`; stored in the JSON and listed in the Markdown.

    Returns:
        The three paths.

    Raises:
        ValueError: no rows, or a row without ``x`` or ``y``.
    """
    if not rows:
        raise ValueError("a report needs at least one row")
    missing = [i for i, row in enumerate(rows) if x not in row or y not in row]
    if missing:
        raise ValueError(f"rows {missing[:5]} lack the plotted keys {x!r} / {y!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = ReportFiles(out / f"{name}.json", out / f"{name}.md", out / f"{name}.png")
    document = {"name": name, "title": title, "x": x, "y": y, "group": group}
    document |= {"rows": list(rows), "provenance": provenance}
    files.json.write_text(json.dumps(document, indent=2, default=str) + "\n")
    facts = "\n".join(
        f"- {key}: `{json.dumps(value, default=str)}`" for key, value in provenance.items()
    )
    files.markdown.write_text(
        f"# {title}\n\n{markdown_table(rows)}\n\n![{title}]({files.png.name})\n\n"
        f"## Provenance\n\n{facts}\n"
    )
    write_line_plot(files.png, rows, title=title, x=x, y=y, group=group)
    return files


def heatmap_grid(
    rows: Sequence[dict[str, Any]], *, x: str = "length", y: str = "depth", value: str = "score"
) -> tuple[list[Any], list[Any], list[list[float]]]:
    """Average ``value`` over rows sharing ``(y, x)``: a depth x length grid of accuracy.

    Returns:
        ``(xs, ys, grid)``: sorted distinct x and y values and ``grid[i][j]`` = mean value at
        ``(ys[i], xs[j])``, ``nan`` where no row falls.
    """
    xs = sorted({row[x] for row in rows})
    ys = sorted({row[y] for row in rows})
    sums: dict[tuple[Any, Any], list[float]] = {}
    for row in rows:
        sums.setdefault((row[y], row[x]), []).append(float(row[value]))
    grid = [[sum(v) / len(v) if (v := sums.get((yy, xx))) else math.nan for xx in xs] for yy in ys]
    return xs, ys, grid


def write_heatmap(
    path: str | Path,
    rows: Sequence[dict[str, Any]],
    *,
    title: str,
    x: str = "length",
    y: str = "depth",
    value: str = "score",
    vmin: float = 0.0,
    vmax: float = 100.0,
) -> Path:
    """A PNG needle-grid heatmap: ``value`` (accuracy, 0-100) by ``y`` (depth) and ``x`` (length).

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("a heatmap needs at least one row")
    xs, ys, grid = heatmap_grid(rows, x=x, y=y, value=value)
    fig = _new_figure((1.2 + 0.9 * len(xs), 1.2 + 0.5 * len(ys)))
    ax = fig.subplots()
    image = ax.imshow(grid, cmap="RdYlGn", vmin=vmin, vmax=vmax, aspect="auto")
    for i, line in enumerate(grid):
        for j, cell in enumerate(line):
            if not math.isnan(cell):
                ax.text(j, i, f"{cell:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(xs)), [str(v) for v in xs])
    ax.set_yticks(range(len(ys)), [_cell(v) for v in ys])
    ax.set(title=title, xlabel=x, ylabel=y)
    fig.colorbar(image, ax=ax, label=value)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _save(fig, path)
    return path
