"""Analytic model FLOPs of one FLUX.2 [klein] image, counted from the checkpoint's configs.

Only matrix products and convolutions are counted (2 FLOPs per multiply-add); norms, activations, RoPE and softmax
are not. Attention counts the dense QK^T and PV products that are executed (the causal text mask included: the
masked half is computed too). The text encoder is counted for the decoder layers actually run; the transformer per
denoising step and per batch row, twice with classifier-free guidance; the VAE decoder per conv / linear layer.
"""

from __future__ import annotations

from model.config import PipelineConfig, TextEncoderConfig, TransformerConfig, VAEConfig


def text_encoder_flops(cfg: TextEncoderConfig, seq_len: int, layers: int, lm_head: bool = False) -> float:
    """One prompt of `seq_len` tokens through `layers` Qwen3 decoder layers (plus the LM head if asked)."""
    h, q_dim, kv_dim = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    proj = 2 * seq_len * (h * q_dim + 2 * h * kv_dim + q_dim * h)
    mlp = 2 * seq_len * 3 * h * cfg.intermediate_size
    attn = 2 * 2 * seq_len * seq_len * q_dim
    total = layers * (proj + mlp + attn)
    if lm_head:
        total += 2 * seq_len * h * cfg.vocab_size
    return float(total)


def transformer_flops(cfg: TransformerConfig, text_len: int, image_tokens: int,
                      image_only_last_block: bool = False) -> float:
    """One forward pass of the Flux2 MMDiT for one batch row (`image_only_last_block`: the last single-stream block
    computes outputs for the image tokens only, and keys/values for the text tokens)."""
    d, m, t, n = cfg.inner_dim, cfg.mlp_hidden_dim, text_len, image_tokens
    s = t + n
    embed = 2 * n * cfg.in_channels * d + 2 * t * cfg.joint_attention_dim * d
    cond = 2 * (cfg.timestep_guidance_channels * d + d * d) * (2 if cfg.guidance_embeds else 1)
    cond += 2 * d * (6 * d + 6 * d + 3 * d) + 2 * d * 2 * d  # modulations + norm_out
    attention = 2 * 2 * s * s * d
    double = 2 * s * 4 * d * d + 2 * s * (2 * d * m + m * d) + attention  # img and txt streams: s tokens in all
    single = 2 * s * d * (3 * d + 2 * m) + 2 * s * (d + m) * d + attention
    out = 2 * n * d * cfg.out_channels
    singles = cfg.num_single_layers * single
    if image_only_last_block and cfg.num_single_layers:
        last = 2 * t * d * 2 * d + 2 * n * d * (3 * d + 2 * m) + 2 * n * (d + m) * d + 2 * 2 * n * s * d
        singles += last - single
    return float(embed + cond + cfg.num_layers * double + singles + out)


def _conv(h: int, w: int, cin: int, cout: int, k: int) -> float:
    return 2.0 * h * w * k * k * cin * cout


def _resnet(h: int, w: int, cin: int, cout: int) -> float:
    flops = _conv(h, w, cin, cout, 3) + _conv(h, w, cout, cout, 3)
    if cin != cout:
        flops += _conv(h, w, cin, cout, 1)
    return flops


def vae_decoder_flops(cfg: VAEConfig, grid_h: int, grid_w: int, fused_upsample: bool = False) -> float:
    """Decode one image whose packed latent grid is grid_h x grid_w (the transformer's token grid).
    `fused_upsample`: each upsampling conv does the 2x2 taps that reach a pixel's nearest copies (4/9 of the 3x3 conv
    over the upsampled copy; model.vae.UPSAMPLE_FORMS "phases" and "dilated")."""
    h, w = grid_h * cfg.patch_size[0], grid_w * cfg.patch_size[1]
    chans = list(cfg.block_out_channels)
    c = chans[-1]
    flops = _conv(h, w, cfg.latent_channels, cfg.latent_channels, 1) if cfg.use_post_quant_conv else 0.0
    flops += _conv(h, w, cfg.latent_channels, c, 3)
    flops += 2 * _resnet(h, w, c, c)
    if cfg.mid_block_add_attention:
        hw = h * w
        flops += 4 * 2.0 * hw * c * c + 2 * 2.0 * hw * hw * c
    prev = c
    for i, out_ch in enumerate(reversed(chans)):
        for j in range(cfg.layers_per_block + 1):
            flops += _resnet(h, w, prev if j == 0 else out_ch, out_ch)
        prev = out_ch
        if i != len(chans) - 1:
            if fused_upsample:
                flops += _conv(h + 1, w + 1, out_ch, 4 * out_ch, 2)
            else:
                flops += _conv(2 * h, 2 * w, out_ch, out_ch, 3)
            h, w = 2 * h, 2 * w
    flops += _conv(h, w, chans[0], cfg.out_channels, 3)
    return flops


def encoder_layers_run(cfg: TextEncoderConfig, out_layers=(9, 18, 27), truncated: bool = True) -> int:
    return max(out_layers) if truncated else cfg.num_hidden_layers


def image_flops(config: PipelineConfig, height: int, width: int, steps: int, *, text_len: int, cfg_guidance: bool,
                encoder_layers: int, prompts_per_image: float = 1.0, lm_head: bool = False,
                image_only_last_block: bool = False, fused_upsample: bool = False) -> dict:
    """FLOPs per image by stage: {'encode', 'denoise', 'decode', 'total'}.

    `prompts_per_image` is how many text-encoder passes one image costs (1 for distinct prompts; fewer when
    prompts repeat; +1/batch for the negative prompt with CFG is left to the caller).
    """
    scale = config.size_multiple
    gh, gw = height // scale, width // scale
    encode = prompts_per_image * text_encoder_flops(config.text_encoder, text_len, encoder_layers, lm_head)
    denoise = steps * (2 if cfg_guidance else 1) * transformer_flops(config.transformer, text_len, gh * gw,
                                                                 image_only_last_block)
    decode = vae_decoder_flops(config.vae, gh, gw, fused_upsample)
    return {"encode": encode, "denoise": denoise, "decode": decode, "total": encode + denoise + decode}
