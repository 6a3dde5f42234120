"""The HTML report of ``fastdump diff --html``: one self-contained file, plots drawn here as SVG.

No network resources, no scripts, no plotting library: the SVG is written by hand, so the report
opens anywhere (an air-gapped cluster's browser, a CI artifact viewer). Every text from the dump
(names can hold any character) is escaped.
"""

from __future__ import annotations

import html
import itertools
import math
import os
import re
import stat

from .format import printable

_REL_FLOOR = 1e-16  # rel_diff of identical tensors is 0; the log axes start here
_MAX_HEATMAP_PASSES = 400
_MAX_HEATMAP_LAYERS = 400
_MAX_TABLE_ROWS = 2000
_MAX_LIST_ITEMS = 1000  # notes, missing items, problems: the rest are in the text and JSON output
_MAX_PLOT_POINTS = 4000
_MAX_TEXT = 1000  # characters of one name or message; a name may be 100k characters long


def _clip(text: str) -> str:
    if len(text) <= _MAX_TEXT:
        return text
    half = _MAX_TEXT // 2
    return f"{text[:half]}…[{len(text) - 2 * half} more characters]…{text[-half:]}"


def _esc(value) -> str:
    """Text from the dump, as HTML (also inside SVG): escaped, control characters written as
    ``printable`` writes them for a terminal (a raw NUL or form feed makes the page malformed, a
    newline would join two names into one), and clipped so that the report stays bounded."""
    return html.escape(_clip(printable(value)), quote=True)


def _items(items, text) -> str:
    """A bounded <ul> of ``text(item)``."""
    shown = "".join(f"<li>{_esc(text(item))}</li>" for item in items[:_MAX_LIST_ITEMS])
    more = f"<li>… {len(items) - _MAX_LIST_ITEMS} more (see the text or --json output)</li>" \
        if len(items) > _MAX_LIST_ITEMS else ""
    return f"<ul>{shown}{more}</ul>"


