"""The scores where people look at a dataset: the preview page's sort control and captions, and the dataset
card's histograms (one PNG per score, drawn with matplotlib). Pure rendering: no Beam, no I/O.
"""

from __future__ import annotations

import html
import io
import json

SORT_SCRIPT = """<script>
(function () {
  var select = document.getElementById("sort"), main = document.querySelector("main");
  var cards = Array.prototype.slice.call(main.children);
  select.addEventListener("change", function () {
    var key = select.value.split("|"), name = key[0], desc = key[1] === "desc";
    var sorted = cards.slice().sort(function (a, b) {
      if (name === "id") { return 0; }
      var x = JSON.parse(a.dataset.scores)[name], y = JSON.parse(b.dataset.scores)[name];
      if (x === null || x === undefined) { return 1; }
      if (y === null || y === undefined) { return -1; }
      return desc ? y - x : x - y;
    });
    if (name === "id") { sorted = cards; }
    sorted.forEach(function (card) { main.appendChild(card); });
  });
})();
</script>"""


def score_names(rows) -> list[str]:
    """The scores the rows carry, in their first appearance's order."""
    names: dict[str, None] = {}
    for row in rows:
        for name in (row.get("scores") or {}):
            names.setdefault(name, None)
    return list(names)


def sort_control(names: list[str]) -> str:
    """The page's <select> that orders the cards by id or by a score, high or low first ("" without scores)."""
    if not names:
        return ""
    e = lambda v: html.escape(str(v), quote=True)  # noqa: E731
    options = ['<option value="id|asc">id</option>']
    for name in names:
        options.append(f'<option value="{e(name)}|desc">{e(name)}, highest first</option>')
        options.append(f'<option value="{e(name)}|asc">{e(name)}, lowest first</option>')
    return f'<p><label>Sort by <select id="sort">{"".join(options)}</select></label></p>'


def card_attributes(item: dict) -> str:
    """A card's data-scores attribute (JSON, escaped) for the sort script ("" without scores)."""
    if item.get("scores") is None:
        return ""
    return f' data-scores="{html.escape(json.dumps(item["scores"]), quote=True)}"'


def card_caption(item: dict) -> str:
    """The scores under a card's image, and the filter that left it out of the dataset ("" without scores)."""
    scores = item.get("scores")
    if scores is None:
        return ""
    e = lambda v: html.escape(str(v), quote=True)  # noqa: E731
    shown = " &middot; ".join(f"{e(k)} {'-' if v is None else f'{v:.3g}'}" for k, v in scores.items())
    out = f'<br><span class="s">{shown}</span>'
    if item.get("filtered"):
        f = item["filtered"]
        out += f'<br><b class="f">filtered: {e(f.get("rule"))} (value {e(f.get("value"))})</b>'
    return out


def histogram_png(name: str, values: list[float], *, bins: int = 30) -> bytes:
    """A histogram of one score's values as PNG bytes (matplotlib, its Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.0, 2.6), dpi=100)
    ax = fig.add_subplot()
    ax.hist([v for v in values if v is not None], bins=bins, color="#4477aa")
    ax.set_title(name, fontsize=10)
    ax.set_xlabel("score", fontsize=8)
    ax.set_ylabel("images", fontsize=8)
    ax.tick_params(labelsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def histogram_file_name(name: str) -> str:
    """`scores/NAME.png` with the score's name made file-safe (labels hold spaces and colons)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
    return f"scores/{safe}.png"


def card_section(names, *, beside: bool = False) -> str:
    """The dataset card's section on the scores: one histogram per score ("" without scores); `beside`: the links
    for a page inside scores/ itself."""
    if not names:
        return ""
    lines = ["## Scores", "", "Every image's `scores` (its manifest row, and `KEY.json` in a shard): "
             "clip_score, the zero-shot labels' probabilities and the heads' values; images a score filter left out "
             "are under `filtered/`, not in the dataset.", ""]
    lines += [f"![{name}]({histogram_file_name(name).split('/', 1)[1] if beside else histogram_file_name(name)})"
              for name in names]
    return "\n".join(lines) + "\n"
