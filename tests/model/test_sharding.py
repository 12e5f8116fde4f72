"""Where parameters live on a mesh (model.parallel.sharding): every parameter of the published models declares logical
axes, and the PartitionSpecs they give are exactly those of the name-based rule they replaced.

fixtures/partition_specs.json was computed once, at 1f9b5ec, from the rule that matched layer names
(COLUMN_PARALLEL / ROW_PARALLEL / VOCAB_PARALLEL in the old model/parallel/sharding.py; the VAE never split), for every
parameter of klein-4B and klein-9B (block indices written `*`) and 2, 3, 4, 8 and 16 model shards, plus klein-4B's
text encoder with attention biases (the published one has none). It lists the split parameters; every other one was
replicated, P().
"""

import dataclasses
import json
import os

import pytest

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "partition_specs.json")


def _config(name):
    from model.loading.presets import preset_config

    config = preset_config(name.split("+")[0])
    if name.endswith("+attention_bias"):
        config = dataclasses.replace(config, text_encoder=dataclasses.replace(config.text_encoder,
                                                                              attention_bias=True))
    return config


def _checkpoint_modules(name):
    """{component: abstract module} of every tensor a complete checkpoint holds (model.engine.factory)."""
    from model.engine.factory import Networks

    networks = Networks(_config(name))
    modules = {"text_encoder": networks.text_encoder(full_depth=True), "transformer": networks.transformer(),
               "vae": networks.vae_decoder(with_encoder=True)}
    return {"text_encoder": modules["text_encoder"]} if name.endswith("+attention_bias") else modules


def _variables(modules):
    """(pattern, variable) of every variable: the component, then its path with list indices as `*`."""
    from flax import nnx

    for component, module in modules.items():
        for path, var in nnx.to_flat_state(nnx.state(module)):
            yield component + "." + ".".join("*" if isinstance(p, int) else str(p) for p in path), var


@pytest.mark.parametrize("preset", ["klein-4b", "klein-9b"])
def test_every_parameter_declares_its_axes(preset):
    """No parameter of the real models goes without logical axes, one per dimension, each a name of the table."""
    from model.parallel import sharding

    count = 0
    for pattern, var in _variables(_checkpoint_modules(preset)):
        axes = sharding.declared_axes(var, pattern)  # AxesError otherwise
        assert len(axes) == len(var.get_value().shape), pattern
        count += 1
    assert count > 300


@pytest.mark.parametrize("name", ["klein-4b", "klein-9b", "klein-4b+attention_bias"])
def test_partition_specs_equal_the_name_based_rule(name):
    """Each parameter's spec, at each shard count, equals the old rule's: split where it split (columns of fan-out
    projections with their biases, rows of fan-in ones and of the embedding table), replicated elsewhere, and
    replicated where the shard count does not divide the dimension."""
    from model.parallel import sharding

    table = json.load(open(FIXTURE))[name]
    modules = _checkpoint_modules(name)
    for shards, split in table.items():
        seen = set()
        for pattern, var in _variables(modules):
            spec = sharding.partition_spec(sharding.declared_axes(var, pattern), var.get_value().shape,
                                           {"data": 2, "model": int(shards)})
            assert (list(spec) if len(spec) else None) == split.get(pattern), (shards, pattern, spec)
            seen.add(pattern)
        assert set(split) <= seen, sorted(set(split) - seen)  # the fixture names no parameter that is gone


def test_one_shard_replicates_everything():
    from model.parallel import sharding
    from jax.sharding import PartitionSpec as P

    for pattern, var in _variables(_checkpoint_modules("klein-4b")):
        assert sharding.partition_spec(sharding.declared_axes(var, pattern), var.get_value().shape,
                                       {"data": 4, "model": 1}) == P(), pattern


def test_a_parameter_without_axes_or_with_unknown_ones_is_refused():
    """A layer that forgets its axes, or names one the table lacks, fails loudly instead of being replicated."""
    import jax.numpy as jnp
    from flax import nnx
    from model.parallel import sharding

    with pytest.raises(sharding.AxesError, match="no logical axes") as bare:
        sharding.declared_axes(nnx.Param(jnp.zeros((4, 8))), "blocks.0.to_q.weight")
    assert bare.value.path == "blocks.0.to_q.weight" and bare.value.axes is None
    with pytest.raises(sharding.AxesError, match="not in LOGICAL_AXIS_RULES") as unknown:
        sharding.declared_axes(sharding.param(jnp.zeros((4, 8)), ("embed", "headz")), "x.weight")
    assert unknown.value.axes == ("embed", "headz")
    with pytest.raises(sharding.AxesError, match="2 axes for a parameter of shape"):
        sharding.declared_axes(sharding.param(jnp.zeros((8,)), ("embed", "heads")), "x.bias")


def test_state_shardings_follow_the_declared_axes():
    """On a real (one-device) mesh and the tree structure of the state: what the engine and the loader place."""
    import jax
    from flax import nnx
    from model.parallel import sharding
    from model.nets.layers import Linear
    from model.parallel.mesh import make_mesh
    from model.options import EngineOptions

    layer = nnx.eval_shape(lambda: Linear(8, 16, bias=True, dtype=jax.numpy.float32, rngs=nnx.Rngs(0),
                                          axes=("embed", "heads")))
    state = nnx.state(layer)
    shardings = sharding.state_shardings(state, make_mesh(EngineOptions()))
    assert jax.tree.structure(shardings) == jax.tree.structure(state)
    assert all(s.spec == jax.sharding.PartitionSpec() for s in jax.tree.leaves(shardings))
    assert sharding.partition_spec(("embed", "heads"), (8, 16), {"model": 4}) == jax.sharding.PartitionSpec(
        None, "model")
    assert sharding.partition_spec(("heads",), (16,), {"model": 3}) == jax.sharding.PartitionSpec()
