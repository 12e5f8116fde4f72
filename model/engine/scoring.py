"""The scoring program: CLIP (and its heads) on the generated pixels while they are still on the devices.

`load_scorer(settings, mesh=..., dtype=...)` reads the CLIP checkpoint (transformers' CLIPModel layout: config.json,
model.safetensors, the CLIP tokenizer's files, preprocessor_config.json) and each head's safetensors file, places the
weights on the generator's mesh (replicated), and encodes the zero-shot labels once. Per batch, `Scorer.score` takes
the decode's uint8 pixels on the devices and each image's prompt: the prompts' text embeddings come from a cache
(each distinct prompt is encoded once, however many images it has), the images are preprocessed on the device as
CLIPImageProcessor does (model.engine.clip_preprocess) and scored in one jitted program; `Scorer.to_host` gives a
{score name: value} per image (model.config.score_settings names them).
"""

from __future__ import annotations

import logging
import os
import posixpath
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ..errors import CheckpointError
from ..loading.loader import expected_tensors, load_component, validate_component
from ..loading.safetensors_file import SafetensorsFile
from ..nets import clip
from ..nets.layers import precision_scope
from ..nets.score_heads import LinearStackHead, head_layout
from ..parallel.sharding import placement, state_shardings
from ..config.score_settings import CLIP_SCORE, ScoreSettings, label_score
from .clip_preprocess import ImageProcessing, preprocess
from .lru import LRUCache

logger = logging.getLogger(__name__)

# Files of a CLIP repository the scorer reads (a Hub snapshot fetches only these): the config, the image
# processing, the tokenizer's, and the safetensors weights (pickle, TensorFlow and Flax weights never).
CLIP_FILES = ("config.json", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
              "merges.txt", "special_tokens_map.json", "model.safetensors", "model.safetensors.index.json")
TEXT_CACHE_SIZE = 1024  # prompts whose embeddings a worker keeps (one per record's prompt)


def clip_files(paths, variant, where: str) -> list[str]:
    """Of a Hub repository's files, those the scorer reads (the root's CLIP_FILES and its weight shards)."""
    del variant
    names = [p for p in paths if "/" not in p]
    if "config.json" not in names:
        raise CheckpointError("the score model's repository has no config.json at its root: not a transformers "
                              "CLIPModel checkpoint", path=where)
    return [n for n in names if n in CLIP_FILES or (n.startswith("model-") and n.endswith(".safetensors"))]


def resolve_score_model(source: str, cache_dir: str | None = None) -> str:
    """The local folder of the score model: a folder as is, a gs:// prefix copied once per machine, a Hub id's
    snapshot (only CLIP_FILES fetched)."""
    from ..loading.checkpoint import resolve_checkpoint

    return resolve_checkpoint(source, cache_dir, hub_files=clip_files)


def resolve_head_file(source: str, cache_dir: str | None = None) -> str:
    """A head's local safetensors file: a local path as is, a gs:// object copied once (checked by its crc32c)."""
    if not source.startswith("gs://"):
        if not os.path.isfile(source):
            raise CheckpointError("score head file does not exist", path=source)
        return source
    from ..loading.checkpoint import resolve_checkpoint

    folder, name = posixpath.split(source.rstrip("/"))
    return os.path.join(resolve_checkpoint(folder, cache_dir), name)


def clip_tensors(config: clip.CLIPConfig, dtype) -> tuple[object, dict, dict]:
    """(the CLIPModel as shapes, every tensor its checkpoint holds with torch shapes, those that may be absent: the
    position-id buffers older checkpoints saved)."""
    abstract = nnx.eval_shape(lambda: clip.CLIPModel(config, dtype=dtype, rngs=nnx.Rngs(0)))
    buffers = {"text_model.embeddings.position_ids": (1, config.text.max_position_embeddings),
               "vision_model.embeddings.position_ids": (1, config.vision.num_patches + 1)}
    return abstract, expected_tensors(abstract, buffers), buffers


def read_head(path: str, embed_dim: int, mesh) -> LinearStackHead:
    """A head from its safetensors file, refused unless in LAION's layout (model.nets.score_heads.head_layout)."""
    sf = SafetensorsFile(path)
    layout = head_layout({n: tuple(e[1]) for n, e in sf.entries.items()}, embed_dim, path)
    head = nnx.eval_shape(lambda: LinearStackHead(layout))
    graph, state = nnx.split(head)
    leaves = []
    for p, var in nnx.to_flat_state(state):
        name = ".".join(str(k) for k in p)
        array = sf.read(name).astype(np.float32)
        leaves.append((p, var.replace(jnp.asarray(array.T if array.ndim == 2 else array))))
    state = nnx.from_flat_state(leaves)
    state = jax.device_put(state, state_shardings(state, mesh))
    return nnx.merge(graph, state)


