"""Tiny random-weight FLUX.2 [klein] checkpoints in the exact diffusers layout, for tests, the demo and benchmarks.

`build_tiny_checkpoint(path, spec)` writes what `diffusers.Flux2KleinPipeline.save_pretrained` writes for a real
klein repo (model_index.json with `is_distilled`, transformer/, text_encoder/, vae/, tokenizer/, scheduler/), but
with every size taken from a `TinySpec`. The weights are built by the reference libraries' own classes and saved
by their own `save_pretrained` (sharded safetensors with `*.index.json`), then every tensor is redrawn from a
deterministic generator so that nothing is zero and no layer is an identity. The tokenizer is a small byte-level
BPE trained here with `tokenizers`, wrapped as a Qwen2 tokenizer with Qwen3's chat template.

torch, diffusers and transformers are imported lazily inside the builder: importing this module needs only the
standard library. It lives outside the runtime packages (model/, transforms/, pipeline/), which never import it;
only the demo (pipeline/demo.py) does, when it runs. `ensure_demo_checkpoint()` builds the demo checkpoint once
into the project's cache folder (model.loading.cache_paths.cache_root) and reuses it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import zlib

# Bump when the builder's output changes for an unchanged spec, so cached demo checkpoints are rebuilt.
BUILD_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class TinySpec:
    """Every size of a tiny klein checkpoint; the defaults build in a few seconds and shard every model."""

    # transformer (diffusers Flux2Transformer2DModel); in_channels = vae_latent_channels * 4
    num_layers: int = 1
    num_single_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple = (4, 4, 4, 4)
    mlp_ratio: float = 3.0
    guidance_embeds: bool = False
    timestep_guidance_channels: int = 32
    # text encoder (transformers Qwen3ForCausalLM); joint_attention_dim = len(out_layers) * text_hidden_size
    text_hidden_size: int = 16
    text_intermediate_size: int = 32
    text_num_layers: int = 28
    text_heads: int = 2
    text_kv_heads: int = 1
    text_head_dim: int = 8
    text_rope_theta: float = 1e6
    text_out_layers: tuple = (9, 18, 27)
    text_tie_word_embeddings: bool = True
    text_hidden_act: str = "silu"
    text_sliding_window: int | None = None  # set: use_sliding_window with this window ...
    text_max_window_layers: int | None = None  # ... on the layers from this index on (None: the encoder's depth)
    tokenizer_padding_side: str = "right"
    tokenizer_vocab_size: int = 384  # byte-level BPE size before the special tokens are appended
    # vae (diffusers AutoencoderKLFlux2); 2 ** (len(vae_block_out_channels) - 1) is the VAE scale factor
    vae_block_out_channels: tuple = (8, 16)
    vae_layers_per_block: int = 1
    vae_latent_channels: int = 4
    vae_norm_num_groups: int = 4
    vae_use_quant_conv: bool = True
    vae_use_post_quant_conv: bool = True
    vae_mid_block_add_attention: bool = True
    distilled: bool = True
    dtype: str = "float32"  # "float32" or "bfloat16": the dtype of the saved safetensors
    seed: int = 0
    max_shard_size: str = "64KB"  # small enough that transformer, text_encoder and vae are all sharded

    @property
    def joint_attention_dim(self) -> int:
        return len(self.text_out_layers) * self.text_hidden_size

    @property
    def in_channels(self) -> int:
        return self.vae_latent_channels * 4

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_block_out_channels) - 1)

    @property
    def size_multiple(self) -> int:
        """Image height and width must be multiples of this (VAE scale factor x 2x2 latent patch)."""
        return self.vae_scale_factor * 2

    def validate(self) -> None:
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim "
                             f"{self.attention_head_dim}")
        if any(a % 2 for a in self.axes_dims_rope):
            raise ValueError(f"every axes_dims_rope entry must be even, got {self.axes_dims_rope}")
        if self.text_heads % self.text_kv_heads:
            raise ValueError("text_heads must be a multiple of text_kv_heads")
        if self.text_out_layers and max(self.text_out_layers) > self.text_num_layers:
            raise ValueError(f"text_out_layers {self.text_out_layers} need at least {max(self.text_out_layers)} "
                             f"text layers, spec has {self.text_num_layers}")
        if any(c % self.vae_norm_num_groups for c in self.vae_block_out_channels):
            raise ValueError("vae_block_out_channels must be multiples of vae_norm_num_groups")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.tokenizer_padding_side not in ("left", "right"):
            raise ValueError(f"tokenizer_padding_side must be 'left' or 'right', got {self.tokenizer_padding_side!r}")
        if self.tokenizer_vocab_size < 256 + 8:
            raise ValueError("tokenizer_vocab_size must exceed the 256 byte tokens")

    def to_json(self) -> str:
        """The spec as JSON; fields added later are left out while at their defaults, so that the specs written
        before them keep their hashes (and their cached checkpoints)."""
        fields = dataclasses.asdict(self)
        for name, default in _LATER_FIELDS.items():
            if fields[name] == default:
                del fields[name]
        return json.dumps(fields, sort_keys=True)


_LATER_FIELDS = {"text_hidden_act": "silu", "text_sliding_window": None, "text_max_window_layers": None,
                 "tokenizer_padding_side": "right"}


# The demo's checkpoint: the default tiny widths, but the real VAE's depth (four blocks: scale 8, so with the 2x2
# latent patch image sizes are multiples of 16), so that a size costs the demo, relatively, what it costs the real
# model (the default TinySpec's two blocks make 4x4 = 16x more image tokens at any size).
DEMO_SPEC = TinySpec(vae_block_out_channels=(8, 8, 16, 16))

# Qwen3's special tokens, appended after the BPE vocabulary as in the real tokenizer (pad = <|endoftext|>).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")

# The subset of Qwen3's chat template that text-to-image prompts use: plain-string messages, the generation prompt,
# and the empty think block that `enable_thinking=False` adds. Renders exactly like the real template for these.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# Qwen2/Qwen3 pre-tokenizer split pattern (a public property of the tokenizer format).
_QWEN_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Built-in training text for the tiny BPE: prompt-like English, so common words become single tokens.
_CORPUS = """\
A small cactus with a happy face in the Sahara desert at sunset.
A photograph of a red fox sitting in the snow, soft morning light, shallow depth of field.
An astronaut riding a horse on the moon, highly detailed digital art.
A cozy wooden cabin in a pine forest beside a quiet lake, mist over the water.
A bowl of fresh fruit on a kitchen table: apples, oranges, grapes and a banana.
The city skyline at night with neon signs reflected in the wet street after the rain.
A watercolor painting of a lighthouse on a rocky coast with waves crashing below.
A cat wearing a tiny hat and reading a book by the window, warm colors.
Portrait of an old man with a white beard, dramatic lighting, black and white photo.
A dog is dancing in a field of flowers under a bright blue sky.
Two children flying a kite on the beach on a windy summer afternoon.
A futuristic train crossing a bridge over a deep green valley, cinematic.
A plate of pasta with tomato sauce and basil, studio photo, top view.
A mountain landscape with snow covered peaks and a clear river in the foreground.
An oil painting of a sailing ship in a storm, dark clouds and lightning.
A close up of a butterfly on a purple flower, macro photography, vivid colors.
A robot and a girl sharing an umbrella in the rain, illustration, pastel tones.
A street market in the evening with lanterns, people, spices and colorful fabrics.
The quick brown fox jumps over the lazy dog. 0123456789 !?.,:;'"()[]{}-+*/=<>@#$%&
A still life of three blue vases and a lemon on a white cloth, minimal style.
An owl perched on a branch under the full moon, fantasy art, glowing eyes.
A steaming cup of coffee next to a laptop and a notebook on a wooden desk.
A hot air balloon floating above green hills and small villages at dawn.
Aerial view of a tropical island with white sand, palm trees and turquoise water.
"""


def _require_reference_stack():
    try:
        import diffusers  # noqa: F401
        import tokenizers  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("building a tiny checkpoint needs the reference stack: pip install -e '.[demo]' "
                          f"(torch and diffusers); missing: {e.name}") from e


def build_tiny_tokenizer(vocab_size: int = 384, padding_side: str = "right"):
    """A deterministic byte-level BPE with Qwen's pre-tokenizer and special tokens, as a transformers tokenizer.

    The BPE is trained on a small built-in corpus; the special tokens are appended after the BPE vocabulary (as in
    Qwen, where they sit above the byte-level vocabulary) and each encodes to a single id. Padding is with
    `<|endoftext|>`, on the right unless asked otherwise; the chat template renders Qwen3's prompt format.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AddedToken, Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    bpe.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    state = json.loads(bpe.to_str())
    vocab = dict(state["model"]["vocab"])
    n_bpe = len(vocab)
    for i, t in enumerate(SPECIAL_TOKENS):  # Qwen order: <|endoftext|>, <|im_start|>, <|im_end|>, ...
        vocab[t] = n_bpe + i
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["model"]["merges"]]

    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>", model_max_length=131072, padding_side=padding_side,
                         clean_up_tokenization_spaces=False, errors="replace", split_special_tokens=False)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True)
    tok.pad_token = "<|endoftext|>"
    tok.eos_token = "<|im_end|>"
    tok.padding_side = padding_side
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    if ids != list(range(n_bpe, n_bpe + len(SPECIAL_TOKENS))) or len(tok) != len(vocab):
        raise RuntimeError(f"special tokens did not get consecutive ids after the BPE vocabulary: {ids}")
    return tok


