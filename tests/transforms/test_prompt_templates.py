"""Prompt templates (transforms/inputs/template.py, template_records.py): three slots give the product of their
sizes, each combination once with its labels; `samples` is a seeded subset without repetition; ids come from the
slot values alone and are the same on every run; vocabularies from lists, text files and table columns; every
mistake is one TemplateError naming it; the Beam expansion gives the same records as the pure functions."""

import json

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to

from transforms.inputs import template as T
from transforms.inputs.template_records import ExpandTemplates, template_request
from transforms.inputs.validation import RequestDefaults
from transforms.requests import INVALID_TAG  # noqa: F401


def _template(tmp_path, obj, name="t.template.json"):
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return T.load_template(str(path))


def test_three_slots_give_their_product_each_combination_once(tmp_path):
    (tmp_path / "places.txt").write_text("garden\n\nkitchen\nroof\n")
    (tmp_path / "styles.csv").write_text("name,weight\nfilm,1\nwatercolor,2\n")
    t = _template(tmp_path, {"template": "a {object} on the {place}, {style}",
                             "slots": {"object": ["cat", "dog"], "place": {"file": "places.txt"},
                                       "style": {"table": "styles.csv", "column": "name"}}})
    assert (t.combinations, t.count) == (2 * 3 * 2, 12)
    records = [t.record(i) for i in range(t.count)]
    labels = [tuple(r[2].values()) for r in records]
    assert len(set(labels)) == 12 and ("dog", "roof", "watercolor") in labels
    assert all(r[1] == "a {} on the {}, {}".format(*r[2].values()) for r in records)
    assert len({r[0] for r in records}) == 12


def test_samples_are_seeded_without_repetition_and_ids_stable(tmp_path):
    slots = {"a": [str(i) for i in range(50)], "b": [str(i) for i in range(40)]}
    one = _template(tmp_path, {"template": "{a} {b}", "slots": slots, "samples": 300, "seed": 7})
    again = _template(tmp_path, {"template": "{a} {b}", "slots": slots, "samples": 300, "seed": 7}, "u.template.json")
    other = _template(tmp_path, {"template": "{a} {b}", "slots": slots, "samples": 300, "seed": 8}, "v.template.json")
    picked = [one.record(i) for i in range(300)]
    assert picked == [again.record(i) for i in range(300)]
    assert len({p[0] for p in picked}) == 300  # no combination twice
    assert {p[0] for p in picked} != {other.record(i)[0] for i in range(300)}
    assert sorted(T.permuted(i, 2000, 3) for i in range(2000)) == list(range(2000))
    # an id is its slot values' digest: the same combination has the same id in a template without samples
    full = _template(tmp_path, {"template": "{a} {b}", "slots": slots}, "w.template.json")
    by_labels = {tuple(full.record(i)[2].values()): full.record(i)[0] for i in range(full.count)}
    assert all(by_labels[tuple(p[2].values())] == p[0] for p in picked)


@pytest.mark.parametrize("obj, message", [
    ({"template": "a {object} in {place}", "slots": {"object": ["cat"]}}, "slot {place} of the template"),
    ({"template": "a {object}", "slots": {"object": ["cat"], "style": ["film"]}}, "vocabulary 'style' is never used"),
    ({"template": "a {object}", "slots": {"object": ["cat", "cat"]}}, "lists 'cat' twice"),
    ({"template": "a {object}", "slots": {"object": {"file": "missing.txt"}}}, "cannot be read"),
    ({"template": "a {object}", "slots": {"object": ["cat"]}, "samples": 2}, "from 1 to the 1 combinations"),
    ({"template": "a {object.x}", "slots": {"object": ["cat"]}}, "not a plain name"),
])
def test_mistakes_are_one_error_naming_them(tmp_path, obj, message):
    with pytest.raises(T.TemplateError, match=message.replace("{", r"\{").replace("}", r"\}")):
        _template(tmp_path, obj)


def test_max_images_counts_combinations_and_yaml_reads(tmp_path):
    (tmp_path / "t.template.yaml").write_text("template: '{a} {b}'\nslots:\n  a: [x, y, z]\n  b: [p, q]\n"
                                               "parameters: {num_images: 2}\n")
    t = T.load_template(str(tmp_path / "t.template.yaml"))
    assert T.check_total([t], 1, 12) == 12
    with pytest.raises(T.TemplateError, match=r"give 12 images .* above --max_images=11"):
        T.check_total([t], 1, 11)
    assert T.is_template("x.TEMPLATE.json") and T.is_template("x.json", "template") and not T.is_template("x.json")


def test_beam_expansion_spreads_ranges_and_gives_the_same_requests(tmp_path):
    t = _template(tmp_path, {"template": "a {x} {y}", "slots": {"x": [str(i) for i in range(7)],
                                                                "y": ["p", "q", "r"]}, "samples": 17, "seed": 2})
    defaults = RequestDefaults()
    want = [template_request(t, i, defaults) for i in range(t.count)]
    assert want[0].metadata_values() == t.record(0)[2] and want[0].line == 1
    with beam.Pipeline() as p:
        out = p | ExpandTemplates([t], defaults, chunk_records=4)
        assert_that(out["requests"], equal_to(want))
        assert_that(out["invalid"], equal_to([]), label="NoInvalid")
    long_prompt = RequestDefaults(max_prompt_bytes=4)
    assert template_request(t, 0, long_prompt)["field"] == "prompt"  # a record over the limit is its error row


def test_utf16_vocabularies_read_as_the_line_readers_read_them(tmp_path):
    """A vocabulary saved as UTF-16 with its byte-order mark (Excel's "Unicode text") reads as its text."""
    (tmp_path / "places.txt").write_bytes("jardín\nküche\n".encode("utf-16"))
    (tmp_path / "styles.tsv").write_bytes("name\tweight\nfilm\t1\n".encode("utf-16"))
    t = _template(tmp_path, {"template": "{place} {style}", "slots": {
        "place": {"file": "places.txt"}, "style": {"table": "styles.tsv", "column": "name"}}})
    assert t.count == 2 and {t.record(i)[1] for i in range(2)} == {"jardín film", "küche film"}
