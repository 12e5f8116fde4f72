"""The project's one local cache folder, under which every cache it writes on a machine lives.

`cache_root()` is `$FLUX2_KLEIN_CACHE` when set, else `$XDG_CACHE_HOME/flux2-klein-beam`, else
`~/.cache/flux2-klein-beam` (an empty variable counts as unset). Below it:
- `checkpoints/`: the copies of `gs://` checkpoints (model/loading/checkpoint.py);
- `demo-<spec hash>/`: the bundled demo's tiny random-weight checkpoint (tiny_klein.ensure_demo_checkpoint);
- `bench/`: the benchmarks' random-weight checkpoints (benchmarks/presets.py).
"""

from __future__ import annotations

import os

CACHE_ENV = "FLUX2_KLEIN_CACHE"
CACHE_FOLDER = "flux2-klein-beam"


def cache_root() -> str:
    """The project's cache folder (not created here)."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, CACHE_FOLDER)
