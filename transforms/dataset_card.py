"""The index files a webdataset output carries for its readers, as pure functions of the shards' sample counts.

    {output}/dataset.json   wids' shard index: {"__kind__": "wids-shard-index-v1", "wids_version": 1,
                            "shardlist": [{"url": "shards/00000.tar", "nsamples": n}, ...]} (URLs relative to it)
    {output}/sizes.json     open_clip's {"00000.tar": n, ...}
    {output}/README.md      a Hugging Face dataset card whose YAML `configs:` block points `datasets` at the tars
                            (`load_dataset(OUTPUT)` would otherwise pick the json loader: most files are .json),
                            and how to read the shards with webdataset, wids, datasets and open_clip

Every output's card (the files output's too, `files_card`) ends with `stats_section`: the label counts per slot,
the near-duplicate groups and the errors by kind, with their plots under card/ (transforms/dataset_report.py).
"""

from __future__ import annotations

from . import score_views, shards

WIDS_INDEX = "dataset.json"
SIZES_FILE = "sizes.json"
CARD_FILE = "README.md"


def wids_index(infos: list[dict]) -> dict:
    """`infos`: [{"shard": n, "nsamples": k}, ...] -> the wids index, shards in order."""
    return {"__kind__": "wids-shard-index-v1", "wids_version": 1,
            "shardlist": [{"url": shards.shard_relpath(i["shard"]), "nsamples": int(i["nsamples"])}
                          for i in sorted(infos, key=lambda i: i["shard"])]}


def sizes(infos: list[dict]) -> dict:
    return {shards.shard_name(i["shard"]): int(i["nsamples"]) for i in sorted(infos, key=lambda i: i["shard"])}


def brace_range(infos: list[dict]) -> str:
    """The shards as one brace-expansion URL pattern (`shards/{00000..00012}.tar`), as webdataset takes them."""
    numbers = sorted(i["shard"] for i in infos)
    if not numbers:
        return f"{shards.SHARDS_DIR}/*.tar"
    if len(numbers) == 1:
        return shards.shard_relpath(numbers[0])
    return f"{shards.SHARDS_DIR}/{{{numbers[0]:05d}..{numbers[-1]:05d}}}.tar"


def card(output: str, infos: list[dict], samples_per_shard: int, image_extension: str,
         quantize: str = "none", score_names: tuple[str, ...] = ()) -> str:
    """README.md: the `configs:` block `datasets` reads, what made the images (with the model's quantization), then
    how to load the shards with each reader; with `score_names`, their histograms (transforms/score_card.py)."""
    made = ("The model ran with int8 weights and activations in its projections (`--quantize int8`): the images "
            "differ from the unquantized model's pixel by pixel; every sample's `quantize` field says so."
            if quantize == "int8" else
            "The model ran unquantized (`--quantize none`, every sample's `quantize` field).")
    total = sum(int(i["nsamples"]) for i in infos)
    pattern = brace_range(infos)
    base = output.rstrip("/")
    if base.startswith("gs://"):
        url, local = f"pipe:gcloud storage cat {base}/{pattern}", base.rsplit("/", 1)[-1]
    else:
        url, local = f"{base}/{pattern}", base
    return f"""---
configs:
- config_name: default
  data_files: [{{split: train, path: "{shards.SHARDS_DIR}/*.tar"}}]
---
# Generated images (FLUX.2 [klein], WebDataset shards)

{total} images in {len(infos)} shards of at most {samples_per_shard} samples, img2dataset's layout: each sample is
`KEY.{image_extension}` (the image), `KEY.json` (its manifest row: prompt, seed, height, width, steps, guidance,
model, sha256, ... and `key`) and `KEY.txt` (the prompt). Next to each `shards/NNNNN.tar`: `NNNNN_stats.json`
(written last: the shard is complete) and `NNNNN.parquet` (every sample of the shard, failed ones included).
`dataset.json` is a `wids` index, `sizes.json` open_clip's. Failed images are never in a tar; see `errors/`.
{made}

## Read the shards

webdataset (`gs://` through the gcloud CLI):

```python
import webdataset as wds
ds = wds.WebDataset("{url}", shardshuffle=False).decode("pil").to_tuple("{image_extension}", "json")
```

Hugging Face datasets (this card's `configs:` block selects the tars; from gs://, a local copy first:
`gcloud storage cp -r {base} .`):

```python
import datasets
ds = datasets.load_dataset("{local}", split="train")
# columns {image_extension}, json, txt, __key__, __url__
```

wids (random access): `wids.ShardListDataset("{base}/{WIDS_INDEX}")`. open_clip:
`--train-data '{base}/{pattern}' --dataset-type webdataset --train-num-samples {total}` (`sizes.json` has the counts).
""" + ("\n" + score_views.card_section(score_names) if score_names else "")


STATS_MARKER = "<!-- dataset statistics (written after every image) -->"
PLOTS_DIR = "card"
LABELS_PLOT = "labels.png"
ERRORS_PLOT = "errors.png"


def files_card(output: str, image_extension: str) -> str:
    """README.md of a files output: what it holds and how `datasets` reads it (imagefolder, metadata.jsonl)."""
    return f"""# Generated images (FLUX.2 [klein])

`images/` holds one `.{image_extension}` per image; `metadata.jsonl` has every image's manifest row (`file_name`
relative to this folder: prompt, seed, size, steps, guidance, model, sha256, phash, and each record's labels under
`metadata`), which is what Hugging Face `datasets`' imagefolder reads:

```python
import datasets
ds = datasets.load_dataset("imagefolder", data_dir="{output.rstrip("/")}", split="train")
```
"""


def stats_section(stats: dict) -> str:
    """The card's closing section: label counts per slot, near-duplicate groups, errors by kind (figures and the
    plots' relative links)."""
    lines = [STATS_MARKER, "## Labels, near duplicates and errors", ""]
    labels = stats.get("labels") or {}
    if labels:
        slots = ", ".join(f"`{slot}` ({len(values)} values)" for slot, values in labels.items())
        lines += [f"{stats['images']} images labelled by {slots}.", "",
                  f"![Images per label]({PLOTS_DIR}/{LABELS_PLOT})", ""]
    else:
        lines += [f"{stats['images']} images; their records carry no labels.", ""]
    groups, largest = stats.get("duplicate_groups", 0), stats.get("largest_group")
    if groups:
        lines += [f"{groups} near-duplicate groups (`duplicates/`) hold {stats['images_in_groups']} images; the "
                  f"largest has {largest['size']} ({', '.join(f'`{i}`' for i in largest['ids'][:5])}"
                  f"{', ...' if largest['size'] > 5 else ''}).", ""]
    else:
        lines += ["No near-duplicate images (`duplicates/` is empty).", ""]
    errors = stats.get("errors_by_kind") or {}
    if errors:
        listed = ", ".join(f"{kind}: {n}" for kind, n in errors.items())
        lines += [f"{sum(errors.values())} error rows (`errors/`): {listed}.", "",
                  f"![Errors by kind]({PLOTS_DIR}/{ERRORS_PLOT})", ""]
    else:
        lines += ["No error rows.", ""]
    return "\n".join(lines)


def with_stats(card_text: str, stats: dict) -> str:
    """`card_text` with its statistics section replaced by (or added as) the one of `stats`."""
    base = card_text.split(STATS_MARKER, 1)[0].rstrip("\n")
    return f"{base}\n\n{stats_section(stats)}"
