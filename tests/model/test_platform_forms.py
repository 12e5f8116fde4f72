"""model.nets.platform_forms: the one place the per-platform forms are picked (the forms' math against diffusers:
tests/model/test_model_parity.py; their use in a TPU program: tests/pipeline/test_preflight.py)."""

import pytest


def test_tpus_get_their_forms_and_every_other_platform_the_plain_ones():
    from model.nets.platform_forms import PlatformForms, forms_for

    for platform in ("cpu", "gpu"):
        assert forms_for(platform) == forms_for(platform, "NVIDIA L4") == PlatformForms()
        assert (forms_for(platform).rope, forms_for(platform).upsample) == ("pairs", "phases")
    for kind in ("TPU v5 lite", "TPU v6 lite", "TPU v5", None):
        tpu = forms_for("tpu", kind)
        assert (tpu.rope, tpu.upsample, tpu.heads_kernel) == ("matmul", "dilated", True), kind
        assert tpu.flash_kernel == (kind == "TPU v5 lite"), kind  # the flash kernel where it was measured faster
    with pytest.raises(ValueError, match="unknown RoPE form 'roll'"):
        PlatformForms(rope="roll")
    with pytest.raises(ValueError, match="unknown upsample form 'plain'"):
        PlatformForms(upsample="plain")


def test_splash_blocks_measured_on_v5e_else_the_largest_power_of_two_up_to_the_chips_cap():
    from model.nets.platform_forms import forms_for, splash_blocks

    v5e, v6e, unknown, cpu = (forms_for("tpu", "TPU v5 lite"), forms_for("tpu", "TPU v6 lite"),
                              forms_for("tpu", "TPU v9"), forms_for("cpu"))
    assert splash_blocks(v5e, 4608, 4608) == (1536, 1536, 512)  # the best measured triple at klein-4B's 1024x1024
    assert splash_blocks(v5e, 4608, 4608, 512) == (512, 512, 512)  # other head widths: the generic rule
    assert splash_blocks(v6e, 4096, 4096) == (1024, 1024, 1024)
    assert splash_blocks(unknown, 4096, 4096) == (512, 512, 512)
    assert splash_blocks(v6e, 700, 700) == (256, 256, 256)  # 768 after padding to 128: 256 divides it, 512 not
    assert splash_blocks(cpu, 4096, 4096) == (128, 128, 128)  # off TPU (interpret mode): the smallest block
