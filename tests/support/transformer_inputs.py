"""Random inputs for a tiny transformer's forward pass: what the tests comparing its forms or layouts feed it."""


def transformer_inputs(cfg, text_len: int, grid_h: int, grid_w: int):
    """(img, txt, t, cos, sin) for a batch of two: random image and text tokens, timesteps 0.7 and 0.3, and the RoPE
    tables of `text_len` text tokens followed by a `grid_h` x `grid_w` image (`cfg`: a TransformerConfig)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from model.nets.transformer import image_ids, rope_tables, text_ids

    ids = np.concatenate([text_ids(text_len), image_ids(grid_h, grid_w)])
    cos, sin = (jnp.asarray(t) for t in rope_tables(ids, cfg.axes_dims_rope, cfg.rope_theta))
    key = jax.random.key(0)
    img = jax.random.normal(key, (2, grid_h * grid_w, cfg.in_channels))
    txt = jax.random.normal(jax.random.fold_in(key, 1), (2, text_len, cfg.joint_attention_dim))
    return img, txt, jnp.array([0.7, 0.3]), cos, sin
