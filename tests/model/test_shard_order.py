"""Shard-major order of the fused projections (model/parallel/shard_order.py): pure index arithmetic, and a transformer
laid out for any shard count computing what the stored order computes. On 4 devices and on TPU the images and the
collectives are checked in test_fast_path.py and tests/pipeline/test_preflight.py."""

import numpy as np
import pytest

from model.parallel.shard_order import join_parts, usable_shards, shard_major_order, split_parts


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_order_split_and_join_invert_each_other(shards):
    import jax.numpy as jnp

    sizes = (8, 8, 8, 12, 12)
    stored = np.arange(2 * sum(sizes), dtype=np.float32).reshape(2, sum(sizes))
    order = shard_major_order(sizes, shards)
    assert sorted(order) == list(range(sum(sizes)))
    laid_out = stored[:, order]
    # each shard's even slice holds the s-th slice of every part
    per_shard = np.split(laid_out, shards, axis=1)[shards - 1]
    assert per_shard[0, 0] == 8 // shards * (shards - 1)
    parts = split_parts(jnp.asarray(laid_out), sizes, shards)
    for got, want in zip(parts, np.split(stored, np.cumsum(sizes)[:-1], axis=1)):
        np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(join_parts(parts, shards)), laid_out)


def test_shard_order_needs_every_part_divisible():
    assert usable_shards((8, 8, 12), 4) == 4
    assert usable_shards((8, 8, 12), 8) == 1  # 12 does not split in 8: stored order, replicated or resharded
    assert usable_shards((8,), 1) == 1


def test_transformer_laid_out_for_any_shard_count_gives_the_same_velocity(tiny_ckpt):
    """One device, random weights: laying the fused projections out for 2 or 4 shards (and back) changes the stored
    bytes but not the model's function (the blocks computing every token, and the last one image tokens only)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from model.config.configs import PipelineConfig
    from model.parallel.shard_order import order_for_shards, stored_to_order
    from model.nets.transformer import Flux2Transformer
    from transformer_inputs import transformer_inputs

    cfg = PipelineConfig.from_folder(tiny_ckpt).transformer
    model = Flux2Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    stored = jax.tree.map(np.asarray, nnx.state(model))
    img, txt, t, cos, sin = transformer_inputs(cfg, text_len=5, grid_h=2, grid_w=3)

    def velocity():
        return np.asarray(model(img, txt, t, cos, sin))

    want = velocity()
    for shards in (2, 4, 2, 1):
        order_for_shards(model, shards)
        assert {m.order_shards for _, m in nnx.iter_modules(model) if hasattr(m, "fused_parts")} == {shards}
        np.testing.assert_allclose(velocity(), want, rtol=1e-5, atol=1e-5)
    # back at one shard, every weight is bit-equal to the stored one
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(model)), stored)

    # the loader's per-tensor permutations give the same bytes as laying out a loaded module
    order_for_shards(model, 2)
    moves = stored_to_order(model)
    assert moves and all(path[-2] in ("to_qkv_mlp_proj", "to_out", "linear_in") for path in moves)
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    stored_flat = dict(nnx.to_flat_state(stored))
    for path, (order, axis) in moves.items():
        np.testing.assert_array_equal(np.asarray(flat[path].get_value()),
                                      np.take(np.asarray(stored_flat[path].get_value()), order, axis=axis))
