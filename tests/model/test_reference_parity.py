"""Image-conditioned generation (klein's multi-reference editing) against diffusers' Flux2KleinPipeline(image=[...]).

fp32, same random weights, same initial noise. Tolerances as tests/model/test_model_parity.py: the VAE encoder within
1e-4 of diffusers' AutoencoderKLFlux2; images within 4/255 max and 0.5/255 mean. Most end-to-end cases run on a tiny
checkpoint whose VAE has the real size multiple (16), so a 64 px reference is 16 tokens; one runs on the default tiny
checkpoint (multiple 4). Sizes and steps are small so the file runs in a few minutes on two cores.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import model
from model.engine.reference_preprocess import MAX_AREA, preprocess, processed_size, reference_signature

MAX_LEN = 32
M16 = dict(vae_block_out_channels=(8, 8, 8, 16))  # scale 8 -> size multiple 16, as the real klein VAE


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


def _rgb(h, w, seed):
    """A smooth-ish random RGB image (noise blurred by upsampling), uint8 [h, w, 3]."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(h // 8, 2), max(w // 8, 2), 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR))


def _rgba(h, w, seed):
    alpha = np.random.default_rng(seed + 100).integers(0, 256, (h, w, 1), dtype=np.uint8)
    return np.concatenate([_rgb(h, w, seed), alpha], axis=2)


def _palette(h, w, seed):
    return Image.fromarray(_rgb(h, w, seed)).quantize(colors=32)


def _pil(image):
    return image if isinstance(image, Image.Image) else Image.fromarray(image)


