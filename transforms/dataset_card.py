"""The index files a webdataset output carries for its readers, as pure functions of the shards' sample counts.

    {output}/dataset.json   wids' shard index: {"__kind__": "wids-shard-index-v1", "wids_version": 1,
                            "shardlist": [{"url": "shards/00000.tar", "nsamples": n}, ...]} (URLs relative to it)
    {output}/sizes.json     open_clip's {"00000.tar": n, ...}
    {output}/README.md      a Hugging Face dataset card whose YAML `configs:` block points `datasets` at the tars
                            (`load_dataset(OUTPUT)` would otherwise pick the json loader: most files are .json),
                            and how to read the shards with webdataset, wids, datasets and open_clip
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
