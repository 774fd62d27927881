"""ssdcore: Bernoulli and Gaussian RBMs trained by CD/PCD with SGD or Stochastic Spectral Descent.

Pure torch; no service dependencies. See docs/ARCHITECTURE.md for the public interfaces.
"""

from __future__ import annotations

from ssdcore.errors import DivergenceError

# --- optimizers and training ---
# (exports of ssdcore.optim, Trainer and fit go here)
# --- end optimizers and training ---

__all__ = [
    "DivergenceError",
]
