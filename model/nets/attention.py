"""Scaled dot-product attention with interchangeable implementations and optional masks.

Shapes: q [B, Lq, H, D], k/v [B, Lk, Hkv, D] with H a multiple of Hkv (grouped-query attention). Masks, all optional
and combined (a key is attended only where every one allows it):
- `mask`: boolean, broadcastable to [B, H, Lq, Lk], True where a query may attend to a key;
- `causal`: query i attends to keys j <= i (self-attention, Lq == Lk);
- `key_mask`: [B, Lk], True (or 1) for the keys that may be attended (the text encoder's padding mask).
A query row that may attend to no key gets zeros, as PyTorch's scaled_dot_product_attention gives with a boolean
mask (transformers' default "sdpa" attention, which diffusers' pipeline loads the text encoder with): the pad
positions before the first real token of a left-padded prompt. Every implementation goes through `attention`,
which zeroes such rows.
"""

from __future__ import annotations

import contextvars
import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import flash_attention
from .platform_forms import SPLASH_BLOCK, PlatformForms, forms_for, splash_blocks
from .scopes import scoped

logger = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "blocked", "splash")
KEY_BLOCK = 256  # keys per block of the block-wise attention without masks (a whole sequence when it does not divide)
# Keys per block when a mask is given (the text encoder's causal + padding masks). A block no query may attend is
# skipped, so smaller blocks skip more of a short prompt's padding; 128 was the fastest on CPU (docs/performance.md).
# Masked keys longer than a block are padded up to whole blocks (the padding masked too).
MASKED_KEY_BLOCK = 128
# The mesh the programs being traced run on (set by the engine around each program body): the splash kernel is
# partitioned over it with shard_map, and runs compiled (Mosaic) when its devices are TPUs, interpreted elsewhere.
_MESH: contextvars.ContextVar = contextvars.ContextVar("attention_mesh", default=None)


def mesh_context(mesh):
    """Trace attention for `mesh` (a jax.sharding.Mesh, or None for the default device)."""
    return scoped(_MESH, mesh)


def traced_platform() -> str:
    """The platform of the mesh being traced for (`mesh_context`), else JAX's default backend."""
    mesh = _MESH.get()
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def traced_devices() -> int:
    """How many devices the mesh being traced for (`mesh_context`) has (1 without one)."""
    mesh = _MESH.get()
    return 1 if mesh is None else mesh.devices.size


def _traced_device():
    mesh = _MESH.get()
    return mesh.devices.flat[0] if mesh is not None else jax.devices()[0]


def traced_forms() -> PlatformForms:
    """The forms (model.nets.platform_forms) of the devices the program being traced runs on: the mesh's
    (`mesh_context`), else JAX's default device."""
    device = _traced_device()
    return forms_for(device.platform, device.device_kind)


def resolve_implementation(name: str, masked: bool = False, devices: int = 1, platform: str | None = None,
                           dtype=None) -> str:
    """Map a requested implementation to one available on the target platform (with a logged fallback).

    `masked`: the caller passes a mask (the text encoder); "auto" then never picks cuDNN, whose masked path it avoids.
    `platform`: where the programs run (the mesh's devices; default: JAX's default backend). On TPU "auto" is the
    splash kernel on any mesh (partitioned over it by `attention`), for bf16 models; float32 models get XLA's attention
    there, whose matmuls run at the precision float32 promises. `devices` is kept for callers that pass it.
    """
    del devices
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {name!r}; choose one of {IMPLEMENTATIONS}")
    backend = platform or jax.default_backend()
    if name == "auto":  # on CPU the block-wise form is faster than XLA's (docs/performance.md)
        if backend == "tpu":  # float32 models: XLA's attention at the highest precision (layers.precision_scope)
            return "xla" if dtype is not None and jnp.dtype(dtype) == jnp.float32 else "splash"
        return {"gpu": "xla" if masked else "cudnn", "cpu": "blocked"}.get(backend, "xla")
    if name == "cudnn" and backend != "gpu":
        logger.warning("attention implementation 'cudnn' needs a GPU; using 'xla' on %s", backend)
        return "xla"
    if name == "splash" and backend != "tpu":
        logger.warning("attention implementation 'splash' is a TPU kernel; on %s it runs in Pallas interpret mode "
                       "(exact but slow: for tests)", backend)
    return name


