"""Reference images of image-conditioned requests: the record field, paths, bounded reading, the cache, batching
keys, and what the manifest and the image text say about them."""

import hashlib
import io
import json
import os

import numpy as np
import pytest
from PIL import Image

from reference_files import png, png_declaring
from transforms import layout, references
from transforms.references import ReferenceCache, ReferenceError, ReferenceLimits, read_reference, resolve_path
from transforms.inputs.identity import derive_id
from transforms.inputs.readers import parse_lines
from transforms.inputs.validation import RequestDefaults
from transforms.requests import GenerationRequest, ImageTask
from transforms.sinks.encoding import encode_png, png_text
from transforms.sinks.existing import ExistingImageMismatch, existing_manifest_row

D = RequestDefaults(height=32, width=32, seed=7, max_reference_images=2)
LIMITS = ReferenceLimits(max_images=2, max_pixels=256 * 256)


def parse(data: bytes, source="/data/in/p.jsonl", fmt="jsonl", defaults=D):
    return parse_lines(data, source, fmt, defaults)


# --------------------------------------------------------------------------------------------- the record field
def test_reference_paths_resolve_against_the_input_files_folder():
    assert resolve_path("refs/a.png", "/data/in/p.jsonl") == "/data/in/refs/a.png"
    assert resolve_path("../r/a.png", "/data/in/p.jsonl") == "/data/r/a.png"
    assert resolve_path("refs/a.png", "gs://b/in/p.jsonl") == "gs://b/in/refs/a.png"
    assert resolve_path("../a.png", "gs://b/in/p.jsonl") == "gs://b/a.png"
    assert resolve_path("gs://c/x/./y.png", "/data/p.jsonl") == "gs://c/x/y.png"
    assert resolve_path("/abs/a.png", "gs://b/p.jsonl") == "/abs/a.png"
    for bad, source in (("s3://b/a.png", "/p.jsonl"), ("gs://bucket", "/p.jsonl"), ("", "/p.jsonl"),
                        ("a.png", "bq://proj.ds.t"), ("a.png", "query")):
        with pytest.raises(ValueError):
            resolve_path(bad, source)


def test_reference_field_in_jsonl_and_csv():
    jsonl = parse(b'{"prompt": "p", "reference_images": ["a.png", "gs://b/c.png"]}\n'
                  b'{"prompt": "p", "reference_images": "a.png"}\n'
                  b'{"prompt": "p", "reference_images": []}\n'
                  b'{"prompt": "p", "reference_images": null}\n')
    assert [r.reference_images for r in jsonl] == [("/data/in/a.png", "gs://b/c.png"), ("/data/in/a.png",), (), ()]
    csv = parse(b'prompt,reference_images\np,"[""a.png"", ""b.png""]"\np,a.png\np,\n', "gs://k/in/t.csv", "csv")
    assert [r.reference_images for r in csv] == [("gs://k/in/a.png", "gs://k/in/b.png"), ("gs://k/in/a.png",), ()]


@pytest.mark.parametrize("line, words", [
    (b'{"prompt": "p", "reference_images": ["a", "b", "c"]}', "above --max_reference_images=2"),
    (b'{"prompt": "p", "reference_images": [1]}', "list of paths"),
    (b'{"prompt": "p", "reference_images": {"a": 1}}', "list of paths"),
    (b'{"prompt": "p", "reference_images": ["s3://b/a.png"]}', "only gs:// and local"),
    (b'{"prompt": "p", "reference_images": [""]}', "empty path"),
])
def test_bad_reference_fields_are_error_rows(line, words):
    [row] = parse(line + b"\n")
    assert isinstance(row, dict) and row["field"] == "reference_images" and words in row["reason"], row


def test_references_make_another_request():
    a, b, none = parse(b'{"prompt": "p", "reference_images": ["a.png"]}\n'
                       b'{"prompt": "p", "reference_images": ["b.png"]}\n'
                       b'{"prompt": "p"}\n')
    assert len({a.id, b.id, none.id}) == 3
    assert none.id == derive_id("p", 32, 32, None, None, 1, None)  # text-to-image ids are unchanged
    assert a.id == derive_id("p", 32, 32, None, None, 1, None, ("/data/in/a.png",))
    assert a.params() != b.params()


