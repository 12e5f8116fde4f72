"""The one recipe for a checkpoint's networks and for the programs that run them on a mesh.

`Networks` builds the text encoder, transformer and VAE a config describes, as shapes only (nnx.eval_shape): as the
programs run them (for the loader to fill and the preflight to compile) or whole (every tensor a
complete checkpoint holds). `build_programs` makes the generator's compiled programs for a mesh from concrete or
abstract modules; `model.load` (through the generator) and the preflight (model.preflight.aot) both call it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from ..nets.attention import resolve_implementation
from ..config.configs import PipelineConfig
from .programs import CompiledPrograms
from ..errors import ConfigError
from ..options import DEFAULT_TEXT_ENCODER_OUT_LAYERS, EngineOptions
from ..nets.qwen3 import Qwen3TextEncoder
from ..nets.transformer import Flux2Transformer
from ..nets.vae import Flux2VAEDecoder, Flux2VAEEncoder
from ..loading.loader import expected_tensors
from ..loading.stored_tensors import COMPONENT_FOLDERS

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def check_text_width(config: PipelineConfig, out_layers, path: str | None = None) -> None:
    """ConfigError unless the text-encoder states the transformer reads (`out_layers`) stack to its
    joint_attention_dim; `path` names the transformer's config file in the error when known."""
    te, tr = config.text_encoder, config.transformer
    if len(out_layers) * te.hidden_size != tr.joint_attention_dim:
        raise ConfigError(f"{len(out_layers)} text-encoder hidden states of width {te.hidden_size} do not match the "
                          f"transformer's joint_attention_dim", path=path, key="joint_attention_dim",
                          value=tr.joint_attention_dim)


@dataclasses.dataclass(frozen=True)
class Networks:
    """The networks of one checkpoint config in one dtype, as shapes (`nnx.eval_shape`: no memory, no weights).

    `out_layers`: the text-encoder hidden states the transformer reads (the programs run the encoder up to the deepest
    of them); `quantize`: as EngineOptions.quantize."""

    config: PipelineConfig
    dtype: str = "bfloat16"
    out_layers: tuple[int, ...] = DEFAULT_TEXT_ENCODER_OUT_LAYERS
    quantize: str = "none"  # EngineOptions.quantize: the transformer's block projections int8 (model.nets.quantize)

    @property
    def jax_dtype(self):
        return DTYPES[self.dtype]

    def _abstract(self, build):
        return nnx.eval_shape(lambda: build(dtype=self.jax_dtype, rngs=nnx.Rngs(0)))

    def text_encoder(self, *, full_depth: bool = False):
        """Qwen3 up to the deepest state read (as the programs run it) or, `full_depth`, every layer."""
        return self._abstract(lambda **kw: Qwen3TextEncoder(self.config.text_encoder, self.out_layers,
                                                            full_depth=full_depth, quantize=self.quantize, **kw))

    def transformer(self):
        return self._abstract(lambda **kw: Flux2Transformer(self.config.transformer, quantize=self.quantize, **kw))

    def vae_decoder(self, *, with_encoder: bool = False):
        """The VAE's decoder side (what the decode program runs), with its encoder too when `with_encoder`."""
        return self._abstract(lambda **kw: Flux2VAEDecoder(self.config.vae, with_encoder=with_encoder, **kw))

    def vae_encoder(self):
        """The VAE's encoder side, for reference images."""
        return self._abstract(lambda **kw: Flux2VAEEncoder(self.config.vae, **kw))

    def run_modules(self) -> tuple:
        """(text encoder, transformer, VAE decoder) as the programs run them."""
        return self.text_encoder(), self.transformer(), self.vae_decoder()

    def stored_tensors(self, transformer=None) -> dict[str, tuple[dict, dict]]:
        """{component folder: (every tensor a complete checkpoint holds there, by name with its torch shape; those
        of them that may be absent)} for the folders the loader reads (COMPONENT_FOLDERS): what it validates before
        reading any weight, and what the launch checks from the files' headers. The whole text encoder and VAE
        (its encoder too, which reference images use); `transformer`: its shapes when the caller has them."""
        te = self.config.text_encoder
        lm_head = {"lm_head.weight": (te.vocab_size, te.hidden_size)}
        bn_count = {"bn.num_batches_tracked": ()}
        return {
            "text_encoder": (expected_tensors(self.text_encoder(full_depth=True), lm_head), lm_head),
            "transformer": (expected_tensors(self.transformer() if transformer is None else transformer), {}),
            "vae": (expected_tensors(self.vae_decoder(with_encoder=True), bn_count), bn_count),
        }


def build_programs(modules, *, dtype: str, mesh, options: EngineOptions, text_len: int,
                   abstract: bool = False) -> CompiledPrograms:
    """The generator's programs (encode, denoise, decode) over `mesh` for `modules` = (text encoder, transformer, VAE
    decoder): loaded ones, or `abstract` ones (shapes: the programs are only lowered and compiled), with the attention
    kernels `options` ask for as available on the mesh's platform."""
    platform = mesh.devices.flat[0].platform
    jdtype = DTYPES[dtype]
    return CompiledPrograms(
        *modules, dtype=jdtype, options=options, text_len=text_len,
        attention=resolve_implementation(options.attention, platform=platform, dtype=jdtype),
        text_attention=resolve_implementation(options.text_encoder_attention, masked=True, platform=platform,
                                              dtype=jdtype),
        mesh=mesh, abstract=abstract)
