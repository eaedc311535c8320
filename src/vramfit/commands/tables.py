"""Plain-text tables, as the commands that print several rows (compare, predict) show them."""

from __future__ import annotations


def text_table(rows: list[list[str]], rule: bool = True) -> str:
    """Left-aligned columns two spaces apart; `rule` underlines the first row (the header)."""
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(max(map(len, rows)))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