def test_batches_key_on_the_references_processed_sizes():
    base = dict(prompt="p", seed=1, height=32, width=32, num_inference_steps=None, guidance_scale=None,
                num_images=1)
    plain = GenerationRequest(id="a", **base)
    ref = GenerationRequest(id="b", **base, reference_images=("x",), reference_signature=((64, 80),))
    other = GenerationRequest(id="c", **base, reference_images=("y",), reference_signature=((64, 64),))
    same = GenerationRequest(id="d", **base, reference_images=("z",), reference_signature=((64, 80),))
    keys = [ImageTask(r, 0).shape_key for r in (plain, ref, other, same)]
    assert keys[0] == "32x32/steps=None/guidance=None"  # text-to-image keys are unchanged
    assert len(set(keys[:3])) == 3 and keys[1] == keys[3]


def test_signature_is_the_processed_size_for_the_checkpoints_multiple():
    images = [Image.new("RGB", (80, 64)), Image.new("RGB", (2000, 1000))]
    assert references.reference_signature(images) == ((64, 80), (720, 1440))  # 1448x724 at 1 MP -> 16s
    assert references.reference_signature(images, 32) == ((64, 64), (704, 1440))


# --------------------------------------------------------------------------------------------- reading
def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def test_read_reference_decodes_as_rgb_with_its_sha256(tmp_path):
    data = png(80, 64, mode="RGBA")
    ref = read_reference(write(tmp_path, "a.png", data), LIMITS)
    assert ref.sha256 == hashlib.sha256(data).hexdigest() and ref.size == (80, 64) and ref.image.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(ref.image),
                                  np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


@pytest.mark.parametrize("name, data, words", [
    ("text.png", b"not an image at all", "is not an image"),
    ("small.png", png(64, 63), "must be at least 64 px on each side, got 64x63"),
    ("long.png", png(64, 520), "aspect ratio must be at most 8:1, got 64x520 (8.12:1)"),
    ("bomb.png", png_declaring(5000, 5000), "above --max_reference_pixels=65536 (refused before decoding)"),
    ("huge.png", png_declaring(100000, 100000), "declares too many pixels"),  # PIL's own limit, caught
    ("big.png", b"\x89PNG" + os.urandom(4 * 65536 + 2**20), "is larger than 1310720 bytes"),
    ("cut.png", png(64, 64)[:200], "cannot be decoded"),
])
def test_unusable_references_say_why(tmp_path, name, data, words):
    path = write(tmp_path, name, data)
    with pytest.raises(ReferenceError) as e:
        read_reference(path, LIMITS)
    assert words in str(e.value) and path in str(e.value) and e.value.uri == path


def test_missing_reference(tmp_path):
    with pytest.raises(ReferenceError, match="does not exist"):
        read_reference(str(tmp_path / "nope.png"), LIMITS)


def test_cache_reads_each_reference_once_and_notices_a_replaced_file(tmp_path):
    cache = ReferenceCache(max_bytes=2 * 64 * 64 * 3)
    a = write(tmp_path, "a.png", png(64, 64, seed=1))
    b = write(tmp_path, "b.png", png(64, 64, seed=2))
    first = cache.get(a, LIMITS)
    for _ in range(3):
        assert cache.get(a, LIMITS) is first
        cache.get(b, LIMITS)
    assert cache.reads == 2
    missing = str(tmp_path / "missing.png")
    for _ in range(2):
        with pytest.raises(ReferenceError):
            cache.get(missing, LIMITS)
    assert cache.reads == 3  # a missing reference is remembered too
    c = write(tmp_path, "c.png", png(64, 64, seed=3))
    cache.get(c, LIMITS)  # over the byte bound: the least recently used (a) is dropped
    cache.get(a, LIMITS)
    assert cache.reads == 5
    write(tmp_path, "a.png", png(64, 64, seed=9))  # replaced during the job
    assert cache.get(a, LIMITS, expected_sha256=first.sha256) is not None  # the cached copy is the version asked
    cache.forget(a, LIMITS)  # another process (or a dropped entry) reads the file again: not the version the request has
    with pytest.raises(ReferenceError, match="changed during the job"):
        cache.get(a, LIMITS, expected_sha256=first.sha256)
    reads = cache.reads
    cache.get(b, ReferenceLimits(max_pixels=LIMITS.max_pixels, cache_scope="next job"))  # another job: read again
    assert cache.reads == reads + 1


