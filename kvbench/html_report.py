"""One self-contained HTML page for `kvbench report --format html`.

The page opens with the summary (kvbench.summary: the machine in one line, the headline
figures, the runs side by side) before the detail, where each group's figures stay open
and its raw records are folded in a collapsed <details>. Figures are PNGs embedded as
base64 data URIs and the style is inline, so the page reads offline from a single file.
Each figure carries the exact commands that produced its records; each environment is a
card. A small inline script marks `<body>` with `data-figures="N/M"` (images decoded /
images present) once the page has loaded, which the browser test reads from the DOM.
"""

from __future__ import annotations

import base64
from html import escape

from kvbench.report import REFERENCE, Report, env_summary
from kvbench.summary import COLUMNS, Summary

_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px}
.cards{display:flex;flex-wrap:wrap;gap:12px}
.card{border:1px solid #bbb;border-radius:6px;padding:8px 12px;background:#f7f9fb;flex:1 1 420px}
.card dt{font-weight:600;float:left;width:80px}.card dd{margin:0 0 4px 88px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#eef}tr.projected td{font-style:italic;color:#8a2be2}
tr.waived td{color:#a67c00}tr.error td{color:#c00}
.legend span{margin-right:16px}.proj{color:#8a2be2;font-style:italic}
figure{display:inline-block;margin:8px;border:1px solid #ddd;padding:6px;max-width:100%}
figure img{max-width:100%}figcaption{font-size:13px;font-weight:600}
pre{background:#f4f4f4;padding:6px;font-size:12px;white-space:pre-wrap;margin:4px 0}
.warn{color:#a67c00}.machine{font-size:15px;margin:4px 0}
details{margin:8px 0}summary{cursor:pointer;color:#225}
"""

_SCRIPT = """
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute('data-figures', ok + '/' + imgs.length);
});
"""


def _table(head: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    cls = classes or [""] * len(rows)
    body = "".join(f'<tr class="{c}">' + "".join(f"<td>{escape(x)}</td>" for x in row) + "</tr>"
                   for row, c in zip(rows, cls, strict=True))
    return ("<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"
            + body + "</table>")


def _img(path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{escape(path.stem)}" src="data:image/png;base64,{data}">'


def _summary(s: Summary) -> list[str]:
    """The opening section: machine lines, headline figures, the runs compared."""
    parts = ['<h2 id="summary">Summary</h2>']
    parts += [f'<p class="machine"><b>machine</b> {escape(m)}</p>' for m in s.machines]
    if s.headlines:
        parts.append(_table(["headline", "figure", "measured at"], s.headlines))
    if s.by_machine:
        parts.append("<h3>Machines side by side</h3>")
        parts.append(_table(s.by_machine[0], s.by_machine[1:]))
    if s.runs:
        parts.append(f"<p><b>runs compared</b> ({escape(s.common)})</p>")
        parts.append(_table(COLUMNS, s.runs))
    for title, head, rows in s.sweeps:
        parts.append(f"<h3>{escape(title)}</h3>")
        parts.append(_table(head, rows))
    parts += [f'<p class="note">{escape(n)}</p>' for n in s.notes]
    return parts


def render(rep: Report) -> str:
    """The whole page as one string (images inline)."""
    parts = [f"<h1>kvbench report: {escape(', '.join(p.name for p in rep.files))}</h1>",
             *_summary(rep.summary),
             '<p class="legend"><span>measured values: plain, solid lines, filled boxes</span>'
             '<span class="proj">projected values: italic, dashed lines, hatched boxes, '
             'labelled (projected)</span></p>', "<h2>Environment</h2>", '<div class="cards">']
    for env_id, env in rep.envs.items():
        items = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>"
                        for k, v in env_summary(env).items())
        parts.append(f'<div class="card"><b>env {escape(env_id)}</b><dl>{items}</dl></div>')
    parts.append("</div>")
    for g in rep.groups:
        parts.append(f"<h2>{escape(g.title)}</h2>")
        for f in g.figures:
            cmds = escape("\n".join(f.commands) or "(no command recorded)")
            parts.append(f"<figure>{_img(f.path)}<figcaption>{escape(f.title)}</figcaption>"
                         f"<pre>{cmds}</pre></figure>")
        ok = g.ok()
        if ok:
            parts.append(f"<details><summary>{len(ok)} records of {escape(g.title)}"
                         "</summary>")
            parts.append(_table(["name", "metric", "params", "value", "status"],
                                [rep.row(r) for r in ok],
                                ["projected" if r["provenance"] == "projected" else ""
                                 for r in ok]))
            parts.append("</details>")
        bad = g.not_ok()
        if bad:
            parts.append("<p>Not measured here:</p>" + _table(
                ["name", "metric", "params", "value", "status and reason"],
                [rep.row(r) for r in bad], [r["status"] for r in bad]))
    if rep.accuracy:
        parts.append("<h2>Accuracy (perplexity, lower is better)</h2>")
        parts.append(_table(["strategy", "params", "perplexity", f"{REFERENCE} reference",
                             "change"], rep.accuracy))
    parts += [f'<p class="warn">warning: {escape(w)}</p>' for w in rep.warnings]
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>kvbench report</title>"
            f"<style>{_STYLE}</style><script>{_SCRIPT}</script></head><body>"
            + "\n".join(parts) + "</body></html>\n")