def _tensor_seed(seed: int, component: str, name: str) -> int:
    """Per-tensor seed: independent of iteration order and of the other tensors' shapes."""
    return (int(seed) * 0x9E3779B1 + zlib.crc32(f"{component}/{name}".encode())) % (2**63 - 1)


def _perturb_(component: str, module, seed: int) -> None:
    """Redraw every parameter and buffer of `module` in place so no tensor is zero and no layer is an identity.

    Matrices / conv kernels: N(0, 1/fan_in) (x16 variance for the transformer's AdaLN modulations; embeddings:
    N(0, 1)); 1-D `weight`s are norm scales: 1 + 0.1 N(0, 1);
    biases: 0.05 N(0, 1); batch-norm running stats: mean 0.1 N(0, 1), var U(0.5, 1.5).
    """
    import torch

    state = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name in sorted(state):
            t = state[name]
            g = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, component, name))
            if not t.is_floating_point():
                if name.endswith("num_batches_tracked"):
                    t.fill_(1000)
                continue

            def normal(std, mean=0.0, shape=t.shape):
                return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

            leaf = name.rsplit(".", 1)[-1]
            if leaf == "running_mean":
                new = normal(0.1)
            elif leaf == "running_var":
                new = torch.rand(t.shape, generator=g, dtype=torch.float32) + 0.5
            elif leaf == "bias":
                new = normal(0.05)
            elif t.ndim == 1:
                new = normal(0.1, 1.0)
            elif t.ndim >= 2 and "embed_tokens" in name:
                new = normal(1.0)
            elif t.ndim >= 2:
                fan_in = 1
                for s in t.shape[1:]:
                    fan_in *= int(s)
                # The shared AdaLN modulations get a larger gain so the gates are O(1): otherwise the residual
                # stream stays dominated by x_embedder and the prompt barely moves the output.
                gain = 4.0 if "modulation" in name else 1.0
                new = normal(gain * fan_in ** -0.5)
            else:  # 0-d float: nothing in these models, keep it non-zero anyway
                new = normal(0.1, 1.0)
            t.copy_(new.to(t.dtype))


