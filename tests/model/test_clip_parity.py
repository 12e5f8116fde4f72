"""CLIP in JAX against transformers' PyTorch CLIPModel on tiny random checkpoints (perturbed weights): the text and
image embeddings, the preprocessing against CLIPImageProcessor (PIL bicubic), clip_score as torchmetrics defines it,
the zero-shot label probabilities, LAION-layout heads against torch Linear stacks, and heads in other layouts
refused naming what they hold."""

import numpy as np
import pytest

from tiny_clip import build_tiny_clip, random_images, save_head


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny-clip"))
    torch_model = build_tiny_clip(folder)
    head_path = str(tmp_path_factory.mktemp("heads") / "aesthetic.safetensors")
    head = save_head(head_path, sizes=(16, 12, 6, 1))
    return folder, torch_model, head_path, head


@pytest.fixture(scope="module")
def scorer(clip_folder):
    import jax.numpy as jnp

    from model.engine.scoring import load_scorer
    from model.parallel.mesh import make_mesh
    from model.options import EngineOptions
    from model.config.score_settings import ScoreSettings

    folder, _, head_path, _ = clip_folder
    settings = ScoreSettings(folder, labels=("a photo", "a drawing", "nsfw content"),
                             heads=(("aesthetic", head_path),))
    return load_scorer(settings, mesh=make_mesh(EngineOptions()), dtype=jnp.float32)


PROMPTS = ["a red fox in snow", "two cats", "a red fox in snow"]


def _torch_reference(clip_folder, images, prompts, labels):
    import torch
    from transformers import CLIPImageProcessor, CLIPTokenizer

    folder, model, _, head = clip_folder
    processor = CLIPImageProcessor.from_pretrained(folder)
    tok = CLIPTokenizer.from_pretrained(folder)
    pixel_values = processor(images=list(images), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        img = model.get_image_features(pixel_values=pixel_values)
        img = getattr(img, "pooler_output", img)
        texts = tok(prompts + labels, padding=True, return_tensors="pt")
        txt = model.get_text_features(**texts)
        txt = getattr(txt, "pooler_output", txt)
        img_u = img / img.norm(dim=-1, keepdim=True)
        txt_u = txt / txt.norm(dim=-1, keepdim=True)
        n = len(prompts)
        clip_score = torch.clamp(100 * (img_u * txt_u[:n]).sum(-1), min=0)
        probs = (model.logit_scale.exp() * img_u @ txt_u[n:].T).softmax(-1)
        aesthetic = head(img_u)[:, 0]
    return dict(image=img.numpy(), text=txt.numpy(), pixel_values=pixel_values.numpy(),
                clip_score=clip_score.numpy(), probs=probs.numpy(), aesthetic=aesthetic.numpy())


def _rel(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def test_embeddings_and_preprocessing_match_transformers(clip_folder, scorer):
    import jax.numpy as jnp
    from flax import nnx

    from model.engine.clip_preprocess import preprocess

    images = random_images(3, 48, 64)  # not square: shortest side resized, then center-cropped
    ref = _torch_reference(clip_folder, images, PROMPTS, [])
    pixels = np.asarray(preprocess(jnp.asarray(images), scorer.processing))
    # PIL's rounding reproduced: at most one 8-bit step anywhere, after normalization
    assert np.abs(pixels - ref["pixel_values"].transpose(0, 2, 3, 1)).max() < 1.01 / 255 / min(
        scorer.processing.std)
    model = nnx.merge(scorer._graph, scorer.state)
    image = np.asarray(model.image_embeds(jnp.asarray(ref["pixel_values"].transpose(0, 2, 3, 1))))
    assert _rel(image, ref["image"]) < 1e-4
    ids, mask = scorer.tokenize(PROMPTS)
    text = np.asarray(model.text_embeds(jnp.asarray(ids), jnp.asarray(mask)))
    assert _rel(text, ref["text"]) < 1e-4


def test_scores_match_torchmetrics_definition_labels_and_heads(clip_folder, scorer):
    import jax

    prompts = PROMPTS + ["a blue house", "a bowl of fruit", "two cats", "rain at night"]
    images = random_images(len(prompts), 48, 64, seed=1)
    ref = _torch_reference(clip_folder, images, prompts, list(scorer.settings.labels))
    before = scorer.texts_encoded
    rows = scorer.to_host(scorer.score(jax.numpy.asarray(images), prompts), len(prompts))
    assert scorer.texts_encoded - before == 5  # each distinct prompt is encoded once
    got = np.array([r["clip_score"] for r in rows])
    assert np.abs(got - ref["clip_score"]).max() < 0.05
    assert got.max() > 1 and got.min() == 0  # both sides of the floor are compared
    probs = np.array([[r[f"label:{x}"] for x in scorer.settings.labels] for r in rows])
    np.testing.assert_allclose(probs, ref["probs"], atol=1e-4)
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-5)
    np.testing.assert_allclose([r["aesthetic"] for r in rows], ref["aesthetic"], rtol=1e-4, atol=1e-5)
    assert list(rows[0]) == list(scorer.settings.names)


def test_legacy_eos_config_pools_at_the_highest_id(tmp_path):
    """Configs with eos_token_id 2 (the original OpenAI ones) pool at argmax(ids), as transformers does."""
    import jax.numpy as jnp
    import torch
    from flax import nnx
    from transformers import CLIPTokenizer

    from model.engine.scoring import load_scorer
    from model.options import EngineOptions
    from model.parallel.mesh import make_mesh
    from model.config.score_settings import ScoreSettings

    torch_model = build_tiny_clip(str(tmp_path), seed=3, eos_legacy=True)
    scorer = load_scorer(ScoreSettings(str(tmp_path)), mesh=make_mesh(EngineOptions()), dtype=jnp.float32)
    ids, mask = scorer.tokenize(PROMPTS[:2])
    text = np.asarray(nnx.merge(scorer._graph, scorer.state).text_embeds(jnp.asarray(ids), jnp.asarray(mask)))
    tok = CLIPTokenizer.from_pretrained(str(tmp_path))(PROMPTS[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = torch_model.get_text_features(**tok)
    assert _rel(text, getattr(ref, "pooler_output", ref).numpy()) < 1e-4


def test_heads_in_other_layouts_are_refused_naming_them(tmp_path):
    import torch
    from safetensors.torch import save_file

    from model.nets.score_heads import HeadLayoutError, head_layout

    save_head(str(tmp_path / "ok.safetensors"), sizes=(16, 8, 1), dropout_gaps=False)
    with pytest.raises(HeadLayoutError, match=r"mlp\.fc1\.weight"):
        head_layout({"mlp.fc1.weight": (8, 16), "mlp.fc1.bias": (8,)}, 16, "x.safetensors")
    with pytest.raises(HeadLayoutError, match="reads 768 values where 16 arrive"):
        head_layout({"layers.0.weight": (1, 768), "layers.0.bias": (1,)}, 16, "x.safetensors")
    with pytest.raises(HeadLayoutError, match="gives 4 values"):
        head_layout({"layers.0.weight": (4, 16), "layers.0.bias": (4,)}, 16, "x.safetensors")
    layout = head_layout({"layers.0.weight": (8, 16), "layers.0.bias": (8,), "layers.3.weight": (1, 8),
                          "layers.3.bias": (1,)}, 16, "x.safetensors")
    assert layout.indices == (0, 3) and layout.sizes == ((16, 8), (8, 1))
    del torch, save_file
