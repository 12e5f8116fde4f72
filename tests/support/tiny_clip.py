"""Tiny random CLIP checkpoints in transformers' layout (CLIPModel.save_pretrained, a byte-level CLIP tokenizer,
CLIPImageProcessor's config) and LAION-layout score heads, for the scoring tests. Weights are perturbed so that no
layer is an identity or zero."""

from __future__ import annotations

import os

import numpy as np


def tiny_clip_config(image_size: int = 32, patch_size: int = 8, eos_legacy: bool = False):
    from transformers import CLIPConfig

    vocab = 256 * 2 + 2
    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=16, hidden_act="quick_gelu", bos_token_id=vocab - 2,
                eos_token_id=2 if eos_legacy else vocab - 1, pad_token_id=vocab - 1)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  image_size=image_size, patch_size=patch_size, hidden_act="quick_gelu")
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)


def save_tokenizer(folder: str) -> None:
    """A byte-level CLIP tokenizer (benchmarks.score_chip's): token ids 0..513, the special tokens last."""
    from benchmarks.score_chip import save_byte_tokenizer

    save_byte_tokenizer(folder)


def build_tiny_clip(folder: str, *, seed: int = 0, image_size: int = 32, patch_size: int = 8,
                    eos_legacy: bool = False):
    """A CLIPModel with perturbed random weights saved to `folder` (safetensors) with its tokenizer and a
    CLIPImageProcessor config; returns the torch model (eval mode)."""
    import torch
    from transformers import CLIPImageProcessor, CLIPModel

    torch.manual_seed(seed)
    model = CLIPModel(tiny_clip_config(image_size, patch_size, eos_legacy)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder)
    CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
                       ).save_pretrained(folder)
    return model


def save_head(path: str, sizes=(16, 12, 6, 1), dropout_gaps: bool = True, seed: int = 0):
    """A LAION-layout head (Linear layers with Dropouts between, as `nn.Sequential`) saved as safetensors; returns
    the torch Sequential."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    layers = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        layers.append(torch.nn.Linear(n_in, n_out))
        if dropout_gaps:
            layers.append(torch.nn.Dropout(0.2))
    if dropout_gaps:
        layers.pop()
    head = torch.nn.Sequential(*layers).eval()
    save_file({f"layers.{k}": v.contiguous() for k, v in head.state_dict().items()}, path)
    return head


def random_images(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Smooth-ish uint8 images (gradients plus noise), so resizing has something to average."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = (np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1))[None]
    noise = rng.normal(0, 40, (n, height, width, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)