def _build_components(spec: TinySpec, tokenizer):
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=spec.in_channels,
        out_channels=None,
        num_layers=spec.num_layers,
        num_single_layers=spec.num_single_layers,
        attention_head_dim=spec.attention_head_dim,
        num_attention_heads=spec.num_attention_heads,
        joint_attention_dim=spec.joint_attention_dim,
        timestep_guidance_channels=spec.timestep_guidance_channels,
        mlp_ratio=spec.mlp_ratio,
        axes_dims_rope=tuple(spec.axes_dims_rope),
        rope_theta=2000,
        eps=1e-6,
        guidance_embeds=spec.guidance_embeds,
    )

    n_tok = len(tokenizer)
    vocab_size = -(-n_tok // 64) * 64  # like Qwen: the embedding table is a little larger than the tokenizer
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text_config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.text_hidden_size,
        intermediate_size=spec.text_intermediate_size,
        num_hidden_layers=spec.text_num_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        head_dim=spec.text_head_dim,
        hidden_act=spec.text_hidden_act,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.text_tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(spec.text_rope_theta)},
        attention_bias=False,
        use_sliding_window=spec.text_sliding_window is not None,
        sliding_window=spec.text_sliding_window,
        max_window_layers=spec.text_num_layers if spec.text_max_window_layers is None else spec.text_max_window_layers,
        bos_token_id=pad_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=None,
    )
    text_encoder = Qwen3ForCausalLM(text_config)

    n_blocks = len(spec.vae_block_out_channels)
    vae = AutoencoderKLFlux2(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n_blocks,
        up_block_types=("UpDecoderBlock2D",) * n_blocks,
        block_out_channels=tuple(spec.vae_block_out_channels),
        layers_per_block=spec.vae_layers_per_block,
        act_fn="silu",
        latent_channels=spec.vae_latent_channels,
        norm_num_groups=spec.vae_norm_num_groups,
        sample_size=32 * spec.vae_scale_factor,
        use_quant_conv=spec.vae_use_quant_conv,
        use_post_quant_conv=spec.vae_use_post_quant_conv,
        mid_block_add_attention=spec.vae_mid_block_add_attention,
        batch_norm_eps=1e-4,
        batch_norm_momentum=0.1,
        patch_size=(2, 2),
    )

    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="exponential",
    )

    from diffusers.utils import logging as diffusers_logging

    dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # .to(bfloat16) warns about keep-in-fp32 modules these models lack
    try:
        for name, m in (("transformer", transformer), ("text_encoder", text_encoder), ("vae", vae)):
            _perturb_(name, m, spec.seed)
            if dtype != torch.float32:
                m.to(dtype)
            m.eval()
    finally:
        diffusers_logging.set_verbosity(verbosity)
    if spec.text_tie_word_embeddings:
        text_encoder.tie_weights()
    return scheduler, vae, text_encoder, transformer


