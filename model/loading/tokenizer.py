"""The checkpoint's own Qwen tokenizer, created once, turning prompts into contiguous int32 id/mask arrays."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from ..errors import CheckpointError
from ..contract import DEFAULT_MAX_SEQUENCE_LENGTH, count


@dataclasses.dataclass(frozen=True)
class TokenizedPrompts:
    input_ids: np.ndarray       # int32 [B, max_length]
    attention_mask: np.ndarray  # int32 [B, max_length], 1 on real tokens
    truncated: tuple[bool, ...]  # prompt had more than max_length tokens (after the chat template)
    num_tokens: tuple[int, ...]  # untruncated token count of each templated prompt


# The tokenizer classes FLUX.2 [klein] checkpoints name, taken straight from transformers: AutoTokenizer's import
# alone is about half of transformers' import time (docs/performance.md), which a load waits for. For these it
# resolves to the very same class; any other folder goes through AutoTokenizer.
DIRECT_CLASSES = frozenset({"Qwen2Tokenizer", "Qwen2TokenizerFast"})


def tokenizer_class(folder: str):
    """The class that loads `folder`: the one tokenizer_config.json names if it is in DIRECT_CLASSES (no auto_map,
    no config.json beside it: nothing AutoTokenizer would weigh against it), else AutoTokenizer."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if name in DIRECT_CLASSES and "auto_map" not in config and not os.path.exists(os.path.join(folder, "config.json")):
        import transformers

        direct = getattr(transformers, name, None)
        if direct is not None:
            return direct
    from transformers import AutoTokenizer  # tokenizer only; no model classes

    return AutoTokenizer


class PromptTokenizer:
    """Chat-template + tokenize exactly like Flux2KleinPipeline._get_qwen3_prompt_embeds, padded to max_length."""

    def __init__(self, folder: str, max_length: int = DEFAULT_MAX_SEQUENCE_LENGTH):
        max_length = count("max_sequence_length", max_length)
        if not os.path.isdir(folder):
            raise CheckpointError("tokenizer folder is missing", path=folder)
        try:
            self.tokenizer = tokenizer_class(folder).from_pretrained(folder)
        except Exception as e:  # transformers raises many types for broken folders
            raise CheckpointError(f"cannot load tokenizer: {e}", path=folder) from e
        if not getattr(self.tokenizer, "is_fast", False):
            raise CheckpointError("tokenizer is not a fast tokenizer", path=folder)
        if self.tokenizer.pad_token_id is None:
            raise CheckpointError("tokenizer has no pad token", path=folder)
        try:  # the pipeline templates every prompt: a tokenizer without a usable chat template fails here, not later
            self.template("a test prompt")
        except Exception as e:  # noqa: BLE001 - transformers / jinja raise several types
            raise CheckpointError(f"tokenizer has no usable chat template: {type(e).__name__}: {e}",
                                  path=folder) from e
        self.max_length = max_length

    def template(self, prompt: str) -> str:
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=False)

    def __call__(self, prompts: list[str]) -> TokenizedPrompts:
        texts = [self.template(p) for p in prompts]
        encoded = self.tokenizer(texts, add_special_tokens=True, padding=False, truncation=False)["input_ids"]
        length = self.max_length
        ids = np.full((len(texts), length), self.tokenizer.pad_token_id, dtype=np.int32)
        mask = np.zeros((len(texts), length), dtype=np.int32)
        left_pad = self.tokenizer.padding_side == "left"
        cut_left = self.tokenizer.truncation_side == "left"
        for row, seq in enumerate(encoded):
            seq = seq[-length:] if cut_left else seq[:length]
            start = length - len(seq) if left_pad else 0
            ids[row, start:start + len(seq)] = seq
            mask[row, start:start + len(seq)] = 1
        counts = tuple(len(s) for s in encoded)
        return TokenizedPrompts(ids, mask, tuple(c > length for c in counts), counts)
