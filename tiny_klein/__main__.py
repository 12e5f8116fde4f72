"""`python -m tiny_klein DIR`: build the tiny checkpoints the test suites use into DIR/tiny-<spec hash>.

For machines without the reference stack (a TPU VM with only the runtime installed): build them where torch and
diffusers are installed, copy DIR over, and point FLUX2_TEST_CHECKPOINTS at it (tests/tpu reads it)."""

import argparse
import dataclasses
import os

from .builder import TinySpec, build_tiny_checkpoint, spec_hash

# The specs tests/tpu asks for: distilled and base at the default sizes, and the pipeline tests' 32x64 one.
SUITE_SPECS = (TinySpec(), TinySpec(distilled=False),
               dataclasses.replace(TinySpec(), vae_block_out_channels=(4, 4, 4, 4, 4), max_shard_size="16KB"))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tiny_klein", description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    args = ap.parse_args(argv)
    for spec in SUITE_SPECS:
        path = os.path.join(args.folder, f"tiny-{spec_hash(spec)}")
        if not os.path.isfile(os.path.join(path, "model_index.json")):
            build_tiny_checkpoint(path, spec, overwrite=True)
        print(path)


if __name__ == "__main__":
    main()