def dense_mask(mask, causal: bool, key_mask, lq: int, lk: int):
    """The three mask forms as one boolean [B or 1, H or 1, Lq, Lk] (None when there is none)."""
    if causal:
        tril = jnp.tril(jnp.ones((lq, lk), bool))[None, None]
        mask = tril if mask is None else mask & tril
    if key_mask is not None:
        keys = key_mask[:, None, None, :]
        mask = keys if mask is None else mask & keys
    return mask


def _blocked_attention(q, k, v, mask, scale, block: int | None = None, causal: bool = False, key_mask=None,
                       skip_masked_blocks: bool = True):
    """Online-softmax attention over key blocks (a lax.scan): logits stay [B, Hkv, G*Lq, block], float32 accumulators.

    The layout is made once, outside the loop: queries grouped by the key/value head they share ([B, Hkv, G*Lq, D],
    so grouped-query attention needs no repeated K/V) and, in float32, already scaled; keys and values as
    [n, B, Hkv, block, D], which is faster than einsums on [B, L, H, D] blocks (docs/performance.md).
    `causal` and boolean `key_mask` are applied per block from positions (no [Lq, Lk] mask is read), and are not
    given together with a dense `mask` (`attention` folds such a mix into the dense one)."""
    b, lq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    masked = mask is not None or key_mask is not None
    block = block or (MASKED_KEY_BLOCK if masked else KEY_BLOCK)
    if masked and k.shape[1] > block:  # keys padded to whole blocks, the padding masked (exact zeros, skipped blocks)
        k, v, mask, key_mask = _pad_keys(k, v, mask, key_mask, -k.shape[1] % block, h, lq)
    lk = k.shape[1]
    block = block if lk % block == 0 else lk
    n = lk // block
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    fold_scale = q.dtype == jnp.float32  # in bf16 the scale stays on the float32 logits
    qg = (q * scale if fold_scale else q).reshape(b, lq, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * lq, d)
    kb = k.reshape(b, n, block, hkv, d).transpose(1, 0, 3, 2, 4)
    vb = v.reshape(b, n, block, hkv, d).transpose(1, 0, 3, 2, 4)
    # A key block no query may attend adds exactly nothing to a row that has seen an allowed key (its weights are
    # exp(min - max) = 0), so it is skipped: the text encoder's padding keys. Rows with no allowed key at all are
    # zeroed by `attention` whatever they hold here.
    blocks = {"k": kb, "v": vb, "start": jnp.arange(n) * block}
    if mask is not None:
        mask = jnp.broadcast_to(mask, (b, h, lq, lk))
        blocks["mask"] = mask.reshape(b, hkv, g * lq, n, block).transpose(3, 0, 1, 2, 4)
    if key_mask is not None:
        blocks["keys"] = key_mask.reshape(b, n, block).transpose(1, 0, 2)
    low = jnp.finfo(jnp.float32).min  # masked logits: exp(low - max) = 0 beside any allowed key

    def allowed(blk):
        """[B or 1, Hkv or 1, G*Lq, block] booleans for this key block, or None when every key is allowed."""
        ok = blk.get("mask")
        if causal:
            query_pos = jnp.tile(jnp.arange(lq), g)  # row r of a key/value head's group is query r % Lq
            key_pos = blk["start"] + jnp.arange(block)
            tri = (query_pos[:, None] >= key_pos[None, :])[None, None]
            ok = tri if ok is None else ok & tri
        if key_mask is not None:
            keys = blk["keys"][:, None, None, :]
            ok = keys if ok is None else ok & keys
        return ok

    def step(carry, blk):
        ok = allowed(blk)
        if not masked or not skip_masked_blocks:  # no mask, or only the causal one (every block serves a query)
            return update(carry, blk["k"], blk["v"], ok), None
        any_allowed = jnp.any(ok) if "mask" in blk else jnp.any(blk["keys"])  # key_mask alone: the cheap test
        return jax.lax.cond(any_allowed, lambda c: update(c, blk["k"], blk["v"], ok), lambda c: c, carry), None

    def update(carry, kk, vv, ok):
        m, total, acc = carry
        logits = jnp.einsum("bhqd,bhkd->bhqk", qg, kk, preferred_element_type=jnp.float32, precision=precision)
        if not fold_scale:
            logits = logits * scale
        if ok is not None:
            logits = jnp.where(ok, logits, low)
        m_new = jnp.maximum(m, logits.max(-1))
        p = jnp.exp(logits - m_new[..., None])
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(vv.dtype), vv, preferred_element_type=jnp.float32,
                        precision=precision)
        return m_new, total * corr + p.sum(-1), acc * corr[..., None] + pv

    init = (jnp.full((b, hkv, g * lq), -jnp.inf, jnp.float32), jnp.zeros((b, hkv, g * lq), jnp.float32),
            jnp.zeros((b, hkv, g * lq, d), jnp.float32))
    # Unrolled (a few blocks): bit-identical, and XLA schedules the blocks together (text encoder ~10% faster).
    (_, total, acc), _ = jax.lax.scan(step, init, blocks, unroll=True)
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]  # [B, Hkv, G*Lq, D] -> [B, Lq, H, D]
    return out.reshape(b, hkv, g, lq, d).transpose(0, 3, 1, 2, 4).reshape(b, lq, h, d)