def check_heads(settings: ScoreSettings, embed_dim: int) -> None:
    """At launch: each head's file exists and is in the layout (headers only; local files)."""
    for name, source in settings.heads:
        if source.startswith("gs://"):
            continue
        path = resolve_head_file(source)
        head_layout({n: tuple(e[1]) for n, e in SafetensorsFile(path).entries.items()}, embed_dim, path)


# openai/clip-vit-large-patch14's shapes (the documented default), for a score model the launch cannot read.
DEFAULT_CLIP_SHAPES = {
    "text_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12},
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "patch_size": 14},
    "projection_dim": 768,
}


def check_score_files(settings: ScoreSettings) -> None:
    """At launch, for a local score model: its CLIPModel config, and each local head in LAION's layout (headers
    only); ConfigError / CheckpointError naming the file. gs:// and Hub sources are checked as workers load them."""
    if os.path.isdir(settings.model):
        check_heads(settings, clip.read_config(settings.model).projection_dim)
    elif os.path.isfile(settings.model):
        raise CheckpointError("the score model must be a CLIP checkpoint's folder, not a file", path=settings.model)


def reserved_bytes(settings: ScoreSettings, dtype: str, height: int, width: int, batch: int) -> int:
    """Per-chip bytes the TPU preflight keeps free for the scorer (`scorer_bytes`): a local score model's own shapes,
    else ViT-L/14's; the heads by their files' sizes when local."""
    config = (clip.read_config(settings.model) if os.path.isdir(settings.model)
              else clip.CLIPConfig.from_dict(DEFAULT_CLIP_SHAPES))
    heads = sum(os.path.getsize(s) // 4 for _, s in settings.heads if os.path.isfile(s))
    return scorer_bytes(config, 2 if dtype == "bfloat16" else 4, height, width, batch, heads)


def load_tokenizer(folder: str):
    """transformers' CLIP tokenizer from the checkpoint folder (the tokenizer only)."""
    try:
        import transformers

        return transformers.CLIPTokenizerFast.from_pretrained(folder)
    except Exception as e:  # transformers raises many types for broken folders
        raise CheckpointError(f"cannot load the score model's CLIP tokenizer: {e}", path=folder) from e


class Scorer:
    """CLIP and its heads on a mesh, with the labels' embeddings, a prompt-embedding cache and the jitted programs."""

    def __init__(self, settings: ScoreSettings, model: clip.CLIPModel, heads: dict, tokenizer,
                 processing: ImageProcessing, *, mesh, dtype):
        self.settings = settings
        self.config = model.config
        self.processing = processing
        self.tokenizer = tokenizer
        self.mesh = mesh
        self.batched = NamedSharding(mesh, P("data"))
        self.replicated = NamedSharding(mesh, P())
        self._graph, self.state = nnx.split(model)
        self._head_names = tuple(heads)
        head_graphs, self.head_states = zip(*(nnx.split(h) for h in heads.values())) if heads else ((), ())
        self._text_cache = LRUCache(TEXT_CACHE_SIZE, "score text embeddings", log_drops=False)
        self._lock = threading.Lock()
        self.texts_encoded = 0
        graph = self._graph

        def encode_text(state, ids, mask):
            with precision_scope(dtype):
                return clip.unit(nnx.merge(graph, state).text_embeds(ids, mask))

        def score(state, head_states, pixels, text_unit, labels_unit):
            with precision_scope(dtype):
                model_ = nnx.merge(graph, state)
                image = clip.unit(model_.image_embeds(preprocess(pixels, processing).astype(dtype)))
                out = {CLIP_SCORE: jnp.maximum(100.0 * jnp.sum(image * text_unit, axis=-1), 0.0)}
                if labels_unit is not None:
                    logits = jnp.exp(model_.logit_scale[...]) * image @ labels_unit.T
                    out["labels"] = jax.nn.softmax(logits, axis=-1)
                for name, g, s in zip(self._head_names, head_graphs, head_states):
                    out[name] = nnx.merge(g, s)(image)
                return out

        self._encode_text = jax.jit(encode_text)
        self._score = jax.jit(score)
        self.labels_unit = self.encode_texts(list(settings.labels)) if settings.labels else None

    def tokenize(self, texts: list[str]):
        length = self.config.text.max_position_embeddings
        tok = self.tokenizer(texts, padding="max_length", truncation=True, max_length=length, return_tensors="np")
        return tok["input_ids"].astype(np.int32), tok["attention_mask"].astype(np.int32)

    def encode_texts(self, texts: list[str]):
        """Unit text embeddings [len(texts), D] on the devices (replicated), padded to a power of two of rows so
        that few shapes compile."""
        rows = 1 << max(0, (len(texts) - 1).bit_length())
        ids, mask = self.tokenize(list(texts) + [""] * (rows - len(texts)))
        self.texts_encoded += len(texts)
        put = lambda a: jax.device_put(a, self.replicated)  # noqa: E731
        return self._encode_text(self.state, put(ids), put(mask))[:len(texts)]

    def text_rows(self, prompts: list[str]):
        """[len(prompts), D] unit embeddings of the prompts, each distinct prompt encoded once (and kept for the
        next batches)."""
        with self._lock:
            todo = [p for p in dict.fromkeys(prompts) if p not in self._text_cache]
            if todo:
                fresh = self.encode_texts(todo)
                for i, p in enumerate(todo):
                    self._text_cache[p] = fresh[i]
            rows = [self._text_cache[p] for p in prompts]
        return jax.device_put(jnp.stack(rows), self.batched)

    def score(self, pixels, prompts: list[str]) -> dict:
        """Scores of a batch on the devices: `pixels` uint8 [B, H, W, 3] (the decode's), `prompts` one per row
        (padding rows included). Dispatched, not waited for."""
        return self._score(self.state, self.head_states, pixels, self.text_rows(prompts), self.labels_unit)

    def to_host(self, scores: dict, real: int) -> list[dict]:
        """The first `real` images' scores as {name: float}, in ScoreSettings.names' order."""
        host = jax.device_get(scores)
        out = []
        for i in range(real):
            row = {CLIP_SCORE: float(host[CLIP_SCORE][i])}
            for k, label in enumerate(self.settings.labels):
                row[label_score(label)] = float(host["labels"][i, k])
            for name in self._head_names:
                row[name] = float(host[name][i])
            out.append(row)
        return out

    def lower(self, batch: int, height: int, width: int):
        """The image-scoring program lowered for a batch of `height` x `width` images (the preflight's and the
        benchmarks' view of its cost and memory)."""
        spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=self.batched)  # noqa: E731
        labels = None if self.labels_unit is None else self.labels_unit
        return self._score.lower(self.state, self.head_states, spec((batch, height, width, 3), jnp.uint8),
                                 spec((batch, self.config.projection_dim), jnp.float32), labels)