def _check_sharded(root: str) -> None:
    """Every model folder must hold a safetensors index and the shards it names."""
    for comp in ("transformer", "text_encoder", "vae"):
        folder = os.path.join(root, comp)
        index = [f for f in os.listdir(folder) if f.endswith(".safetensors.index.json")]
        if len(index) != 1:
            raise RuntimeError(f"{comp}/ was not saved sharded (files: {sorted(os.listdir(folder))}); "
                               "lower TinySpec.max_shard_size")
        with open(os.path.join(folder, index[0])) as f:
            shards = set(json.load(f)["weight_map"].values())
        missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise RuntimeError(f"{comp}/ index names missing shards {missing}")


def _make_readable(root: str) -> None:
    """mkdtemp and the savers create owner-only entries; give them the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~umask)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o666 & ~umask)


def build_tiny_checkpoint(path: str, spec: TinySpec = TinySpec(), *, overwrite: bool = False) -> str:
    """Write a complete diffusers-layout FLUX.2 [klein] folder with tiny random weights at `path`; return `path`.

    The same spec (seed included) always gives byte-identical files. The folder is built next to `path` and moved
    into place at the end, so `path` never holds half a checkpoint. An existing non-empty `path` raises
    FileExistsError unless `overwrite` is true.
    """
    spec.validate()
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        if not overwrite:
            raise FileExistsError(f"{path} exists and is not empty (pass overwrite=True to replace it)")
    _require_reference_stack()
    import torch
    from diffusers import Flux2KleinPipeline

    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            tokenizer = build_tiny_tokenizer(spec.tokenizer_vocab_size, spec.tokenizer_padding_side)
            scheduler, vae, text_encoder, transformer = _build_components(spec, tokenizer)
        pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                  transformer=transformer, is_distilled=spec.distilled)
        pipe.save_pretrained(tmp, safe_serialization=True, max_shard_size=spec.max_shard_size)
        _check_sharded(tmp)
        _make_readable(tmp)
        if os.path.exists(path):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def spec_hash(spec: TinySpec) -> str:
    return hashlib.sha256(f"{BUILD_FORMAT}:{spec.to_json()}".encode()).hexdigest()[:16]


def ensure_demo_checkpoint(cache_dir: str | None = None, spec: TinySpec = DEMO_SPEC) -> str:
    """Path of the demo checkpoint `<cache_dir>/demo-<hash of spec>`, building it on first use.

    `cache_dir` defaults to the project's cache folder, `model.loading.cache_paths.cache_root()`. Concurrent callers are
    safe: each builds into its own temporary folder and renames it into place; a loser of that race discards its
    copy and uses the winner's, so no caller ever sees a partial checkpoint.
    """
    if not cache_dir:
        from model.loading.cache_paths import cache_root

        cache_dir = cache_root()
    root = os.path.abspath(cache_dir)
    final = os.path.join(root, f"demo-{spec_hash(spec)}")
    if os.path.isfile(os.path.join(final, "model_index.json")):
        return final
    os.makedirs(root, exist_ok=True)
    _require_reference_stack()
    staging = tempfile.mkdtemp(prefix=".demo-build-", dir=root)
    try:
        built = build_tiny_checkpoint(os.path.join(staging, "ckpt"), spec)
        try:
            os.rename(built, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "model_index.json")):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