@pytest.fixture(scope="module")
def m16_ckpt(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(**M16)


@pytest.fixture(scope="module")
def gen16(m16_ckpt):
    return model.load(m16_ckpt, dtype="float32", max_sequence_length=MAX_LEN)


@pytest.fixture(scope="module")
def pipe16(m16_ckpt):
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline.from_pretrained(m16_ckpt, torch_dtype=torch.float32)


def _diffusers(pipe, gen, prompts, seeds, references, height, width, steps, guidance=1.0, k=1):
    """diffusers' images for `prompts` with one reference set for the call, fed our initial noise."""
    noise = np.stack([model.initial_noise(s + j, gen.noise_shape(height, width)) for s in seeds for j in range(k)])
    return pipe(prompt=prompts, image=[_pil(r) for r in references], height=height, width=width,
                num_inference_steps=steps, guidance_scale=guidance, latents=torch.from_numpy(noise), output_type="np",
                max_sequence_length=MAX_LEN, num_images_per_prompt=k).images


def _assert_images_close(ours: np.ndarray, ref: np.ndarray, label=""):
    assert ours.dtype == np.uint8 and ours.shape == ref.shape, (ours.shape, ref.shape)
    diff = np.abs(ours.astype(np.float64) / 255.0 - ref.astype(np.float64)) * 255.0
    print(f"{label}: max |diff| {diff.max():.3f}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4.0, f"max abs diff {diff.max():.3f}/255"
    assert diff.mean() <= 0.5, f"mean abs diff {diff.mean():.3f}/255"
    assert ref.std() > 0.05, "reference images are flat: the parity check would prove nothing"


# ------------------------------------------------------------------------------------------------- host side


def _diffusers_preprocess(pipe, image):
    """The pipeline's per-reference steps (Flux2KleinPipeline.__call__), through its own image processor."""
    proc = pipe.image_processor
    proc.check_image_input(image)
    w, h = image.size
    if w * h > 1024 * 1024:
        image = proc._resize_to_target_area(image, 1024 * 1024)
        w, h = image.size
    multiple = pipe.vae_scale_factor * 2
    w, h = w // multiple * multiple, h // multiple * multiple
    return _np(proc.preprocess(image, height=h, width=w, resize_mode="crop"))[0].transpose(1, 2, 0)


@pytest.mark.parametrize("make,h,w", [
    (_rgb, 64, 64), (_rgb, 67, 93), (_rgba, 81, 130), (_palette, 100, 75),      # crops only
    (_rgb, 1000, 1100), (_rgba, 1300, 900), (_palette, 2000, 600),              # over 1 MP: resized, then crops
    (lambda h, w, s: Image.fromarray(_rgb(h, w, s)).convert("L"), 70, 70),      # grayscale PIL
])
def test_preprocess_matches_diffusers(pipe16, gen16, make, h, w):
    image = make(h, w, 5)
    expected = _diffusers_preprocess(pipe16, _pil(image))
    ours = preprocess(image, gen16.size_multiple)
    assert ours.size == expected.shape[:2]
    np.testing.assert_array_equal(ours.pixels, expected)
    assert reference_signature([image], gen16.size_multiple) == (ours.size,) == gen16.reference_signature([image])


def test_processed_size_caps_area_and_crops_to_the_multiple():
    assert processed_size(1100, 1000, 16) == (976, 1072)  # 1 MP cap: int(1100 s) = 1073 -> 1072, int(1000 s) -> 976
    h, w = processed_size(4000, 3000, 16)
    assert h * w <= MAX_AREA and h % 16 == 0 and w % 16 == 0
    assert processed_size(67, 93, 4) == (92, 64) and processed_size(93, 67, 16) == (64, 80)


def test_reference_errors_are_typed_and_carry_the_value(gen16):
    from model.errors import ReferenceImageError, RequestError

    cases = [
        ([[_rgb(63, 80, 0)], []], "too_small", (80, 63)),
        ([[_rgb(64, 520, 0)], []], "aspect_ratio", 520 / 64),
        ([[_rgb(64, 64, 0)[..., 0]], []], "shape", (64, 64)),
        ([[_rgb(64, 64, 0).astype(np.float32)], []], "dtype", "float32"),
        ([["not an image"], []], "type", "str"),
        ([_rgb(64, 64, 0), []], "type", "ndarray"),
        ([[_rgb(64, 64, 0)], [_rgb(64, 80, 0)]], "signature", (((64, 64),), ((64, 80),))),
        ([[_rgb(64, 64, 0)], []], "signature", (((64, 64),), ())),
        ([[_rgb(64, 64, 0)]] * 3, "count", 3),
    ]
    for refs, reason, value in cases:
        with pytest.raises(ReferenceImageError) as e:
            gen16.generate(["a", "b"], [0, 1], num_inference_steps=1, reference_images=refs)
        assert isinstance(e.value, RequestError) and e.value.field == "reference_images"
        assert e.value.reason == reason and e.value.value == value, (reason, e.value)
    with pytest.raises(ReferenceImageError) as e:
        gen16.generate(["a", "b"], [0, 1], num_inference_steps=1, reference_images=[[_rgb(64, 64, 0)],
                                                                                     [_rgb(64, 64, 1), 7]])
    assert (e.value.index, e.value.prompt_index, e.value.reason) == (1, 1, "type")


# ------------------------------------------------------------------------------------------------- VAE encoder


@pytest.mark.parametrize("which", ["tiny", pytest.param("m16", marks=pytest.mark.slow)])  # m16: -m slow (CI time)
def test_vae_encoder_matches_diffusers(which, tiny_ckpt, m16_ckpt):
    from types import SimpleNamespace

    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline

    path = tiny_ckpt if which == "tiny" else m16_ckpt
    gen = model.load(path, dtype="float32", max_sequence_length=8)
    vae = AutoencoderKLFlux2.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
    assert not gen.reference_encoder.loaded  # text-to-image never reads the encoder
    pixels = preprocess(_rgb(64, 96, 3), gen.size_multiple).pixels
    x = torch.from_numpy(pixels.transpose(2, 0, 1)[None].copy())
    with torch.no_grad():
        mode = vae.encode(x).latent_dist.mode()
        pipe = SimpleNamespace(vae=vae, _patchify_latents=Flux2KleinPipeline._patchify_latents)
        tokens = Flux2KleinPipeline._pack_latents(Flux2KleinPipeline._encode_vae_image(pipe, x, None))
    encoder = gen.reference_encoder.loader()
    ours_mode = np.asarray(encoder.posterior_mean(pixels[None])).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(ours_mode, _np(mode), atol=1e-4, rtol=1e-4)
    ours = np.asarray(gen.reference_encoder.encode_one(pixels))
    print(f"{which}: encoder tokens max |diff| {np.abs(ours - _np(tokens)).max():.2e}")
    np.testing.assert_allclose(ours, _np(tokens), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------- end to end


def test_one_reference_sets_the_size(gen16, pipe16):
    """height/width None: the first reference's processed size (70x90 RGBA array -> 64x80, cropped)."""
    ref = _rgba(70, 90, 1)
    ours = gen16.generate(["make it blue"], [4], num_inference_steps=2, reference_images=[[ref]])
    assert ours.shape == (1, 64, 80, 3)
    _assert_images_close(ours, _diffusers(pipe16, gen16, ["make it blue"], [4], [ref], 64, 80, 2), "one ref")


def test_several_references_batch_and_images_per_prompt(gen16, pipe16):
    """Three references of different sizes and modes (palette, RGB, odd-size RGBA), two prompts sharing them, two
    images per prompt; every distinct reference is encoded once."""
    refs = [_palette(100, 75, 2), _rgb(64, 64, 3), _rgba(81, 130, 4)]
    prompts, seeds = ["a red cat on a mat", "an astronaut"], [3, 11]
    before = gen16.stats["references_encoded"]
    ours = gen16.generate(prompts, seeds, height=32, width=48, num_inference_steps=2, num_images_per_prompt=2,
                          reference_images=[refs, refs])
    assert gen16.stats["references_encoded"] - before == 3
    ref = _diffusers(pipe16, gen16, prompts, seeds, refs, 32, 48, 2, k=2)
    _assert_images_close(ours, ref, "three refs, batch 2 x 2")


def test_per_prompt_reference_sets(gen16, pipe16):
    """Prompts with different references of the same sizes in one call: each equals diffusers with its own set;
    a reference repeated in one list is encoded once."""
    a, b = _rgb(64, 80, 7), _rgb(70, 90, 8)
    before = gen16.stats["references_encoded"]
    ours = gen16.generate(["one", "two"], [1, 2], num_inference_steps=2, reference_images=[[a, a], [b, a]])
    assert gen16.stats["references_encoded"] - before == 2
    for i, (prompt, seed, refs) in enumerate([("one", 1, [a, a]), ("two", 2, [b, a])]):
        _assert_images_close(ours[i:i + 1], _diffusers(pipe16, gen16, [prompt], [seed], refs, 64, 80, 2),
                             f"prompt {i}")


def test_text_to_image_is_unchanged(gen16):
    base = gen16.generate(["x", "y"], [1, 2], height=32, width=32, num_inference_steps=2)
    for none in (None, [[], []], [None, ()]):
        np.testing.assert_array_equal(gen16.generate(["x", "y"], [1, 2], height=32, width=32, num_inference_steps=2,
                                                     reference_images=none), base)
    assert gen16.check_inputs(["x"], [1], None, None).height == model.contract.DEFAULT_SIZE


def test_base_model_with_guidance(tiny_checkpoint_factory):
    """CFG: both branches carry the same references."""
    from diffusers import Flux2KleinPipeline

    path = tiny_checkpoint_factory(distilled=False, **M16)
    gen = model.load(path, dtype="float32", max_sequence_length=MAX_LEN)
    pipe = Flux2KleinPipeline.from_pretrained(path, torch_dtype=torch.float32)
    refs = [_rgb(64, 64, 9)]
    ours = gen.generate(["a lighthouse", ""], [5, 6], height=32, width=32, num_inference_steps=2,
                        guidance_scale=4.0, reference_images=[refs, refs])
    _assert_images_close(ours, _diffusers(pipe, gen, ["a lighthouse", ""], [5, 6], refs, 32, 32, 2, 4.0), "cfg")


def test_default_tiny_checkpoint_size_multiple_4(tiny_ckpt):
    """The default tiny VAE (multiple 4): a 64 px reference is 256 tokens, an odd size crops by a few pixels."""
    from diffusers import Flux2KleinPipeline

    gen = model.load(tiny_ckpt, dtype="float32", max_sequence_length=MAX_LEN)
    pipe = Flux2KleinPipeline.from_pretrained(tiny_ckpt, torch_dtype=torch.float32)
    refs = [_rgb(66, 71, 10)]
    ours = gen.generate(["a cat"], [3], height=32, width=32, num_inference_steps=2, reference_images=[refs])
    _assert_images_close(ours, _diffusers(pipe, gen, ["a cat"], [3], refs, 32, 32, 2), "multiple 4")


def test_bf16_follows_diffusers_bf16(m16_ckpt):
    """In bfloat16 the encoder, its BN normalisation and the reference tokens follow diffusers' bfloat16 pipeline."""
    from diffusers import Flux2KleinPipeline

    from benchmarks.similarity import ssim

    gen = model.load(m16_ckpt, dtype="bfloat16", max_sequence_length=MAX_LEN)
    pipe = Flux2KleinPipeline.from_pretrained(m16_ckpt, torch_dtype=torch.bfloat16)
    refs = [_rgb(64, 64, 3), _rgb(80, 64, 5)]
    prompts, seeds = ["a red cat on a mat", "an astronaut"], [3, 11]
    ours = gen.generate(prompts, seeds, height=32, width=48, num_inference_steps=2, reference_images=[refs, refs])
    ref = (_diffusers(pipe, gen, prompts, seeds, refs, 32, 48, 2) * 255).round().astype(np.uint8)
    scores = [ssim(a, b) for a, b in zip(ours, ref)]
    diff = np.abs(ours.astype(int) - ref.astype(int))
    print(f"bf16 editing vs diffusers bf16: SSIM {scores}, max |diff| {diff.max()}, mean |diff| {diff.mean():.3f}")
    assert ref.std() > 10, "reference images are flat: the check would prove nothing"
    assert min(scores) > 0.98 and diff.mean() < 4.0
