"""One Beam job on the chip (in-process FnApiRunner): its images equal `generate()`'s for the same prompts."""

import io
import json
import os

import numpy as np
from PIL import Image

PROMPTS = ["a red fox in the snow", "a lighthouse at night", "a bowl of cherries"]


def test_job_images_equal_generate(chip_checkpoint, tmp_path):
    import model
    from pipeline.run import run

    ckpt = chip_checkpoint()
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p, "seed": 10 + i}) + "\n"
                              for i, p in enumerate(PROMPTS)))
    out = tmp_path / "out"
    _, summary = run([f"--model={ckpt}", f"--input={source}", f"--output={out}", "--dtype=bfloat16",
                      "--max_sequence_length=32", "--batch_size=2", "--height=32", "--width=48",
                      "--runner=FnApiRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1",
                      "--no_progress"])
    assert summary["images_generated"] == len(PROMPTS) and summary["failed"] == 0
    gen = model.load(ckpt, "bfloat16", max_sequence_length=32, batch_size=2)
    want = gen.generate(PROMPTS, [10, 11, 12], height=32, width=48)
    for i in range(len(PROMPTS)):
        with open(os.path.join(out, "images", f"p{i}.png"), "rb") as fh:
            got = np.asarray(Image.open(io.BytesIO(fh.read())).convert("RGB"))
        assert int(np.max(np.abs(got.astype(int) - want[i].astype(int)))) <= 1, f"image p{i} differs"