def scorer_bytes(config: clip.CLIPConfig, dtype_bytes: int, height: int, width: int, batch: int,
                 head_params: int = 0) -> int:
    """Device bytes the scorer adds beside the generator, from shapes alone (the preflight reserves them): CLIP's
    parameters and the heads', and the scoring program's largest buffers for `batch` images of height x width (the
    pixels as float32 and the first resize pass's output, the vision tower's widest activations)."""
    abstract = nnx.eval_shape(lambda: clip.CLIPModel(config, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract)))
    v = config.vision
    tokens = v.num_patches + 1
    per_image = 4 * (height * width * 3 + height * config.vision.image_size * 3
                     + 3 * tokens * max(v.intermediate_size, v.hidden_size))
    return (params + head_params) * dtype_bytes + batch * per_image


def load_scorer(settings: ScoreSettings, *, mesh, dtype, cache_dir: str | None = None) -> Scorer:
    """The scorer of `settings` on `mesh`, its weights in `dtype` (the generator's)."""
    start = time.perf_counter()
    folder = resolve_score_model(settings.model, cache_dir)
    config = clip.read_config(folder)
    abstract, expected, optional = clip_tensors(config, dtype)
    files = validate_component(folder, expected=expected, optional=optional)
    heads = {name: read_head(resolve_head_file(source, cache_dir), config.projection_dim, mesh)
             for name, source in settings.heads}
    model = load_component(folder, abstract, expected=expected, optional=optional, tensor_to_file=files,
                           placement=placement(mesh))
    scorer = Scorer(settings, model, heads, load_tokenizer(folder),
                    ImageProcessing.from_folder(folder, config.vision.image_size), mesh=mesh, dtype=dtype)
    logger.info("loaded the score model %s (%d heads, %d labels) in %.1f s", settings.model, len(heads),
                len(settings.labels), time.perf_counter() - start)
    return scorer
