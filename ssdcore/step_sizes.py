"""Default step sizes: one table keyed by (model kind, optimizer, Gaussian variance form).

``OptimizerConfig(lr=None)`` and ``ssdcore.fit(lr=None)`` take their step size from here, for
the model they are applied to, and so does a hybrid's per-parameter override without its own
``per_parameter_lr`` (``OptimizerConfig("sgd", per_parameter={"W": "ssd"})`` steps W at the
``ssd`` entry). The service renders :func:`step_size_table` for its users and fills unset request
fields from :func:`default_lr`.

How the values were chosen: each entry trains every built-in dataset the service offers, with
the service's own preprocessing and defaults (batch 100, CD-1, the model's default
initialization and variance floor 1e-4): the synthetic binary data (100 visible units), MNIST
(binarized for a Bernoulli RBM, standardized per pixel for a Gaussian one) and Frey Face (the
same). Where the datasets disagree, the entry is the smaller value that still makes progress on
all of them, checked over 1,000 steps at n_hidden 32 and 200 (``tests/test_step_sizes.py`` runs
the short version of that grid). The project's own tuning (``experiments/step_sizes.json``
"chosen", docs/RESULTS.md "Step sizes" and §5) used other preprocessing (binarized MNIST and
[0, 1]-scaled Frey Face for the Gaussian models, CD-10, a variance floor of 0.01 / 1e-3), so
its Gaussian values are a starting point here rather than the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ssdcore.models.gaussian import DEFAULT_VARIANCE, VARIANCE_KINDS

MODEL_KINDS = ("bernoulli", "gaussian")
# The optimizer names of ssdcore.optim.OptimizerConfig (kept literal here: the optimizer
# configuration imports this module, not the other way round).
OPTIMIZERS = ("sgd", "nesterov", "ssd", "ssd-preconditioned")


@dataclass(frozen=True)
class StepSize:
    """One entry of the table: the default ``lr`` of ``optimizer`` on such a model."""

    model_kind: str  # "bernoulli" | "gaussian"
    optimizer: str  # "sgd" | "nesterov" | "ssd" | "ssd-preconditioned"
    variance: str | None  # Gaussian variance form; None for a Bernoulli RBM
    lr: float
    source: str  # where the value comes from (tuning key, RESULTS.md section, grid check)


def _bernoulli(optimizer: str, lr: float, source: str) -> StepSize:
    return StepSize("bernoulli", optimizer, None, lr, source)


def _gaussian(optimizer: str, variance: str, lr: float, source: str) -> StepSize:
    return StepSize("gaussian", optimizer, variance, lr, source)


_GRID = "ssdcore grid check (tests/test_step_sizes.py)"
_FULL = "the diagonal value; " + _GRID + " on synthetic data at 40 visible units"

STEP_SIZES: tuple[StepSize, ...] = (
    # --- Bernoulli RBM ------------------------------------------------------------------------
    _bernoulli(
        "sgd",
        0.1,
        "mnist-brbm/sgd grid: 0.1 and 0.3 within 0.7 of each other in reconstruction error (the "
        "latest step_sizes.json chose 0.3); the shorter of the two (simulation-brbm/sgd is 0.3)",
    ),
    _bernoulli(
        "nesterov", 0.01, "step_sizes.json freyface-brbm/nesterov (mnist-brbm/nesterov is 0.03)"
    ),
    _bernoulli(
        "ssd",
        3e-3,
        "step_sizes.json freyface-brbm/ssd (mnist-brbm/ssd 0.01 is too long at n_hidden 500, "
        "RESULTS.md Summary)",
    ),
    _bernoulli("ssd-preconditioned", 1e-3, "step_sizes.json beyond/pssd-rmsprop, RESULTS.md §4a"),
    # --- Gaussian RBM, diagonal variance (the default form) -------------------------------------
    _gaussian(
        "sgd",
        "diagonal",
        3e-3,
        "RESULTS.md §5 3.2e-3 (step_sizes.json mnist-grbm/sgd 0.01 diverges by 1,000 steps, §2)",
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
        3e-5,
        "step_sizes.json freyface-grbm/ssd, RESULTS.md §5 3.2e-5 on MNIST; " + _GRID + ": 1e-4 "
        "diverges on standardized MNIST by 1,000 steps",
    ),
    _gaussian(
        "ssd-preconditioned",
        "diagonal",
        3e-5,
        f"{_GRID}: 1e-4 drifts up on standardized MNIST at n_hidden 200 (untuned in experiments/)",
    ),
    # --- Gaussian RBM, other variance forms -----------------------------------------------------
    # One variance (isotropic) or none (identity) to step: SSD's l∞ step no longer moves every
    # pixel's log-variance at once, and SSD tolerates about 3× the diagonal value; each entry
    # stays a half-decade below the grid point that drifted up or diverged.
    _gaussian(
        "sgd",
        "isotropic",
        3e-3,
        f"{_GRID}: 1e-2 drifts up on standardized MNIST at n_hidden 200, 3e-2 diverges "
        "(step_sizes.json simulation-grbm/sgd is 3e-4, on binary data)",
    ),
    _gaussian("nesterov", "isotropic", 3e-4, f"{_GRID}: the SGD value / 10 (momentum 0.9)"),
    _gaussian(
        "ssd",
        "isotropic",
        1e-4,
        f"{_GRID}: 3e-4 trains all three datasets at n_hidden 32, 1e-4 at 200 (step_sizes.json "
        "simulation-grbm/ssd is 9.5e-4, on binary data)",
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
        1e-2,
        f"{_GRID}: 3e-2 trains all three datasets at n_hidden 32, 1e-2 at 200",
    ),
    _gaussian("nesterov", "identity", 1e-3, f"{_GRID}: the SGD value / 10 (momentum 0.9)"),
    _gaussian(
        "ssd",
        "identity",
        1e-4,
        f"{_GRID}: 3e-4 trains all three datasets at n_hidden 32, 1e-4 at 200",
    ),
    _gaussian(
        "ssd-preconditioned",
        "identity",
        3e-5,
        f"{_GRID}: 1e-4 drifts up on standardized MNIST at n_hidden 200",
    ),
    # The full precision is a V×V matrix that SSD steps spectrally: kept at the diagonal values.
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
_TRANSFER = "python -m experiments transfer (docs/RESULTS.md §6)"
_UNTUNED = "the paper-rule value, not tuned for this rule"
# Checked on standardized MNIST (1,000 images) at n_hidden 32 and 200 for 600 steps: 3e-5
# trains both; 1e-4 blows up at 200 with the diagonal form (isotropic: 3e-4 still trains).
_GAUSSIAN_CHECK = _UNTUNED + "; trains standardized MNIST at n_hidden 32 and 200 (1e-4 does not)"
NORMALIZED_STEP_SIZES: tuple[StepSize, ...] = (
    _bernoulli("ssd", 0.1, _TRANSFER),
    _bernoulli("ssd-preconditioned", 1e-3, _UNTUNED),
    _gaussian("ssd", "diagonal", 3e-5, _GAUSSIAN_CHECK),
    _gaussian("ssd-preconditioned", "diagonal", 3e-5, _UNTUNED),
    _gaussian("ssd", "isotropic", 1e-4, _UNTUNED + "; trains standardized MNIST at 32 and 200"),
    _gaussian("ssd-preconditioned", "isotropic", 3e-5, _UNTUNED),
    _gaussian("ssd", "identity", 1e-4, _UNTUNED),
    _gaussian("ssd-preconditioned", "identity", 3e-5, _UNTUNED),
    _gaussian("ssd", "full", 3e-5, _UNTUNED),
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
    model_kind: str, optimizer: str, variance: str | None = None, step_rule: str = "paper"
) -> float:
    """The default step size of ``optimizer`` on a ``model_kind`` RBM (see :func:`step_size`)."""
    return step_size(model_kind, optimizer, variance, step_rule).lr


def model_key(model: object) -> tuple[str, str | None]:
    """(model kind, variance form) of an RBM, the arguments :func:`default_lr` takes."""
    kind = getattr(model, "kind", None)
    if kind not in MODEL_KINDS:
        raise ValueError(
            f"no default step size for a {type(model).__name__}: the table covers "
            f"BernoulliRBM and GaussianRBM; set the step size (lr) explicitly"
        )
    return kind, getattr(model, "variance", None) if kind == "gaussian" else None
