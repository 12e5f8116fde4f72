"""The decode runs one image per data replica at a time (model.engine.programs.one_image_per_replica): every image
comes back in its own row, each turn sees one row per replica, and no image moves between devices."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np

from paths import REPO

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from model.engine.programs import one_image_per_replica

    replicas, batch = int(sys.argv[1]), int(sys.argv[2])
    mesh = jax.make_mesh((replicas,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:replicas])  # as model.parallel.mesh makes them
    batched = NamedSharding(mesh, P("data"))
    seen = []

    def fn(t):  # per image, but mixing each image's own values: a row taken from another image would show
        seen.append(t.shape[0])
        return t * 2.0 + jnp.sum(t, axis=(1, 2), keepdims=True)

    x = jax.device_put(np.arange(batch * 3 * 2, dtype=np.float32).reshape(batch, 3, 2) ** 1.5, batched)
    program = jax.jit(lambda x: one_image_per_replica(replicas, batched)(fn, x)).lower(x).compile()
    got = np.asarray(program(x))
    want = np.concatenate([np.asarray(fn(jnp.asarray(np.asarray(x)[i:i + 1]))) for i in range(batch)])
    text = program.as_text().lower()
    print(json.dumps({"max_diff": float(np.max(np.abs(got - want))),
                      "shape": list(got.shape), "turn_rows": seen[0],
                      "collectives": [c for c in ("all-gather", "all-to-all", "collective-permute", "all-reduce")
                                      if c in text]}))
""")


def _run(replicas: int, batch: int) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(replicas), str(batch)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_four_replicas_two_images_each_decode_in_two_turns_of_four_without_moving_an_image():
    result = _run(4, 8)
    assert result["shape"] == [8, 3, 2]
    assert result["max_diff"] < 1e-3, result
    assert result["turn_rows"] == 4, result  # one image per replica per turn
    assert result["collectives"] == [], result


def test_one_replica_decodes_image_by_image_and_one_image_per_replica_at_once():
    assert _run(1, 3)["turn_rows"] == 1
    whole = _run(4, 4)
    assert whole["turn_rows"] == 4 and whole["max_diff"] < 1e-3
