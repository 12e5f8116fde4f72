"""The tokenizer is loaded by the class its folder names without AutoTokenizer's import where that class is one of
model.loading.tokenizer.DIRECT_CLASSES: the same class and the same token ids as AutoTokenizer; anything else still goes
through AutoTokenizer."""

import json
import os
import shutil

import numpy as np
import pytest

from model.loading.tokenizer import PromptTokenizer, tokenizer_class

PROMPTS = ["a red fox in the snow", "", "日本語のプロンプト with émojis 🦊", "word " * 40]


def _copy(tiny_ckpt, tmp_path, edit=None):
    folder = tmp_path / "tokenizer"
    shutil.copytree(os.path.join(tiny_ckpt, "tokenizer"), folder)
    if edit:
        path = folder / "tokenizer_config.json"
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("name", ["Qwen2Tokenizer", "Qwen2TokenizerFast"])
def test_direct_class_is_autotokenizers_and_tokenizes_alike(tiny_ckpt, tmp_path, name):
    from transformers import AutoTokenizer

    folder = _copy(tiny_ckpt, tmp_path, lambda c: c.update(tokenizer_class=name))
    direct = tokenizer_class(folder)
    assert direct is not AutoTokenizer and direct.__name__ in (name, name.removesuffix("Fast"))
    auto = AutoTokenizer.from_pretrained(folder)
    assert type(auto) is direct
    ours = PromptTokenizer(folder, 24)
    assert type(ours.tokenizer) is direct
    texts = [ours.template(p) for p in PROMPTS]
    want = auto(texts, add_special_tokens=True, padding=False, truncation=False)["input_ids"]
    got = ours(PROMPTS)
    for row, seq in enumerate(want):
        n = min(len(seq), 24)
        np.testing.assert_array_equal(got.input_ids[row, :n], seq[:n])
        assert got.attention_mask[row].sum() == n and got.num_tokens[row] == len(seq)
    assert len(ours.tokenizer) == len(auto) and ours.tokenizer.pad_token_id == auto.pad_token_id


def test_other_folders_go_through_autotokenizer(tiny_ckpt, tmp_path):
    from transformers import AutoTokenizer

    assert tokenizer_class(_copy(tiny_ckpt, tmp_path / "a", lambda c: c.pop("tokenizer_class"))) is AutoTokenizer
    assert tokenizer_class(_copy(tiny_ckpt, tmp_path / "b", lambda c: c.update(tokenizer_class="GPT2Tokenizer"))) \
        is AutoTokenizer
    assert tokenizer_class(_copy(tiny_ckpt, tmp_path / "c", lambda c: c.update(auto_map={"AutoTokenizer": ["x", "y"]}))) \
        is AutoTokenizer
    with_config = _copy(tiny_ckpt, tmp_path / "d")
    with open(os.path.join(with_config, "config.json"), "w") as f:
        json.dump({"model_type": "qwen3"}, f)
    assert tokenizer_class(with_config) is AutoTokenizer
    assert tokenizer_class(str(tmp_path / "missing")) is AutoTokenizer
