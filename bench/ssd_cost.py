"""`python -m bench.ssd_cost [--hidden H] [--k K] [--rounds N]`

Where an SSD iteration's extra cost goes, next to an SGD iteration, on one torch thread: the two
iterations (the benchmark's Bernoulli variants, ``bench.core``), the exact polar step the
optimizer takes on a CD gradient of that model (the dense gradient's Gram route, or the
factored route when the factors' rank is below both sides), its parts (Gram matrices, the
eigendecomposition), the fused update, and the other polar methods on the same gradient. All are
timed round-robin in the same rounds; each piece is reported as a fraction of an SGD iteration
(the median over rounds of the same-round ratio), so the fractions add up against the ratio
``python -m bench core`` reports as its SSD cost target.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from bench.core import BATCH_SIZE, SSD_LR, Plan, Variant, build_project, load_datasets
from bench.report import render_table
from bench.timing import interleaved_rounds, paired_ratio
from ssdcore.optim import polar
from ssdcore.optim.ssd import factors_pay_off

# Steps of SSD before the gradient is taken, so that it is a trained model's, not the
# initial one's (whose spectrum is dominated by a single direction).
WARM_STEPS = 50
# Each round calls a piece repeatedly for about this long, so that short pieces are timed
# over many calls.
ROUND_SECONDS = 0.1


def cd_gradient_factors(data: torch.Tensor, n_hidden: int, cd_k: int) -> tuple[torch.Tensor, ...]:
    """``(left, right, W)``: the factors of a CD-k weight gradient of a Bernoulli RBM after
    WARM_STEPS SSD steps (``left @ right`` is the gradient), and the weights."""
    import ssdcore
    from ssdcore.optim import OptimizerConfig

    model = ssdcore.BernoulliRBM(data.shape[1], n_hidden)
    trainer = ssdcore.Trainer(
        model,
        data,
        optimizer=OptimizerConfig(name="ssd", lr=SSD_LR),
        batch_size=BATCH_SIZE,
        cd_k=cd_k,
        seed=0,
    )
    trainer.train_steps(WARM_STEPS)
    ssdcore.CDEstimator(model, k=cd_k, seed=1).estimate(data[:BATCH_SIZE])
    left, right = model.W.grad_factors
    return left.clone(), right.clone(), model.W.detach().clone()


def pieces(data: torch.Tensor, n_hidden: int, cd_k: int) -> dict[str, Callable[[], object]]:
    """Every timed piece by name, the two iterations first."""
    iterations = {
        f"{name} iteration": build_project(
            Variant("project", "bernoulli", name), data, n_hidden=n_hidden, cd_k=cd_k
        )
        for name in ("sgd", "ssd-lowrank")
    }
    result: dict[str, Callable[[], object]] = {
        name: (lambda run=run: run(1)) for name, run in iterations.items()
    }
    left, right, weight = cd_gradient_factors(data, n_hidden, cd_k)
    grad = left @ right
    if factors_pay_off(weight, (left, right)):
        step = polar.polar_lowrank_factors(left, right)
        left_gram = polar._gram64(left, columns=True)
        right_gram = polar._gram64(right, columns=False)
        result |= {
            "exact polar step (factored route)": lambda: polar.polar_lowrank_factors(left, right),
            "  Gram matrices of the factors": lambda: (
                polar._gram64(left, columns=True),
                polar._gram64(right, columns=False),
            ),
            "  one r×r eigendecomposition (float64)": lambda: torch.linalg.eigh(right_gram),
            "  mixing matrix (Cholesky, core, eigh, products)": lambda: polar._mixing_matrix(
                left_gram, right_gram, tuple(weight.shape), weight.dtype
            ),
            "newton-schulz in factor space": lambda: polar.polar_newton_schulz_factors(left, right),
        }
    else:
        step = polar.polar_gram_factors(grad)
        gram = grad.double().mT @ grad.double()
        result |= {
            "exact polar step (Gram route)": lambda: polar.polar_gram_factors(grad),
            "  Gram matrix (float64)": lambda: (lambda g: g.mT @ g)(grad.double()),
            "  eigendecomposition (float64)": lambda: torch.linalg.eigh(gram),
        }
    result |= optimizer_steps(left, right, weight)
    update = weight.clone()
    result |= {
        "fused update W -= c·left@right": lambda: update.addmm_(
            step.left, step.right, alpha=-1e-12
        ),
        "full SVD polar": lambda: polar.polar_svd(grad),
        "newton-schulz (dense)": lambda: polar.polar_newton_schulz(grad),
    }
    return result


def optimizer_steps(
    left: torch.Tensor, right: torch.Tensor, weight: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """SGD's and SSD's whole ``step()`` on the same stored gradients of W and both biases, in
    the form the Trainer hands them over (SGD always gets the dense W gradient, SSD only when
    its route reads it); the difference is what an SSD iteration adds."""
    import ssdcore
    from ssdcore.optim import OptimizerConfig, build_optimizer

    model = ssdcore.BernoulliRBM(*weight.shape)
    with torch.no_grad():
        model.W.copy_(weight)
    dense = left @ right
    biases = (right.sum(0), left.sum(1))
    result: dict[str, Callable[[], object]] = {}
    for name in ("sgd", "ssd"):
        # A vanishing step size: the timed steps must not move W far from the trained one.
        optimizer = build_optimizer(model, OptimizerConfig(name=name, lr=1e-30))
        reads_dense = name == "sgd" or not factors_pay_off(weight, (left, right))
        grad_w = dense if reads_dense else None

        def step(optimizer: torch.optim.Optimizer = optimizer, grad_w=grad_w) -> None:
            model.W.grad, (model.a.grad, model.b.grad) = grad_w, biases
            model.W.grad_factors = (left, right)
            optimizer.step()

        result[f"{name} optimizer step"] = step
    return result


def measure(
    n_hidden: int, cd_k: int, rounds: int, data: torch.Tensor | None = None
) -> list[list[object]]:
    """Rows ``[piece, ms, fraction of an SGD iteration]``, timed in the same rounds on one
    torch thread, on the benchmark's binarized MNIST images (or ``data``)."""
    if data is None:
        data = load_datasets(Plan.full(), torch.device("cpu"))["bernoulli"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(n_hidden, cd_k, rounds, data)
    finally:
        torch.set_num_threads(threads)


def _measure(n_hidden: int, cd_k: int, rounds: int, data: torch.Tensor) -> list[list[object]]:
    named = pieces(data, n_hidden, cd_k)
    calls_per_piece = {name: _calls_per_round(piece) for name, piece in named.items()}
    calls = {
        name: (lambda piece=piece, n=calls_per_piece[name]: [piece() for _ in range(n)])
        for name, piece in named.items()
    }
    timings = interleaved_rounds(
        calls,
        warmup_calls=1,
        calls_per_round=1,
        rounds=rounds,
        device=torch.device("cpu"),
        units_per_call=calls_per_piece,
    )
    sgd = timings["sgd iteration"]
    return [[name, timing.median_ms, paired_ratio(timing, sgd)] for name, timing in timings.items()]


def _calls_per_round(piece: Callable[[], object]) -> int:
    piece()
    start = time.perf_counter()
    piece()
    seconds = max(time.perf_counter() - start, 1e-6)
    return max(1, min(500, round(ROUND_SECONDS / seconds)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ssd_cost")
    parser.add_argument("--hidden", type=int, default=100)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    rows = measure(args.hidden, args.k, args.rounds)
    print(f"Bernoulli RBM 784x{args.hidden}, CD-{args.k}, batch {BATCH_SIZE}, one torch thread")
    print(render_table(["piece", "ms", "× SGD iteration"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