def test_cache_drops_the_least_recently_used_and_keeps_a_reference_larger_than_its_bound_alone(tmp_path):
    one = 64 * 64 * 3  # the pixel bytes of one 64x64 reference
    cache = ReferenceCache(max_bytes=2 * one)
    a, b, c = (write(tmp_path, f"{n}.png", png(64, 64, seed=i)) for i, n in enumerate("abc"))
    for uri in (a, b, a, c):  # b is the least recently used when c comes: dropped
        cache.get(uri, LIMITS)
    assert cache.reads == 3
    for uri in (a, c):  # both kept
        cache.get(uri, LIMITS)
    assert cache.reads == 3
    cache.get(b, LIMITS)  # read again; drops a
    assert cache.reads == 4
    big = write(tmp_path, "big.png", png(128, 128, seed=4))  # 4x the pixels of one: above the whole bound
    for _ in range(2):
        assert cache.get(big, LIMITS).size == (128, 128)
    assert cache.reads == 5  # kept, alone: b and c were dropped for it
    cache.get(c, LIMITS)
    assert cache.reads == 6


# --------------------------------------------------------------------------------------------- outputs
def test_manifest_and_image_text_carry_the_references():
    refs = ("gs://b/refs/a.png", "/data/in/b.png")
    sha = ("1" * 64, "2" * 64)
    r = GenerationRequest(id="e", prompt="p", seed=3, height=32, width=32, num_inference_steps=None,
                          guidance_scale=None, num_images=1, reference_images=refs, reference_sha256=sha,
                          reference_signature=((64, 64), (64, 64)))
    task = ImageTask(r, 0)
    entries = [{"uri": u, "sha256": s} for u, s in zip(refs, sha)]
    text = png_text(task, num_inference_steps=4, guidance_scale=1.0, model="m")
    assert json.loads(text["reference_images"]) == entries
    data = encode_png(np.zeros((32, 32, 3), np.uint8), text)
    row = existing_manifest_row(task, data, "gs://o/images/e.png")
    assert row["reference_images"] == entries
    # Another reference file under the same URI, or none: not this request's image.
    changed = GenerationRequest(**{**r.__dict__, "reference_sha256": ("3" * 64, "2" * 64)})
    with pytest.raises(ExistingImageMismatch, match="reference_images"):
        existing_manifest_row(ImageTask(changed, 0), data, "gs://o/images/e.png")
    plain = GenerationRequest(**{**r.__dict__, "reference_images": (), "reference_sha256": ()})
    with pytest.raises(ExistingImageMismatch, match="reference_images"):
        existing_manifest_row(ImageTask(plain, 0), data, "gs://o/images/e.png")
    no_refs = layout.manifest_row(ImageTask(plain, 0), file_name="images/x.png", uri="u", sha256="s",
                                  num_bytes=1, num_inference_steps=4, guidance_scale=1.0, prompt_truncated=False,
                                  model="m", generation_ms=1.0)
    assert "reference_images" not in no_refs  # text-to-image rows are unchanged


