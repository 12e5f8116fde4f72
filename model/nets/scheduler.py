"""Flow-match Euler sampling, bit-for-bit with diffusers' FlowMatchEulerDiscreteScheduler as Flux2KleinPipeline
drives it: the schedule as pure numpy functions (float32 arithmetic, dynamic exponential shift with the empirical
mu), then the per-step arithmetic the compiled programs run between model calls (Euler step, guidance mix)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ..config.configs import SchedulerConfig
from .layers import round_to_dtype


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's resolution- and step-dependent shift mu (a straight-line fit between 10 and 200 steps)."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


def default_sigmas(num_steps: int) -> np.ndarray:
    """The pipeline's unshifted schedule linspace(1, 1/n, n)."""
    return np.linspace(1.0, 1.0 / num_steps, num_steps)


def flow_match_schedule(cfg: SchedulerConfig, num_steps: int, image_seq_len: int, sigmas=None):
    """(sigmas [n + 1] with a terminal 0, timesteps [n]) as float32, exactly as the pipeline computes them."""
    if num_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_steps}")
    base = default_sigmas(num_steps) if sigmas is None else sigmas
    s = np.asarray(base, dtype=np.float64).astype(np.float32)
    if s.ndim != 1 or len(s) != num_steps:
        raise ValueError(f"custom sigmas must be a 1-D list of num_inference_steps={num_steps} values, got shape "
                         f"{s.shape}")
    if not np.all(np.isfinite(s)) or np.any(s <= 0) or np.any(s > 1):
        raise ValueError(f"custom sigmas must lie in (0, 1], got {s.tolist()}")
    if cfg.use_dynamic_shifting:
        mu = compute_empirical_mu(image_seq_len, num_steps)
        if cfg.time_shift_type == "exponential":
            e = math.exp(mu)
            s = e / (e + (1 / s - 1) ** 1.0)  # float32 array math: Python scalars are weak (NEP 50)
        else:
            s = mu / (mu + (1 / s - 1) ** 1.0)
    else:
        s = cfg.shift * s / (1 + (cfg.shift - 1) * s)
    s = s.astype(np.float32)
    if cfg.shift_terminal:
        one_minus = 1 - s
        s = (1 - one_minus / (one_minus[-1] / (1 - cfg.shift_terminal))).astype(np.float32)
    timesteps = (s * np.float32(cfg.num_train_timesteps)).astype(np.float32)
    if cfg.invert_sigmas:
        s = (1.0 - s).astype(np.float32)
        timesteps = (s * np.float32(cfg.num_train_timesteps)).astype(np.float32)
        s = np.concatenate([s, np.ones(1, np.float32)])
    else:
        s = np.concatenate([s, np.zeros(1, np.float32)])
    return s.astype(np.float32), timesteps


# The pipeline's arithmetic between model calls, rounded where diffusers (PyTorch) rounds in a low-precision dtype;
# float32 is plain float32 arithmetic (round_to_dtype adds nothing there).


def model_timestep(timestep, dtype, batch: int):
    """The sigma the pipeline hands the model, [batch]: t rounded to the model's dtype, / 1000, rounded again."""
    return jnp.broadcast_to(round_to_dtype(round_to_dtype(timestep, dtype) / 1000, dtype), (batch,))


def euler_step(x, v, sigma, sigma_next):
    """x + (sigma_next - sigma) * v as diffusers' scheduler step: the step size and its product with v rounded to v's
    dtype, the sum in float32, then x's dtype."""
    r = lambda a: round_to_dtype(a, v.dtype)  # noqa: E731
    update = r(r(sigma_next - sigma) * v.astype(jnp.float32))
    return (x.astype(jnp.float32) + update).astype(x.dtype)


def guidance_mix(pos, neg, scale):
    """Classifier-free guidance neg + scale * (pos - neg), rounded to the velocities' dtype after each op; the scale
    (a Python float in diffusers) stays float32."""
    dtype = pos.dtype
    r = lambda a: round_to_dtype(a, dtype)  # noqa: E731
    pos, neg = pos.astype(jnp.float32), neg.astype(jnp.float32)
    return r(neg + r(scale * r(pos - neg))).astype(dtype)
