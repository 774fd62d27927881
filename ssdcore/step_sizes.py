"""Default step sizes: one table keyed by (model kind, optimizer, Gaussian variance form).

``OptimizerConfig(lr=None)`` and ``ssdcore.fit(lr=None)`` take their step size from here, for
the model they are applied to, and so does a hybrid's per-parameter override without its own
``per_parameter_lr`` (``OptimizerConfig("sgd", per_parameter={"W": "ssd"})`` steps W at the
``ssd`` entry). The service renders :func:`step_size_table` for its users and fills unset request
fields from :func:`default_lr`.

How the values were chosen. SGD and SSD (both step rules) on every model kind and variance
form but the full one come from ``python -m experiments defaults`` (docs/RESULTS.md §9, its
table in ``docs/figures/defaults/choice.md``): every built-in dataset with the service's
preprocessing and defaults (batch 100, CD-1, the model's default initialization and variance
floor 1e-4), n_hidden 25 and 100, scored at 400 and 2,000 computed steps (a blow-up's rollback
counts the steps it threw away) on a half-decade grid; at each of the two run lengths an entry
is the grid value within 15% of the best in the most of that length's cells, the smaller of
equals. The best constant step of a fixed budget falls as the budget grows (a long run affords a
small step's slow start and keeps its lower floor), so those entries hold two values: ``short_lr``
for runs of ``SHORT_RUN_STEPS`` or fewer, ``lr`` for runs of ``LONG_RUN_STEPS`` or more and for
runs of unknown length, and between them the geometric interpolation (:meth:`StepSize.lr_for`;
its value at 1,000 steps was checked in the same experiment). The other entries (Nesterov,
preconditioned SSD, the full precision) were checked by hand: the value that still makes
progress on every built-in dataset over 1,000 steps at n_hidden 32 and 200
(``tests/test_step_sizes.py`` runs the short version of that grid), or the project's own tuning
(``experiments/step_sizes.json`` "chosen", docs/RESULTS.md "Step sizes" and §5, with other
preprocessing and CD-10).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ssdcore.models.gaussian import DEFAULT_VARIANCE, VARIANCE_KINDS

MODEL_KINDS = ("bernoulli", "gaussian")
# The optimizer names of ssdcore.optim.OptimizerConfig (kept literal here: the optimizer
# configuration imports this module, not the other way round).
OPTIMIZERS = ("sgd", "nesterov", "ssd", "ssd-preconditioned")
# The run lengths the measured entries were chosen at (see the module docstring).
SHORT_RUN_STEPS = 400
LONG_RUN_STEPS = 2_000


@dataclass(frozen=True)
class StepSize:
    """One entry of the table: the default ``lr`` of ``optimizer`` on such a model."""

    model_kind: str  # "bernoulli" | "gaussian"
    optimizer: str  # "sgd" | "nesterov" | "ssd" | "ssd-preconditioned"
    variance: str | None  # Gaussian variance form; None for a Bernoulli RBM
    lr: float  # for runs of LONG_RUN_STEPS or more, and of unknown length
    source: str  # where the value comes from (tuning key, RESULTS.md section, grid check)
    short_lr: float | None = None  # for runs of SHORT_RUN_STEPS or fewer; None: lr at any length

    def lr_for(self, steps: int | None = None) -> float:
        """The step size for a run of ``steps`` steps (None: unknown length, ``lr``): geometric
        interpolation between ``short_lr`` and ``lr`` over the lengths between."""
        if steps is None or self.short_lr is None:
            return self.lr
        span = math.log(LONG_RUN_STEPS / SHORT_RUN_STEPS)
        position = min(max(math.log(max(steps, 1) / SHORT_RUN_STEPS) / span, 0.0), 1.0)
        value = self.short_lr ** (1.0 - position) * self.lr**position
        return float(f"{value:.2g}")  # as a user would write it; the rule is not finer than that


def _bernoulli(optimizer: str, lr: float, source: str, short_lr: float | None = None) -> StepSize:
    return StepSize("bernoulli", optimizer, None, lr, source, short_lr)


def _gaussian(
    optimizer: str, variance: str, lr: float, source: str, short_lr: float | None = None
) -> StepSize:
    return StepSize("gaussian", optimizer, variance, lr, source, short_lr)


_GRID = "ssdcore grid check (tests/test_step_sizes.py)"
_FULL = (
    "the diagonal value before experiments defaults (not measured there); "
    + _GRID
    + " on synthetic data at 40 visible units"
)
# The measurement that chose most values: its table is docs/figures/defaults/choice.md. A cell
# is (data set, n_hidden 25 or 100, 400 or 2,000 steps); "within 15%" of the best grid value of
# the same optimizer and step rule, counting the steps a blow-up's rollback costs.
_DEFAULTS = "python -m experiments defaults (docs/RESULTS.md §9, docs/figures/defaults/choice.md)"


def _measured(finding: str) -> str:
    return f"{_DEFAULTS}: {finding}"


STEP_SIZES: tuple[StepSize, ...] = (
    # --- Bernoulli RBM ------------------------------------------------------------------------
    _bernoulli(
        "sgd",
        0.1,
        _measured(
            "5/6 cells within 15% at 0.3 @400 (0.1: 3/6), 5/6 at 0.1 @2000; kept at 0.1 for "
            "every length, scikit-learn's default step (ssdcore.sklearn maps learning_rate "
            "onto it), as 0.3 is 1.59× the best on Frey Face n_h=100 @400 where 0.1 is at "
            "most 1.19× anywhere"
        ),
    ),
    _bernoulli(
        "nesterov", 0.01, "step_sizes.json freyface-brbm/nesterov (mnist-brbm/nesterov is 0.03)"
    ),
    _bernoulli(
        "ssd",
        0.01,
        _measured(
            "@400: 0.03, 6/6 cells within 15% (0.01: 4/6, 2.75× on synthetic n_h=100), worst "
            "1.14×; @2000: 0.01, 6/6, worst 1.05× (0.03: 4/6)"
        ),
        short_lr=0.03,
    ),
    _bernoulli("ssd-preconditioned", 1e-3, "step_sizes.json beyond/pssd-rmsprop, RESULTS.md §4a"),
    # --- Gaussian RBM, diagonal variance (the default form) -------------------------------------
    _gaussian(
        "sgd",
        "diagonal",
        3e-3,
        _measured("@400: 0.01, 5/6 cells within 15%, worst 1.19×; @2000: 3e-3, 5/6, worst 1.16×"),
        short_lr=0.01,
    ),
    _gaussian(
        "nesterov",
        "diagonal",
        3e-4,
        "RESULTS.md §5 (9.5e-4 diverges on MNIST by 800 steps); " + _GRID + ": 1e-3 diverges on "
        "standardized MNIST at n_hidden 200 by 700 steps",
    ),
    _gaussian(
        "ssd",
        "diagonal",
        1e-4,
        _measured(
            "@400: 3e-4, 6/6 cells within 15% (1e-4: 3/6, 1.80× on Frey Face n_h=25), worst "
            "1.14×; @2000: 1e-4, 6/6, worst 1.08× (3e-4 drifts up to 2.24× on MNIST n_h=25)"
        ),
        short_lr=3e-4,
    ),
    _gaussian(
        "ssd-preconditioned",
        "diagonal",
        3e-5,
        f"{_GRID}: 1e-4 drifts up on standardized MNIST at n_hidden 200 (untuned in experiments/)",
    ),
    # --- Gaussian RBM, other variance forms -----------------------------------------------------
    # One variance (isotropic) or none (identity) to step: SSD's l∞ step no longer moves every
    # pixel's log-variance at once, and SSD tolerates longer steps than with the diagonal form.
    # Measured on Frey Face only (the experiment's cost), 4 cells each.
    _gaussian(
        "sgd",
        "isotropic",
        3e-3,
        _measured("@400: 0.01, 2/2 cells within 15%, worst 1.00×; @2000: 3e-3, 2/2, worst 1.15×"),
        short_lr=0.01,
    ),
    _gaussian("nesterov", "isotropic", 3e-4, f"{_GRID}: the SGD value / 10 (momentum 0.9)"),
    _gaussian(
        "ssd",
        "isotropic",
        1e-4,
        _measured("@400: 3e-4, 2/2 cells within 15%, worst 1.15×; @2000: 1e-4, 2/2, worst 1.03×"),
        short_lr=3e-4,
    ),
    _gaussian(
        "ssd-preconditioned",
        "isotropic",
        3e-5,
        f"{_GRID}: 1e-4 drifts up on standardized MNIST at n_hidden 200",
    ),
    _gaussian(
        "sgd",
        "identity",
        0.01,
        _measured("@400: 0.03, 2/2 cells within 15%, worst 1.08×; @2000: 0.01, 2/2, worst 1.07×"),
        short_lr=0.03,
    ),
    _gaussian("nesterov", "identity", 1e-3, f"{_GRID}: the SGD value / 10 (momentum 0.9)"),
    _gaussian(
        "ssd",
        "identity",
        1e-4,
        _measured("@400: 1e-3, 2/2 cells within 15%, worst 1.00×; @2000: 1e-4, 2/2, worst 1.13×"),
        short_lr=1e-3,
    ),
    _gaussian(
        "ssd-preconditioned",
        "identity",
        3e-5,
        f"{_GRID}: 1e-4 drifts up on standardized MNIST at n_hidden 200",
    ),
    # The full precision is a V×V matrix that SSD steps spectrally; too slow for the measured
    # grid, it keeps the earlier diagonal values.
    _gaussian("sgd", "full", 3e-3, _FULL),
    _gaussian("nesterov", "full", 3e-4, _FULL),
    _gaussian("ssd", "full", 3e-5, _FULL),
    _gaussian("ssd-preconditioned", "full", 3e-5, _FULL),
)

_BY_KEY = {(e.model_kind, e.optimizer, e.variance): e for e in STEP_SIZES}

# --- the normalized SSD step rule (ssdcore.optim.step_rules) -----------------------------------
# Its step has the SGD step's Euclidean length, so one value holds across n_hidden for the
# Bernoulli RBM (docs/RESULTS.md §6). SGD and Nesterov take
# no spectral step: under either rule they keep the entries above.
# The step rules of ssdcore.optim.step_rules (literal for the same reason as OPTIMIZERS).
STEP_RULES = ("paper", "normalized")
# The optimizers whose default depends on the step rule; the others have one entry for both.
RULE_DEPENDENT_OPTIMIZERS = ("ssd", "ssd-preconditioned")
_UNTUNED = "the paper-rule value, not tuned for this rule"
NORMALIZED_STEP_SIZES: tuple[StepSize, ...] = (
    _bernoulli(
        "ssd",
        0.3,
        _measured(
            "@400: 1, 6/6 cells within 15% of the rule's best, worst 1.11×; @2000: 0.3, 5/6, "
            "worst 1.18×. By held-out likelihood 0.1 is best at n_h 128 and 512 (§6), where "
            "the bound gap grows with the step"
        ),
        short_lr=1.0,
    ),
    _bernoulli("ssd-preconditioned", 1e-3, _UNTUNED),
    _gaussian(
        "ssd",
        "diagonal",
        3e-3,
        _measured(
            "@2000: 6/6 cells within 15%, worst 1.02×; kept for every length: @400 0.01 is "
            "within 15% in 5/6 cells (3e-3: 3/6) but blows up on MNIST at n_h=100 and stays "
            "3.8× the best there after its rollback"
        ),
    ),
    _gaussian("ssd-preconditioned", "diagonal", 3e-5, _UNTUNED),
    _gaussian(
        "ssd",
        "isotropic",
        1e-3,
        _measured("@400: 0.01, 2/2 cells within 15%, worst 1.00×; @2000: 1e-3, 2/2, worst 1.14×"),
        short_lr=0.01,
    ),
    _gaussian("ssd-preconditioned", "isotropic", 3e-5, _UNTUNED),
    _gaussian(
        "ssd",
        "identity",
        3e-3,
        _measured("@400: 0.03, 2/2 cells within 15%, worst 1.00×; @2000: 3e-3, 2/2, worst 1.12×"),
        short_lr=0.03,
    ),
    _gaussian("ssd-preconditioned", "identity", 3e-5, _UNTUNED),
    _gaussian("ssd", "full", 3e-5, _UNTUNED + "; the full form is not in experiments defaults"),
    _gaussian("ssd-preconditioned", "full", 3e-5, _UNTUNED),
)
_NORMALIZED_BY_KEY = {(e.model_kind, e.optimizer, e.variance): e for e in NORMALIZED_STEP_SIZES}


def step_size_table() -> list[StepSize]:
    """Every entry of the table, Bernoulli first, in a fixed order (for listing to users)."""
    return list(STEP_SIZES)


def normalized_step_size_table() -> list[StepSize]:
    """The entries of the normalized SSD step rule (SSD and preconditioned SSD only)."""
    return list(NORMALIZED_STEP_SIZES)


def step_size(
    model_kind: str, optimizer: str, variance: str | None = None, step_rule: str = "paper"
) -> StepSize:
    """The table's entry for a model and optimizer (value and source).

    ``variance`` is the Gaussian variance form (None means the default, ``"diagonal"``); it must
    be None for a Bernoulli RBM. ``step_rule`` is the SSD step rule; SGD and Nesterov have one
    entry for both. Raises ``ValueError`` naming the argument that has no entry.
    """
    if step_rule not in STEP_RULES:
        raise ValueError(f"step_rule: unknown {step_rule!r}; choose one of {STEP_RULES}")
    if model_kind not in MODEL_KINDS:
        raise ValueError(f"model_kind: unknown {model_kind!r}; choose one of {MODEL_KINDS}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: unknown {optimizer!r}; choose one of {OPTIMIZERS}")
    if model_kind == "bernoulli":
        if variance is not None:
            raise ValueError(
                f"variance: a Bernoulli RBM has no variance form; pass None, got {variance!r}"
            )
    elif variance is None:
        variance = DEFAULT_VARIANCE
    elif variance not in VARIANCE_KINDS:
        raise ValueError(f"variance: unknown {variance!r}; choose one of {VARIANCE_KINDS}")
    key = (model_kind, optimizer, variance)
    if step_rule == "normalized" and optimizer in RULE_DEPENDENT_OPTIMIZERS:
        return _NORMALIZED_BY_KEY[key]
    return _BY_KEY[key]


def default_lr(
    model_kind: str,
    optimizer: str,
    variance: str | None = None,
    step_rule: str = "paper",
    steps: int | None = None,
) -> float:
    """The default step size of ``optimizer`` on a ``model_kind`` RBM (see :func:`step_size`)
    for a run of ``steps`` steps (None: of unknown length; see :meth:`StepSize.lr_for`)."""
    return step_size(model_kind, optimizer, variance, step_rule).lr_for(steps)


def model_key(model: object) -> tuple[str, str | None]:
    """(model kind, variance form) of an RBM, the arguments :func:`default_lr` takes."""
    kind = getattr(model, "kind", None)
    if kind not in MODEL_KINDS:
        raise ValueError(
            f"no default step size for a {type(model).__name__}: the table covers "
            f"BernoulliRBM and GaussianRBM; set the step size (lr) explicitly"
        )
    return kind, getattr(model, "variance", None) if kind == "gaussian" else None