def _pad_keys(k, v, mask, key_mask, pad: int, h: int, lq: int):
    """k, v with `pad` more (zero) keys at the end, and the masks extended to forbid them."""
    if not pad:
        return k, v, mask, key_mask
    b, lk = k.shape[:2]
    k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (k, v))
    if key_mask is not None:
        key_mask = jnp.pad(jnp.broadcast_to(key_mask, (b, lk)), ((0, 0), (0, pad)))
    if mask is not None:
        mask = jnp.pad(jnp.broadcast_to(mask, (b, h, lq, lk)), ((0, 0), (0, 0), (0, 0), (0, pad)))
    return k, v, mask, key_mask


@functools.lru_cache(maxsize=64)
def _splash_kernel(heads: int, lq: int, lk: int, causal: bool, interpret: bool, blocks: tuple = (SPLASH_BLOCK,) * 3,
                   multi_query: bool = False):
    """A splash kernel built once per shape: multi-head over `heads` query heads with their own keys and values
    (q, k, v [heads, L, D]), or, `multi_query`, `heads` query heads sharing one key/value head (k, v [L, D])."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    head_mask = splash.CausalMask((lq, lk)) if causal else splash.FullMask((lq, lk))
    bq, bkv, bkv_compute = blocks
    sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv_compute)
    make = splash.make_splash_mqa if multi_query else splash.make_splash_mha
    # Built inside a trace, the kernel's mask tables would be that trace's tracers, and the cached kernel would leak
    # them into the next program that uses it (UnexpectedTracerError): they are made as concrete arrays instead.
    with jax.ensure_compile_time_eval():
        return make(splash.MultiHeadMask([head_mask] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1,
                    interpret=interpret)


def _kernel_forms() -> tuple[bool, PlatformForms]:
    """(interpret, forms) for the kernels of the traced-for mesh (the default device without one): compiled on TPUs
    with their chip's forms, interpreted elsewhere, with that platform's (the smallest splash blocks, no flash)."""
    return _traced_device().platform != "tpu", traced_forms()


def _splash_padding(b: int, lq: int, lk: int, key_mask, blocks: tuple):
    """(query pad, key pad, q segment ids, kv segment ids or None) for sequences padded to whole splash blocks: every
    query is segment 1, allowed keys 1, padded or masked keys 0; no kv segments when nothing is excluded."""
    pq, pk = -lq % blocks[0], -lk % blocks[1]
    q_segments = jnp.ones((b, lq + pq), jnp.int32)
    if key_mask is None and pk == 0:
        return pq, pk, q_segments, None
    keys = jnp.ones((b, lk), bool) if key_mask is None else key_mask
    return pq, pk, q_segments, jnp.pad(keys, ((0, 0), (0, pk))).astype(jnp.int32)


def _splash_attention(q, k, v, scale, causal: bool, key_mask):
    """The splash kernel, partitioned over the traced-for mesh when it has several devices: the batch over its data
    axis, the heads over its model axis (each chip attends with the heads its q/k/v projections computed); an axis
    that does not divide stays whole."""
    mesh = _MESH.get()
    interpret, forms = _kernel_forms()
    if mesh is None or mesh.devices.size == 1:
        return _splash_local(q, k, v, scale, causal, key_mask, interpret, forms)
    data = "data" if "data" in mesh.shape and q.shape[0] % mesh.shape["data"] == 0 else None
    shards = mesh.shape.get("model", 1)
    heads = "model" if shards > 1 and q.shape[2] % shards == 0 and k.shape[2] % shards == 0 else None
    keys = jnp.ones(k.shape[:2], bool) if key_mask is None else jnp.broadcast_to(key_mask, k.shape[:2])
    qkv_spec = P(data, None, heads, None)
    local = functools.partial(_splash_local, scale=scale, causal=causal, interpret=interpret, forms=forms)
    return jax.shard_map(lambda qq, kk, vv, km: local(qq, kk, vv, key_mask=km), mesh=mesh,
                         in_specs=(qkv_spec, qkv_spec, qkv_spec, P(data, None)), out_specs=qkv_spec,
                         check_vma=False)(q, k, v, keys)


def _splash_heads(qh, kh, vh, causal: bool, key_mask, interpret: bool, forms: PlatformForms):
    """The multi-head splash kernel on head-major q, k, v [B, H, L, D] (q already scaled), one kernel per batch row,
    with `forms`' blocks; [B, H, Lq, D] out. Padding and segment ids as `_splash_local` describes."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    b, h, lq, d = qh.shape
    lk = kh.shape[2]
    blocks = splash_blocks(forms, lq, lk, d)
    pq, pk, q_segments, kv_segments = _splash_padding(b, lq, lk, key_mask, blocks)
    kernel = _splash_kernel(h, lq + pq, lk + pk, causal, interpret, blocks)
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, pq), (0, 0)))
    kh, vh = (jnp.pad(x, ((0, 0), (0, 0), (0, pk), (0, 0))) for x in (kh, vh))

    def one_row(qr, kr, vr, qs, ks):  # no kv segments (None: vmap passes it through): no segment comparison
        return kernel(qr, kr, vr, segment_ids=None if ks is None else splash.SegmentIds(q=qs, kv=ks))

    return jax.vmap(one_row)(qh, kh, vh, q_segments, kv_segments)[:, :, :lq]