def test_reference_field_in_parquet_is_a_list_of_strings(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": ["p", "q"], "reference_images": [["a.png", "gs://b/c.png"], None]}), path)
    a, b = parse_lines(path.read_bytes(), str(path), "parquet", D)
    assert a.reference_images == (str(tmp_path / "a.png"), "gs://b/c.png") and b.reference_images == ()


def test_reference_field_in_bigquery_rows_needs_full_paths():
    from transforms.inputs.bigquery import row_record
    from transforms.inputs.validation import parse_raw

    ok = parse_raw(row_record({"prompt": "p", "reference_images": ["gs://b/a.png"]}, "bq://p.d.t"), D)
    assert ok.reference_images == ("gs://b/a.png",)
    bad = parse_raw(row_record({"prompt": "p", "reference_images": ["a.png"]}, "bq-query"), D)
    assert bad["field"] == "reference_images" and "relative" in bad["reason"]


def test_transient_read_errors_are_retried_and_never_cached(tmp_path, monkeypatch):
    """A reference read that fails for a reason that may pass (a dropped connection) is tried again; one that still
    fails is an error for this request only: the next request reads the file again instead of a cached failure."""
    from transforms import bounded_reads

    monkeypatch.setattr(references, "READ_BACKOFF_S", 0.0)
    real_open = bounded_reads.open_local_regular
    failures = {"left": 0}

    def flaky_open(path, *args, **kwargs):
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("connection reset by peer")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(bounded_reads, "open_local_regular", flaky_open)
    a = write(tmp_path, "a.png", png(64, 64, seed=1))
    cache = ReferenceCache()
    failures["left"] = references.READ_ATTEMPTS - 1
    assert cache.get(a, LIMITS).size == (64, 64)  # read on the last attempt
    b = write(tmp_path, "b.png", png(64, 64, seed=2))
    failures["left"] = references.READ_ATTEMPTS
    with pytest.raises(ReferenceError, match="connection reset") as e:
        cache.get(b, LIMITS)
    assert e.value.transient
    assert cache.get(b, LIMITS).size == (64, 64)  # the failure was not cached


# --------------------------------------------------------------------------------------------- allowed roots
def test_reference_roots_normalise_and_default_to_the_input_folders():
    from transforms.references import default_roots, normalise_root

    assert normalise_root("gs://b/refs/") == "gs://b/refs" and normalise_root("gs://b") == "gs://b"
    assert normalise_root("gs://b/") == "gs://b" and normalise_root("gs://b/x/../refs") == "gs://b/refs"
    assert normalise_root("/data/./refs/") == "/data/refs"
    assert normalise_root("refs") == os.path.join(os.getcwd(), "refs")
    for bad in ("s3://b/refs", "gs://", "gs:///x", "gs://b/../c", "/data/*.png", " "):
        with pytest.raises(ValueError, match="reference_root"):
            normalise_root(bad)
    assert default_roots(["gs://b/in/*.jsonl", "gs://b/in/more.jsonl", "/data/p.jsonl", "/data/in*/x.csv",
                          "gs://c/top.jsonl", "p.jsonl"]) == (
        "gs://b/in", "/data", "gs://c", os.getcwd())
    assert default_roots([]) == ()  # BigQuery input only: no folder of its own, nothing allowed by default


@pytest.mark.parametrize("uri, allowed", [
    ("gs://b/refs/a.png", True),
    ("gs://b/refs/sub/a.png", True),
    ("gs://b/refs/../refs/a.png", True),  # normalised: still inside
    ("gs://b/refs/../secret/a.png", False),  # '..' climbs out of the root
    ("gs://b/../other/a.png", False),  # out of the bucket
    ("gs://b/refs-other/a.png", False),  # a prefix of the name is not the folder
    ("gs://other-bucket/refs/a.png", False),  # another bucket the worker may read
    ("gs://b/a.png", False),
    ("/data/refs/a.png", True),
    ("/data/refs/../in/a.png", False),
    ("/etc/passwd", False),
    ("refs/a.png", False),  # never resolved: not an absolute path
])
def test_check_allowed_keeps_references_inside_their_roots(uri, allowed):
    from transforms.references import check_allowed

    roots = ("gs://b/refs", "/data/refs")
    if allowed:
        check_allowed(uri, roots)
        return
    with pytest.raises(ReferenceError) as e:
        check_allowed(uri, roots)
    assert e.value.uri == uri and uri in str(e.value) and "gs://b/refs, /data/refs" in str(e.value)


def test_no_roots_refuse_every_reference_and_none_allows_any():
    from transforms.references import check_allowed

    with pytest.raises(ReferenceError, match="allowed reference roots are: none"):
        check_allowed("gs://b/a.png", ())
    check_allowed("/anything/a.png", None)


def _resolve(requests, limits):
    """ResolveReferences' DoFn on `requests`: (requests passed on, error rows)."""
    import apache_beam as beam

    fn = references._ResolveReferencesFn(limits, 16)
    passed, invalid = [], []
    for request in requests:
        for out in fn.process(request):
            (invalid if isinstance(out, beam.pvalue.TaggedOutput) else passed).append(
                out.value if isinstance(out, beam.pvalue.TaggedOutput) else out)
    return passed, invalid


def test_references_outside_the_roots_are_one_error_row_each(tmp_path):
    """Inside the root (relative or absolute) is read; a '..' escape, an absolute path elsewhere, another bucket and
    a symlink inside the root pointing out of it are `invalid_reference` rows naming the path and the roots."""
    root, outside = tmp_path / "in", tmp_path / "private"
    (root / "refs").mkdir(parents=True)
    outside.mkdir()
    (root / "refs" / "a.png").write_bytes(png(64, 64, seed=1))
    (outside / "secret.png").write_bytes(png(64, 64, seed=2))
    os.symlink(outside / "secret.png", root / "refs" / "link.png")
    source = str(root / "p.jsonl")
    lines = [{"id": "relative", "prompt": "p", "reference_images": ["refs/a.png"]},
             {"id": "absolute", "prompt": "p", "reference_images": [str(root / "refs" / "a.png")]},
             {"id": "dotdot", "prompt": "p", "reference_images": ["../private/secret.png"]},
             {"id": "elsewhere", "prompt": "p", "reference_images": [str(outside / "secret.png")]},
             {"id": "bucket", "prompt": "p", "reference_images": ["gs://other-bucket/secret.png"]},
             {"id": "symlink", "prompt": "p", "reference_images": ["refs/link.png"]},
             {"id": "plain", "prompt": "p"}]
    requests = parse("".join(json.dumps(r) + "\n" for r in lines).encode(), source=source)
    limits = ReferenceLimits(max_images=2, max_pixels=256 * 256, roots=(str(root),))
    passed, invalid = _resolve(requests, limits)

    assert sorted(r.id for r in passed) == ["absolute", "plain", "relative"]
    errors = {e["id"]: e for e in invalid}
    assert set(errors) == {"dotdot", "elsewhere", "bucket", "symlink"}
    for rid, e in errors.items():
        assert (e["kind"], e["field"]) == (layout.INVALID_REFERENCE, "reference_images"), e
        assert e["value"] in e["reason"] and f"allowed reference roots are: {root}" in e["reason"], e
    assert errors["dotdot"]["value"] == str(outside / "secret.png")
    assert errors["bucket"]["value"] == "gs://other-bucket/secret.png"
    assert "through a symlink" in errors["symlink"]["reason"] and str(outside / "secret.png") in \
        errors["symlink"]["reason"]


def test_job_reference_roots_default_to_the_input_folders_and_can_be_given():
    import types

    from pipeline.errors import UsageError
    from pipeline.option_specs import OPTIONS
    from pipeline.specs import Runner, job_spec

    def roots(reference_root, inputs):
        given = {**{o.name: o.default for o in OPTIONS}, "model": "ckpt", "input": inputs,
                 "reference_root": reference_root}
        return job_spec(types.SimpleNamespace(**given), Runner("FnApiRunner", local=True)).reference_roots

    assert roots(None, ["/data/in/*.jsonl"]) == ("/data/in",)
    assert roots(["gs://b/refs/,/data/refs", "gs://c"], ["/data/in/p.jsonl"]) == (
        "gs://b/refs", "/data/refs", "gs://c")
    assert roots(None, ["bq://p.d.t"]) == ()  # BigQuery input: references must be allowed explicitly
    with pytest.raises(UsageError, match="s3://b"):
        roots(["s3://b/refs"], ["/data/in/p.jsonl"])
