"""The paper's experiments and a few beyond it, each runnable as `python -m experiments NAME`.

Experiments: `simulation` (Fig. 3a–c), `mnist` (Fig. 3d–f, Table 1), `freyface` (Fig. 4),
`beyond` (preconditioned SSD, polar methods, PCD), `grbm` (the Gaussian RBMs at smaller step
sizes), `tuning` (the step-size grids the others read).
Each writes PNG figures and Markdown/CSV/JSON tables under `--out` (default `docs/figures`).
"""

from __future__ import annotations