def _num(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def percent(fraction) -> str:
    """A mismatch fraction as a percentage: two decimals, or two significant digits where those
    would read 0.00% (one element of 2**20 off is 9.5e-05%, never a FAIL "mismatch 0.00%")."""
    text = f"{fraction:.2%}"
    return f"{fraction * 100:.2g}%" if fraction > 0 and text == "0.00%" else text


def cosine_text(row) -> str:
    """A row's cosine, with its distance from 1 where the cosine alone would read 1: a tensor that
    differs must not print as identical (one ulp off: ``1-3.1e-36``)."""
    text = _num(row.get("cosine"))
    distance = row.get("cosine_distance")
    return f"1-{distance:.3g}" if text == "1" and distance else text


def _log_rel(value) -> float:
    if value is None or not math.isfinite(value):
        return 0.0
    return math.log10(max(value, _REL_FLOOR))


def _color(fraction: float) -> str:
    """Dark blue (0) -> yellow -> red (1), a perceptually ordered ramp."""
    stops = [(0.0, (30, 40, 110)), (0.5, (60, 170, 140)), (0.8, (240, 220, 60)), (1.0, (210, 40, 30))]
    fraction = min(max(fraction, 0.0), 1.0)
    for (f0, c0), (f1, c1) in zip(stops, stops[1:]):
        if fraction <= f1:
            t = (fraction - f0) / (f1 - f0)
            return "#%02x%02x%02x" % tuple(round(a + (b - a) * t) for a, b in zip(c0, c1))
    return "#d22820"


def execution_plot(rows: list, title: str, highlight=None) -> str:
    """rel_diff (log scale) of each tensor of one pass along execution order; failures in red.
    Past _MAX_PLOT_POINTS tensors, an even sample of them (and the first divergence)."""
    if len(rows) > _MAX_PLOT_POINTS:
        step = -(-len(rows) // _MAX_PLOT_POINTS)
        title += f" (every {step}th of {len(rows)} tensors)"
        rows = [row for i, row in enumerate(rows) if i % step == 0 or row is highlight]
    width, height, left, right, top, bottom = 900, 320, 60, 20, 30, 70
    plot_w, plot_h = width - left - right, height - top - bottom
    n = max(len(rows), 1)
    lo = math.log10(_REL_FLOOR)

    def x(i):
        return left + (plot_w * (i + 0.5) / n)

    def y(row):
        value = 0.0 if row.get("rel_diff") is None and row["status"] == "ok" else row.get("rel_diff")
        if value is None:  # no numbers (shape error...): draw at the top
            return top
        return top + plot_h * (1 - (_log_rel(value) - lo) / (0 - lo))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{_esc(title)}">',
             f'<text x="{left}" y="18" font-size="14" font-family="sans-serif">{_esc(title)}</text>',
             f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#999"/>']
    for exponent in range(-16, 1, 4):
        gy = top + plot_h * (1 - (exponent - lo) / (0 - lo))
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{gy:.1f}" y2="{gy:.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{gy + 4:.1f}" font-size="11" text-anchor="end" '
                     f'font-family="sans-serif">1e{exponent}</text>')
    parts.append(f'<text x="14" y="{top + plot_h / 2}" font-size="12" font-family="sans-serif" '
                 f'transform="rotate(-90 14 {top + plot_h / 2})" text-anchor="middle">rel_diff</text>')
    points = " ".join(f"{x(i):.1f},{y(row):.1f}" for i, row in enumerate(rows))
    if len(rows) > 1:
        parts.append(f'<polyline points="{points}" fill="none" stroke="#3060b0" stroke-width="1.2"/>')
    step = max(1, len(rows) // 12)
    for i, row in enumerate(rows):
        bad = row["status"] != "ok"
        tip = (f"{row['order']}: {row['name']}  rel_diff {_num(row.get('rel_diff'))}  max_abs "
               f"{_num(row.get('max_abs'))}  {row['status']}")
        radius = 5 if row is highlight else 3
        parts.append(f'<circle cx="{x(i):.1f}" cy="{y(row):.1f}" r="{radius}" fill="{"#d22820" if bad else "#3060b0"}">'
                     f'<title>{_esc(tip)}</title></circle>')
        if i % step == 0:
            parts.append(f'<text x="{x(i):.1f}" y="{top + plot_h + 14}" font-size="10" text-anchor="middle" '
                         f'font-family="sans-serif">{i}</text>')
    if highlight is not None and highlight in rows:
        i = rows.index(highlight)
        parts.append(f'<line x1="{x(i):.1f}" x2="{x(i):.1f}" y1="{top}" y2="{top + plot_h}" stroke="#d22820" '
                     f'stroke-dasharray="4 3"/>')
        anchor = "start" if i < len(rows) / 2 else "end"
        parts.append(f'<text x="{x(i) + (6 if anchor == "start" else -6):.1f}" y="{top + 14}" font-size="12" '
                     f'fill="#d22820" text-anchor="{anchor}" font-family="sans-serif">first divergence: '
                     f'{_esc(highlight["name"])}</text>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{height - 30}" font-size="12" text-anchor="middle" '
                 f'font-family="sans-serif">tensor, in execution (dump) order</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def heatmap(rows: list, title: str) -> str:
    """Max rel_diff per (pass, layer) of one role and rank; tensors outside layers in 'other'."""
    cells: dict = {}
    passes, layers, other = set(), set(), False
    max_kept = -1  # the last pass with cells: rows come in pass order, the first passes are drawn
    for row in rows:
        layer = layer_of(row["name"])
        other |= layer is None
        value = row.get("rel_diff")
        if value is None:
            value = 0.0 if row["status"] == "ok" else 1.0
        passes.add(row["pass"])
        if len(passes) > _MAX_HEATMAP_PASSES and row["pass"] > max_kept:
            continue  # (a pass not drawn: its cells would grow with the dump)
        max_kept = max(max_kept, row["pass"])
        key = (row["pass"], layer)
        worst, failing = cells.get(key, (0.0, 0))
        # A NaN rel_diff is the worst; a failing tensor counts whatever its rel_diff (a NaN on
        # one side only has rel_diff 0: colored alone, its cell read as identical).
        cells[key] = (value if math.isnan(value) or value > worst else worst, failing + (row["status"] != "ok"))
        if layer is not None:
            layers.add(layer)
    pass_list = sorted(passes)[:_MAX_HEATMAP_PASSES]
    if len(passes) > len(pass_list):
        title += f" (first {len(pass_list)} of {len(passes)} passes)"
    columns = sorted(layers)[:_MAX_HEATMAP_LAYERS]
    if len(layers) > len(columns):
        title += f" (first {len(columns)} of {len(layers)} layers)"
    columns += [None] if other else []
    cell_w = max(8, min(40, 800 // max(len(columns), 1)))
    cell_h = max(2, min(20, 500 // max(len(pass_list), 1)))
    left, top = 60, 40
    width = left + cell_w * len(columns) + 120
    height = top + cell_h * len(pass_list) + 50
    lo = math.log10(_REL_FLOOR)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{_esc(title)}">',
             f'<text x="{left}" y="18" font-size="14" font-family="sans-serif">{_esc(title)}</text>']
    for ci, layer in enumerate(columns):
        label = "other" if layer is None else str(layer)
        if len(columns) <= 40 or ci % max(1, len(columns) // 20) == 0:
            parts.append(f'<text x="{left + ci * cell_w + cell_w / 2:.1f}" y="{top - 6}" font-size="10" '
                         f'text-anchor="middle" font-family="sans-serif">{_esc(label)}</text>')
    label_step = max(1, len(pass_list) // 25)
    for ri, pass_id in enumerate(pass_list):
        if ri % label_step == 0:
            parts.append(f'<text x="{left - 6}" y="{top + ri * cell_h + cell_h / 2 + 4:.1f}" font-size="10" '
                         f'text-anchor="end" font-family="sans-serif">{pass_id}</text>')
        for ci, layer in enumerate(columns):
            value, failing = cells.get((pass_id, layer), (None, 0))
            stroke = ""
            if value is None:
                fill, tip = "#e8e8e8", "no tensors"
            else:
                fill = _color((_log_rel(value) - lo) / (0 - lo))
                tip = f"pass {pass_id} layer {'other' if layer is None else layer}: max rel_diff {value:.3g}"
                if failing:  # outlined: failing, whatever the color says
                    tip += f", {failing} failing"
                    stroke = ' stroke="#d22820" stroke-width="2"'
            parts.append(f'<rect x="{left + ci * cell_w}" y="{top + ri * cell_h}" width="{cell_w}" '
                         f'height="{cell_h}" fill="{fill}"{stroke}><title>{_esc(tip)}</title></rect>')
    bar_x = left + cell_w * len(columns) + 30
    for k in range(20):
        parts.append(f'<rect x="{bar_x}" y="{top + k * 10}" width="14" height="10" fill="{_color(1 - k / 19)}"/>')
    parts.append(f'<text x="{bar_x + 18}" y="{top + 8}" font-size="10" font-family="sans-serif">1</text>')
    parts.append(f'<text x="{bar_x + 18}" y="{top + 200}" font-size="10" font-family="sans-serif">1e-16</text>')
    parts.append(f'<text x="{left}" y="{height - 14}" font-size="12" font-family="sans-serif">columns: layer '
                 f'number (max rel_diff over its tensors); rows: pass; outlined in red: a tensor fails</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _table(header: list, rows: list) -> str:
    out = ["<table><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in header) + "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{_esc(cell)}</td>" for cell in row) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def render(result) -> str:
    first = result.first_divergence
    verdict = "PASS" if result.ok else ("FAIL" if result.exit_code == 1 else "ERROR")
    body = [f"<h1>fastdump diff: {verdict}</h1>",
            _table(["", ""], [["baseline", " + ".join(result.baseline)], ["target", " + ".join(result.target)],
                              ["compared", result.compared], ["failed", result.failed],
                              ["missing", len(result.missing)], ["problems", len(result.problems)],
                              ["notes", len(result.notes)],
                              ["tolerance", ("|a-b| <= atol + rtol*|b|, " if "allclose" in dict(result.options.metrics)
                                             else "") + result.options.criteria()],
                              ["options", result.options.as_dict()]])]
    if result.notes:  # they qualify the verdict (an incomplete dump or pass), so they come before it is explained
        body.append("<h2>Notes</h2>" + _items(result.notes, str))
    if first is not None:
        body.append(f'<p class="first">First divergence: <b>{_esc(first["name"])}</b> — {_esc(_where(first))}; '
                    f'max_abs {_num(first.get("max_abs"))}, rel_diff {_num(first.get("rel_diff"))}'
                    + (f', {_esc(first.get("reason"))}' if first.get("reason") else "") + "</p>")
        focus = (first["role"], first["rank"], first.get("dp_rank"), first["pass"])
    else:
        body.append(f"<p>{_esc(result.headline())}</p>")  # (missing ranks or read problems: not a pass)
        row = next(iter(result.rows), None)
        focus = (row["role"], row["rank"], row.get("dp_rank"), row["pass"]) if row else None
    if focus is not None:  # one rank of one DP replica (rank numbers repeat per replica)
        where = f"{focus[0]} rank {focus[1]}" + (f" (dp {focus[2]})" if focus[2] is not None else "")
        # (the rows are read one at a time: a large diff keeps them in a file)
        pass_rows = [r for r in result.rows if (r["role"], r["rank"], r.get("dp_rank"), r["pass"]) == focus]
        # (rows read back from a file are copies: the first divergence is found among them)
        highlight = None if first is None else next((r for r in pass_rows if r == first), None)
        body.append("<h2>Error per module along execution order</h2>")
        body.append(execution_plot(pass_rows, f"{where} pass {focus[3]}", highlight=highlight))
        unit_rows = (r for r in result.rows if (r["role"], r["rank"], r.get("dp_rank")) == focus[:3])
        body.append("<h2>rel_diff by pass and layer</h2>")
        body.append(heatmap(unit_rows, f"{where}: max rel_diff per pass x layer"))
    body.append(f"<h2>Failing tensors ({result.failed})</h2>")
    body.append(_table(
        ["role", "rank", "pass", "base pass", "#", "name", "shape", "dtype", "max_abs", "max_rel", "rel_diff",
         "cosine", "mismatch", "reason"],
        [[r["role"], r["rank"], r["pass"], r["baseline_pass"], r["order"], r["name"], r.get("shape", "-"),
          f"{r.get('baseline_dtype', '-')}/{r.get('dtype', '-')}", _num(r.get("max_abs")), _num(r.get("max_rel")),
          _num(r.get("rel_diff")), cosine_text(r),
          "-" if r.get("mismatch") is None else percent(r["mismatch"]), r.get("reason", "")]
         for r in itertools.islice(result.iter_failures(), _MAX_TABLE_ROWS)]))
    if result.failed > _MAX_TABLE_ROWS:
        body.append(f"<p>… {result.failed - _MAX_TABLE_ROWS} more (see --json)</p>")
    if result.missing:
        body.append(f"<h2>Missing ({len(result.missing)})</h2>" + _items(result.missing, _missing_text))
    if result.problems:
        body.append(f"<h2>Problems ({len(result.problems)})</h2>" + _items(result.problems, str))
    style = ("body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px;text-align:left}"
             ".first{font-size:16px;color:#a01010}svg{display:block;margin:8px 0}")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"/><title>fastdump diff</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def not_a_report_file(path: str):
    """Why the report cannot be written at ``path`` (which exists and is no regular file), or None.
    It is renamed into place, which replaces whatever is there: `--html /dev/null` run as root
    replaced the device node with the report; a FIFO or a link was replaced the same way."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be written ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    kind = "a directory" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode) else \
        "a device, FIFO or socket"
    return f"is {kind}, not a regular file: writing the report would replace it"


def write_html(result, path) -> str:
    """Write the report atomically (a half-written report is never left under its name)."""
    from . import fsutil

    path = os.fspath(path)
    why = not_a_report_file(path)
    if why:
        raise ValueError(f"{path}: {why}")
    # A dump name may hold a lone surrogate (any Python str is a name): written as \udXXX, never
    # an encoding error that leaves no report.
    fsutil.atomic_write_bytes(path, render(result).encode("utf-8", "backslashreplace"), durable=False)
    return path


# --- how a row, a missing item and a layer are described: shared by the text and HTML renderings


_LAYER_RE = re.compile(r"(?:^|\.)layers?\.(\d+)(?:\.|$|#)")


def layer_of(name: str):
    """Layer number in a module name (``model.layers.7.mlp`` -> 7), or None."""
    match = _LAYER_RE.search(name)
    return int(match.group(1)) if match else None


def _where(row) -> str:
    passes = f"pass {row['pass']}" if row["baseline_pass"] == row["pass"] else \
        f"pass {row['pass']} (baseline {row['baseline_pass']})"
    dp = f" (dp {row['dp_rank']})" if row.get("dp_rank") is not None else ""  # rank numbers repeat per replica
    return f"{row['role']} rank {row['rank']}{dp} {passes}"


def _missing_text(item) -> str:
    if item["kind"] == "role":
        return f"role {item['role']!r} only in the {item['only_in']}"
    dp = f" (dp {item['dp_rank']})" if item.get("dp_rank") is not None else ""  # rank numbers repeat per DP replica
    if item["kind"] == "rank":
        return f"role {item['role']} rank {item['rank']}{dp} only in the {item['only_in']} ({item['path']})"
    if item["kind"] == "stage_passes":  # its names are unknown: what that stage dumps was not compared
        return (f"role {item['role']} rank {item['rank']}: passes {_span(item['passes'])} missing on every rank of "
                f"the {item['side']}'s pp stage {item['pp_rank']} (the other stages ran them)")
    if item["kind"] == "rank_without_passes":  # a rank whose data is absent: the diff fails
        return (f"role {item['role']} rank {item['rank']}{dp}: no pass on the {item['side']} ({item['path']}), passes "
                f"{_span(item['passes'])} only in the {item['only_in']}: not compared")
    if item["kind"] == "rank_passes":  # lost on both sides: no name to compare, the diff fails
        return (f"role {item['role']} rank {item['rank']}{dp}: passes {_span(item['passes'])} missing on both sides' "
                f"rank (other ranks of its DP replica ran them): not compared")
    if item["kind"] == "passes":
        return (f"role {item['role']} rank {item['rank']}{dp}: passes {_span(item['passes'])} only in the "
                f"{item['only_in']}")
    return f"role {item['role']} rank {item['rank']}{dp}: {item['name']!r} only in the {item['only_in']} " \
           f"(passes {_runs_text(item)})"


class PassRuns:
    """Pass ids, added in increasing order, as runs of consecutive ids in bounded memory: the first
    ``MAX_RUNS`` runs and the last one, the count of ids and of the runs left out between them.
    A name on one side only is missing in up to every pass: a list of its pass ids grew with
    passes x names (40k passes x 1000 names: 40M ints held until the diff ended)."""

    MAX_RUNS = 8

    def __init__(self, ids=()):
        self.count = 0
        self.runs: list = []  # [first, last] of the first MAX_RUNS runs
        self.last = None  # the run being extended
        self.elided_runs = 0  # runs between self.runs and self.last, not kept
        for pass_id in ids:
            self.add(pass_id)

    def add(self, pass_id: int) -> None:
        self.count += 1
        if self.last is not None and pass_id == self.last[1] + 1:
            self.last[1] = pass_id
            return
        if self.last is not None:
            if len(self.runs) < self.MAX_RUNS:
                self.runs.append(self.last)
            else:
                self.elided_runs += 1
        self.last = [pass_id, pass_id]

    def as_item(self) -> dict:
        """The JSON fields of a missing item: ``pass_count``, ``pass_ranges`` ([[first, last], ...]),
        and ``pass_ranges_elided`` (runs not listed, between the last two) when some are not."""
        item = {"pass_count": self.count, "pass_ranges": self.runs + ([self.last] if self.last else [])}
        if self.elided_runs:
            item["pass_ranges_elided"] = self.elided_runs
        return item


def _runs_text(item: dict) -> str:
    """'0-99,120,121 (102)': runs of pass ids as ranges; the count where it is not plain; a note
    where runs were left out ('0,2,4, … 5 more ranges …, 30 (17)')."""
    def run(first, last):
        return str(first) if first == last else f"{first},{last}" if last == first + 1 else f"{first}-{last}"

    ranges = [run(*r) for r in item["pass_ranges"]]
    elided = item.get("pass_ranges_elided", 0)
    if elided:
        ranges.insert(len(ranges) - 1, f"… {elided} more range{'s' if elided > 1 else ''} …")
    plain = not elided and all(last - first <= 1 for first, last in item["pass_ranges"])  # every id printed
    return ",".join(ranges) + ("" if plain else f" ({item['pass_count']} passes)")


def _span(ids: list) -> str:
    return _runs_text(PassRuns(ids).as_item())


# ------------------------------------------------------------------------------------------ main
