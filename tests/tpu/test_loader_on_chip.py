"""On the chip the loader sends matrices and conv kernels in torch's layout and transposes them there: every
parameter must still equal the plain host read of its tensor, bit for bit, in bfloat16 and float32."""

import jax
import numpy as np
import pytest


def loaded_parameters_equal_plain_reads(path: str, dtype: str) -> int:
    """Load on the default (chip) device; compare each parameter with the checkpoint's tensor laid out on the host;
    return how many parameters were made by a transpose on the chip."""
    import model
    from model.loading import loader
    from model.loading.loader import flat_params, to_jax_axes
    from model.loading.safetensors_file import open_component

    loader.DEVICE_TRANSPOSES.clear()
    gen = model.load(path, dtype, max_sequence_length=32)
    transposed_on_device = 0
    for folder, module in zip(("text_encoder", "transformer", "vae"), gen.programs.modules()):
        files = open_component(f"{path}/{folder}")
        for name, value in flat_params(module).items():
            raw = files[name].read(name)
            want = np.asarray(to_jax_axes(name, raw, value.ndim).astype(value.dtype))
            got = np.asarray(jax.device_get(value))
            assert got.shape == want.shape and got.tobytes() == want.tobytes(), f"{folder}.{name} differs"
            transposed_on_device += loader.jax_axes_order(name, raw.ndim, value.ndim) is not None
    assert len(loader.DEVICE_TRANSPOSES) > 0, "the loader did not transpose on the chip"
    assert gen.load_phases["tensors"] > transposed_on_device > 0, gen.load_phases
    return transposed_on_device


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_weights_transposed_on_the_chip_equal_the_host_layout(chip_checkpoint, dtype):
    assert jax.default_backend() == "tpu"
    count = loaded_parameters_equal_plain_reads(chip_checkpoint(), dtype)
    print(f"{dtype}: {count} parameters transposed on the chip, each equal to the host layout")