def attention_heads(qh, kh, vh):
    """Unmasked attention on head-major q, k, v [B, H, L, D] whose q is already scaled by 1/sqrt(D), on one device
    (`model.nets.heads_kernel` prepares them): the flash kernel where the platform's forms say
    (model.nets.platform_forms), else the splash kernel; compiled on TPUs and interpreted elsewhere. Returns [B, Lq, H,
    D] in q's dtype."""
    interpret, forms = _kernel_forms()
    if forms.flash_kernel and flash_attention.fits(qh.shape[2], kh.shape[2]):
        return flash_attention.flash_attention(qh, kh, vh)
    out = _splash_heads(qh, kh, vh, False, None, interpret, forms)
    return out.transpose(0, 2, 1, 3).astype(qh.dtype)


def _splash_local(q, k, v, scale, causal: bool, key_mask, interpret: bool, forms: PlatformForms):
    """The Pallas splash (flash) kernel for TPU: the multi-head kernel over all heads when each has its own keys
    (the transformer), the multi-query kernel per key/value head otherwise (the text encoder's grouped queries);
    vmapped over the batch.

    Block sizes come from `model.nets.platform_forms.splash_blocks` (measured on v5e). Sequences are padded to whole
    blocks; padded keys and `key_mask`'s masked keys are excluded with kv segment ids (every query is segment 1,
    allowed keys 1, the others 0), which is exactly "causal and key-mask" (the anchor's folding). Without padding or
    a key mask no segment ids are passed (the kernel then skips their comparison). Rows with no allowed key are
    zeroed by `attention`."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    b, lq, h, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    q = q * jnp.asarray(scale, q.dtype)  # the kernel does not scale
    if g == 1:  # [B, H, L, D] into one multi-head kernel per batch row
        out = _splash_heads(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), causal,
                            key_mask, interpret, forms)
        return out.transpose(0, 2, 1, 3)
    blocks = splash_blocks(forms, lq, lk, d)
    # causal over the padded lengths is the same triangle (pad queries come after every real key)
    pq, pk, q_segments, kv_segments = _splash_padding(b, lq, lk, key_mask, blocks)
    pad_q = ((0, 0), (0, 0), (0, pq), (0, 0))
    pad_k = ((0, 0), (0, 0), (0, pk), (0, 0))
    kernel = _splash_kernel(g, lq + pq, lk + pk, causal, interpret, blocks, multi_query=True)
    # [B, Hkv, G, Lq, D] queries, [B, Hkv, Lk, D] keys and values
    qh = jnp.pad(q.reshape(b, lq, hkv, g, d).transpose(0, 2, 3, 1, 4), ((0, 0),) + pad_q)
    kh, vh = (jnp.pad(x.transpose(0, 2, 1, 3), pad_k) for x in (k, v))

    def one_row(qr, kr, vr, qs, ks):  # qr [Hkv, G, Lq, D]; kr, vr [Hkv, Lk, D]
        segments = None if ks is None else splash.SegmentIds(q=qs, kv=ks)
        return jax.vmap(lambda qq, kk, vv: kernel(qq, kk, vv, segment_ids=segments))(qr, kr, vr)

    out = jax.vmap(one_row)(qh, kh, vh, q_segments, kv_segments)[:, :, :, :lq]  # [B, Hkv, G, Lq, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, lq, h, d)


def attention(q, k, v, *, mask=None, causal: bool = False, key_mask=None, implementation: str = "xla"):
    """Softmax(q k^T / sqrt(D)) v with the chosen implementation; returns [B, Lq, H, D] in q's dtype."""
    scale = 1.0 / (q.shape[-1] ** 0.5)
    lq, lk = q.shape[1], k.shape[1]
    if causal and lq != lk:
        raise ValueError(f"causal attention needs as many queries as keys, got {lq} and {lk}")
    if key_mask is not None:
        key_mask = jnp.asarray(key_mask).astype(bool)
    if mask is not None and (causal or key_mask is not None):  # a dense mask given too: fold everything into it
        mask, causal, key_mask = dense_mask(mask, causal, key_mask, lq, lk), False, None
    out = _attention_rows(q, k, v, mask, causal, key_mask, scale, implementation)
    has_key = _rows_with_any_key(mask, causal, key_mask, lq)
    return out if has_key is None else jnp.where(has_key, out, jnp.zeros((), out.dtype))


