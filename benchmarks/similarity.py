"""Compare two folders of PNGs by file name: SSIM per image and mean, plus max / mean absolute pixel difference.

    python -m benchmarks.similarity DIR_A DIR_B [--min-ssim 0.99] [--out result.json]

Prints one JSON object. SSIM is Wang et al. (2004) as in their reference implementation: an 11x11 Gaussian window
with sigma 1.5 (separable, "valid" filtering, no padding), K1 = 0.01, K2 = 0.03, dynamic range L = 255, computed
per colour channel in float64 and averaged over channels and positions. Images smaller than the window use the
largest odd window that fits. Only numpy and Pillow are used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

K1, K2 = 0.01, 0.03
WINDOW, SIGMA = 11, 1.5


def gaussian_kernel(size: int = WINDOW, sigma: float = SIGMA) -> np.ndarray:
    """Normalised 1-D Gaussian of odd length `size`."""
    x = np.arange(size, dtype=np.float64) - (size - 1) / 2
    k = np.exp(-(x * x) / (2 * sigma * sigma))
    return k / k.sum()


def _filter_valid(x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """Separable 'valid' correlation of x [H, W, ...] with the 1-D kernel along H and W."""
    n = len(kernel)
    rows = np.lib.stride_tricks.sliding_window_view(x, n, axis=0)  # [H-n+1, W, ..., n]
    x = np.tensordot(rows, kernel, axes=([-1], [0]))
    cols = np.lib.stride_tricks.sliding_window_view(x, n, axis=1)
    return np.tensordot(cols, kernel, axes=([-1], [0]))


def ssim(a: np.ndarray, b: np.ndarray, data_range: float = 255.0) -> float:
    """Mean SSIM of two images of the same shape ([H, W] or [H, W, C]); channels are averaged."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"images differ in shape: {a.shape} vs {b.shape}")
    if a.ndim not in (2, 3):
        raise ValueError(f"expected [H, W] or [H, W, C], got shape {a.shape}")
    size = min(WINDOW, a.shape[0], a.shape[1])
    size -= 1 - size % 2  # odd
    if size < 1:
        raise ValueError(f"image too small for SSIM: {a.shape}")
    kernel = gaussian_kernel(size, SIGMA)
    c1, c2 = (K1 * data_range) ** 2, (K2 * data_range) ** 2
    mu_a, mu_b = _filter_valid(a, kernel), _filter_valid(b, kernel)
    var_a = _filter_valid(a * a, kernel) - mu_a * mu_a
    var_b = _filter_valid(b * b, kernel) - mu_b * mu_b
    cov = _filter_valid(a * b, kernel) - mu_a * mu_b
    num = (2 * mu_a * mu_b + c1) * (2 * cov + c2)
    den = (mu_a * mu_a + mu_b * mu_b + c1) * (var_a + var_b + c2)
    return float(np.mean(num / den))


def load_png(path: str) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        if im.mode not in ("RGB", "L"):
            im = im.convert("RGB")
        return np.asarray(im)


def compare_images(a: np.ndarray, b: np.ndarray) -> dict:
    """SSIM and absolute pixel differences (in 0..255 units) of two uint8 images."""
    if a.ndim != b.ndim:  # grey vs colour: compare as colour
        a = a if a.ndim == 3 else np.repeat(a[..., None], 3, axis=-1)
        b = b if b.ndim == 3 else np.repeat(b[..., None], 3, axis=-1)
    diff = np.abs(a.astype(np.int32) - b.astype(np.int32))
    return {"ssim": ssim(a, b), "max_abs_diff": int(diff.max()), "mean_abs_diff": float(diff.mean())}


def compare_folders(dir_a: str, dir_b: str) -> dict:
    """Compare the PNGs that two folders share by file name; lists the names found in only one of them."""
    for d in (dir_a, dir_b):
        if not os.path.isdir(d):
            raise FileNotFoundError(f"not a folder: {d}")
    names_a = {f for f in os.listdir(dir_a) if f.lower().endswith(".png")}
    names_b = {f for f in os.listdir(dir_b) if f.lower().endswith(".png")}
    common = sorted(names_a & names_b)
    images, errors = [], []
    for name in common:
        a, b = load_png(os.path.join(dir_a, name)), load_png(os.path.join(dir_b, name))
        if a.shape != b.shape:
            errors.append({"name": name, "error": f"shape {list(a.shape)} vs {list(b.shape)}"})
            continue
        images.append({"name": name, **compare_images(a, b)})
    result = {
        "dir_a": os.path.abspath(dir_a),
        "dir_b": os.path.abspath(dir_b),
        "compared": len(images),
        "mean_ssim": float(np.mean([r["ssim"] for r in images])) if images else None,
        "min_ssim": float(np.min([r["ssim"] for r in images])) if images else None,
        "max_abs_diff": int(max(r["max_abs_diff"] for r in images)) if images else None,
        "mean_abs_diff": float(np.mean([r["mean_abs_diff"] for r in images])) if images else None,
        "images": images,
        "only_in_a": sorted(names_a - names_b),
        "only_in_b": sorted(names_b - names_a),
        "errors": errors,
    }
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.similarity", description=__doc__.splitlines()[0])
    parser.add_argument("dir_a")
    parser.add_argument("dir_b")
    parser.add_argument("--min-ssim", type=float, default=None,
                        help="exit with status 1 if any compared image has a lower SSIM")
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    try:
        result = compare_folders(args.dir_a, args.dir_b)
    except FileNotFoundError as e:
        print(json.dumps({"error": str(e)}))
        return 2
    text = json.dumps(result, indent=None)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    print(text)
    if result["compared"] == 0 or result["errors"]:
        return 2
    if args.min_ssim is not None and result["min_ssim"] < args.min_ssim:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
