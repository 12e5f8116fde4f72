"""WebDataset shard layout (transforms/shards.py), shard placement (transforms/sinks/webdataset.py) and the indexes
(transforms/dataset_card.py): pure functions, checked against the readers' own rules (tarfile, webdataset, yaml)."""

import hashlib
import io
import json
import math
import tarfile

import pytest
import yaml

from transforms import dataset_card, shards
from transforms.sinks.webdataset import block_offsets


@pytest.mark.parametrize("per_shard", [1, 2, 9, 10, 11, 999, 1000, 1001, 10_000, 123_456])
def test_keys_follow_img2dataset(per_shard):
    # img2dataset: key = shard * 10**ceil(log10(samples_per_shard)) + index, 9 digits
    mult = 10 ** math.ceil(math.log10(per_shard))
    assert shards.key_multiplier(per_shard) == mult
    for shard, index in [(0, 0), (3, per_shard - 1), (12, per_shard // 2)]:
        key = shards.sample_key(shard, index, per_shard)
        assert key == str(shard * mult + index).zfill(9) and key.isdigit()


def test_positions_fill_shards_in_order_and_bad_values_are_typed_errors():
    assert [shards.shard_of(p, 3) for p in range(7)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(shards.ShardLayoutError) as e:
            shards.check_samples_per_shard(bad)
        assert e.value.value == bad
    with pytest.raises(shards.ShardLayoutError):
        shards.sample_key(0, 5, 5)
    assert shards.shard_number_of_stats("gs://b/out/shards/00012_stats.json") == 12
    assert shards.shard_number_of_stats("/x/shards/00012.tar") is None


def _sample(key, prompt="a cat", ext="png", data=b"\x89PNG fake"):
    row = {"id": f"id-{key}", "prompt": prompt, "uri": "gs://b/out/shards/00000.tar", "generation_ms": 12.5,
           "metadata": {}, "sha256": hashlib.sha256(data).hexdigest(), "key": key}
    return shards.Sample(key, ext, data, row)


def test_tar_is_reproducible_sorted_and_readable_by_webdataset(tmp_path):
    samples = [_sample("000000002"), _sample("000000000", prompt="<b>é</b>"), _sample("000000001", ext="jpg")]
    first = shards.tar_bytes(samples, 0)
    assert shards.tar_bytes(list(reversed(samples)), 0) == first  # same samples, same bytes
    with tarfile.open(fileobj=io.BytesIO(first)) as tar:
        infos = tar.getmembers()
        names = [i.name for i in infos]
        assert names == sorted(names)  # a sample's members adjacent, keys in order
        assert all((i.mtime, i.uid, i.gid, i.uname, i.gname, i.mode) == (0, 0, 0, "", "", 0o644) for i in infos)
        meta = json.loads(tar.extractfile("000000000.json").read())
        assert meta["prompt"] == "<b>é</b>" and meta["key"] == "000000000"
        assert meta["uri"] == "shards/00000.tar" and meta["generation_ms"] is None  # run-independent
        assert tar.extractfile("000000000.txt").read().decode() == "<b>é</b>"
    path = tmp_path / "00000.tar"
    path.write_bytes(first)
    import webdataset as wds

    got = list(wds.WebDataset(str(path), shardshuffle=False))
    assert [s["__key__"] for s in got] == ["000000000", "000000001", "000000002"]
    assert set(got[1]) >= {"jpg", "json", "txt"} and got[0]["png"] == b"\x89PNG fake"


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o077, 0o600)])
def test_tar_members_get_the_mode_the_umask_allows(mask, mode):
    """As the job's local files: a private umask keeps the images extracted from a shard private too."""
    import os

    old = os.umask(mask)
    try:
        data = shards.tar_bytes([_sample("000000000"), _sample("000000001", ext="jpg")], 0)
    finally:
        os.umask(old)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert {i.mode for i in tar.getmembers()} == {mode}


def test_write_tar_refuses_keys_out_of_order():
    with pytest.raises(shards.ShardLayoutError):
        shards.write_tar(io.BytesIO(), [_sample("000000002"), _sample("000000001")], 0)


def test_stats_completeness_and_sidecar_round_trip():
    stats = shards.shard_stats(4, count=3, successes=3, failures=0, duration_s=1.0, start_time=0, end_time=1)
    assert shards.is_complete(stats, 3) and not shards.is_complete(stats, 4)
    assert not shards.is_complete(dict(stats, failures=1, successes=2), 3)
    row = {"id": "a", "file_name": "000000000.png", "uri": "u", "prompt": "p", "prompt_truncated": False,
           "seed": 1, "height": 32, "width": 64, "num_inference_steps": 4, "guidance_scale": 1.0, "model": "m",
           "sha256": "s", "bytes": 3, "crc32c": "AAAAAA==", "generation_ms": 1.5, "metadata": {"lang": "en"},
           "source": "f", "line": 2, "key": "000000000", "request_fingerprint": "rfp", "model_fingerprint": "mfp",
           "phash": "00ff00ff00ff00ff"}
    data = shards.sidecar_bytes([shards.success_sidecar_row(row)], shards.Digest(10240, "mnG7TA=="))
    back = shards.read_sidecar(data)
    assert back[0] == dict(row, status="success", error_message=None, metadata='{"lang": "en"}',
                           quantize=None, dtype=None)  # a row that names neither
    assert shards.sidecar_tar(data) == shards.Digest(10240, "mnG7TA==")  # the sidecar names its tar
    assert shards.sidecar_tar(shards.sidecar_bytes([])) is None  # as one written before it did
    marked = shards.shard_stats(4, count=3, successes=3, failures=0, duration_s=1.0, start_time=0, end_time=1,
                                tar=shards.Digest(10240, "mnG7TA=="), sidecar=shards.Digest(7, "AAAAAA=="))
    assert shards.marker_digests(marked) == (shards.Digest(10240, "mnG7TA=="), shards.Digest(7, "AAAAAA=="))
    assert shards.marker_digests(stats) is None


def test_indexes_and_card():
    infos = [{"shard": 1, "nsamples": 2}, {"shard": 0, "nsamples": 3}]
    assert dataset_card.wids_index(infos) == {
        "__kind__": "wids-shard-index-v1", "wids_version": 1,
        "shardlist": [{"url": "shards/00000.tar", "nsamples": 3}, {"url": "shards/00001.tar", "nsamples": 2}]}
    assert dataset_card.sizes(infos) == {"00000.tar": 3, "00001.tar": 2}
    text = dataset_card.card("gs://b/out", infos, 3, "png")
    front = yaml.safe_load(text.split("---")[1])
    assert front == {"configs": [{"config_name": "default",
                                  "data_files": [{"split": "train", "path": "shards/*.tar"}]}]}
    assert "pipe:gcloud storage cat gs://b/out/shards/{00000..00001}.tar" in text


def test_block_offsets():
    assert block_offsets([(("b", 0), 2), (("a", 1), 5), (("a", 0), 3)]) == {("a", 0): 0, ("a", 1): 3, ("b", 0): 8}
