"""The page of benchmarks/quality.py: `{output}/index.html`, each image's reference | quantized | amplified difference
side by side, worst first, in the look of the job's preview gallery (transforms/preview.py's PAGE_STYLE).

Every text on it goes through html.escape (prompts and ids are user data: `<script>` must stay text); every link is
a quoted path relative to the page, so the folder opens locally or copied. A pure function of the report.
"""

from __future__ import annotations

import html
import math
import urllib.parse

from transforms.preview import PAGE_STYLE

STYLE = """main { display: grid; gap: 16px; }
section { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px; }
section.flagged { border: 2px solid #c62828; }
section h2 { font-size: 14px; margin: 0 0 4px 0; font-weight: normal; overflow-wrap: anywhere; }
.trio { display: grid; grid-template-columns: repeat(3, minmax(0, 1fr)); gap: 8px; margin-top: 6px; }
.trio figure img { width: 100%; }
.flag { color: #c62828; font-weight: bold; }
.missing { color: #c62828; font-size: 12px; padding: 2em 0; text-align: center; }
table { border-collapse: collapse; margin: 0.5em 0 1em 0; font-size: 13px; }
td, th { border: 1px solid #ddd; padding: 2px 8px; text-align: right; background: #fff; }
th:first-child, td:first-child { text-align: left; }
details { margin-bottom: 1em; font-size: 13px; }"""


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def link(relpath: str) -> str:
    """A path relative to the page as a quoted relative URL."""
    return urllib.parse.quote(relpath, safe="/")


def format_psnr(value) -> str:
    if value is None:
        return "–"
    return "identical" if math.isinf(value) else f"{value:.2f} dB"


def format_ssim(value) -> str:
    return "–" if value is None else f"{value:.4f}"


def _figure(relpath: str | None, caption: str, alt: str) -> str:
    if relpath is None:
        return f'<figure><div class="missing">no image</div><figcaption>{_e(caption)}</figcaption></figure>'
    url = _e(link(relpath))
    return (f'<figure><a href="{url}"><img src="{url}" alt="{_e(alt)}" loading="lazy"></a>'
            f'<figcaption>{_e(caption)}</figcaption></figure>')


def _row(rank: int, image: dict, labels: dict) -> str:
    flag = ' <span class="flag">look at this</span>' if image["flagged"] else ""
    error = f'<br><span class="flag">{_e(image["error"])}</span>' if image.get("error") else ""
    head = (f'#{rank} <b>{_e(image["id"])}</b> &middot; {_e(image["file"])} &middot; seed {_e(image["seed"])} '
            f'&middot; {_e(image["width"])}x{_e(image["height"])} &middot; PSNR {_e(format_psnr(image["psnr"]))} '
            f'&middot; SSIM {_e(format_ssim(image["ssim"]))} &middot; max |diff| '
            f'{_e("–" if image["max_abs"] is None else image["max_abs"])}{flag}{error}')
    figures = [_figure(image["reference"], labels["reference"], f'{image["id"]}: {labels["reference"]}'),
               _figure(image["candidate"], labels["candidate"], f'{image["id"]}: {labels["candidate"]}'),
               _figure(image["diff"], labels["diff"], f'{image["id"]}: {labels["diff"]}')]
    css = ' class="flagged"' if image["flagged"] else ""
    return (f'<section{css}><h2>{head}</h2><span class="p">{_e(image["prompt"])}</span>'
            f'<div class="trio">{"".join(figures)}</div></section>')


def _distribution_table(report: dict) -> str:
    keys = ("min", "p5", "median", "mean", "max")
    rows = []
    for name, fmt in (("psnr", format_psnr), ("ssim", format_ssim)):
        stats = report["distribution"][name]
        cells = "".join(f"<td>{_e(fmt(stats.get(k)))}</td>" for k in keys)
        rows.append(f"<tr><td>{name.upper()}</td>{cells}</tr>")
    head = "".join(f"<th>{k}</th>" for k in ("",) + keys)
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _skipped(report: dict) -> str:
    skipped = report["skipped"]
    if not skipped:
        return ""
    items = "".join(f"<li>{_e(row.get('source'))}:{_e(row.get('line'))}: {_e(row.get('reason'))}</li>"
                    for row in skipped)
    return f"<details><summary>{len(skipped)} record(s) skipped</summary><ul>{items}</ul></details>"


def render(report: dict, *, reference_label: str, candidate_label: str, diff_label: str, result_file: str) -> str:
    """`report`: quality.py's result, its `images` worst first, each with the relative paths `reference`,
    `candidate` and `diff` (None where there is no such image) -> the page."""
    labels = {"reference": reference_label, "candidate": candidate_label, "diff": diff_label}
    title = f"Quantization check: {candidate_label} against {reference_label}"
    thresholds = report["thresholds"]
    rows = [_row(i + 1, image, labels) for i, image in enumerate(report["images"])]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
{PAGE_STYLE}
{STYLE}
</style></head>
<body><h1>{_e(title)}</h1>
<p>Model {_e(report["model"])} &middot; {len(report["images"])} image(s), worst first (lowest SSIM, then PSNR)
&middot; <span{' class="flag"' if report["flagged"] else ""}>{report["flagged"]} flagged</span> (PSNR below
{thresholds["psnr"]:g} dB or SSIM below {thresholds["ssim"]:g}, or not compared: look at these) &middot;
<a href="{_e(link(result_file))}">{_e(result_file)}</a></p>
{_distribution_table(report)}
{_skipped(report)}
<main>
{chr(10).join(rows)}
</main></body></html>
"""