def _rows_with_any_key(mask, causal: bool, key_mask, lq: int):
    """[B or 1, Lq or 1, H or 1, 1] booleans, True where a query row may attend to some key; None when all may."""
    if mask is not None:
        mask = jnp.reshape(mask, (1,) * (4 - jnp.ndim(mask)) + jnp.shape(mask))  # e.g. an [Lq, Lk] mask
        return jnp.any(mask, axis=-1).transpose(0, 2, 1)[..., None]
    if key_mask is not None:  # causal: row i iff one of keys 0..i is allowed
        rows = (jnp.cumsum(key_mask, axis=1) > 0)[:, :lq] if causal else jnp.any(key_mask, axis=1, keepdims=True)
        return rows[:, :, None, None]
    return None  # no mask, or causal alone: every row sees at least its own key


def _attention_rows(q, k, v, mask, causal: bool, key_mask, scale, implementation: str):
    """The chosen implementation's output, [B, Lq, H, D] in q's dtype (rows with no allowed key: anything)."""
    lq, lk = q.shape[1], k.shape[1]
    if implementation == "blocked":
        return _blocked_attention(q, k, v, mask, scale, causal=causal, key_mask=key_mask).astype(q.dtype)
    if implementation == "splash":
        if mask is None:
            return _splash_attention(q, k, v, scale, causal, key_mask).astype(q.dtype)
        logger.warning("the splash kernel takes causal/key masks only, not a dense mask; using 'xla' attention")
        implementation = "xla"
    mask = dense_mask(mask, causal, key_mask, lq, lk)
    if mask is not None:
        mask = jnp.broadcast_to(mask, (q.shape[0], q.shape[2], lq, lk))
    impl = "cudnn" if implementation == "cudnn" else "xla"
    if impl == "cudnn" and (q.dtype not in (jnp.bfloat16, jnp.float16)):
        impl = "xla"
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=impl).astype(q.dtype)
