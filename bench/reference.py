"""The plain reference training loop: the baseline every speed figure is compared with.

This is how an RBM is usually written in torch without care for speed: `torch.bernoulli` for
sampling, fresh tensors at every operation, a full `torch.linalg.svd` for the spectral step, and no
preallocated buffers. It is correct (the tests check its gradient against autograd of the
free-energy difference) and deliberately unoptimised, so that ratios against it show what the
project's care is worth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OPTIMIZERS = ("sgd", "nesterov", "ssd")
MODELS = ("bernoulli", "gaussian")


@dataclass(frozen=True)
class ReferenceConfig:
    """One reference configuration; `model` is bernoulli or gaussian (diagonal variance)."""

    model: str
    n_visible: int
    n_hidden: int
    batch_size: int = 100
    cd_k: int = 1
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")


class ReferenceRBM:
    """Parameters and conditionals of a Bernoulli or diagonal-Gaussian RBM, written plainly.

    Energy (Gaussian): E = -vᵀC⁻¹Wh + ½(v-b)ᵀC⁻¹(v-b) - aᵀh with C = diag(exp(log_var));
    Bernoulli: E = -vᵀWh - bᵀv - aᵀh.
    """

    def __init__(self, config: ReferenceConfig, *, device: torch.device, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.gaussian = config.model == "gaussian"
        shape = (config.n_visible, config.n_hidden)
        self.W = (0.01 * torch.randn(shape, generator=generator)).to(device)  # (V, H)
        self.b = torch.zeros(config.n_visible, device=device)  # (V,)
        self.a = torch.zeros(config.n_hidden, device=device)  # (H,)
        self.log_var = torch.zeros(config.n_visible, device=device) if self.gaussian else None

    def parameters(self) -> dict[str, torch.Tensor]:
        params = {"W": self.W, "b": self.b, "a": self.a}
        if self.log_var is not None:
            params["log_var"] = self.log_var
        return params

    def _scaled(self, v: torch.Tensor) -> torch.Tensor:
        # Gaussian units enter the hidden layer as C⁻¹v.
        if self.log_var is None:
            return v
        return v * torch.exp(-self.log_var)

    def hidden_probs(self, v: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self._scaled(v) @ self.W + self.a)  # (B, H)

    def sample_visible(self, h: torch.Tensor) -> torch.Tensor:
        mean = h @ self.W.T + self.b  # (B, V)
        if self.log_var is None:
            return torch.bernoulli(torch.sigmoid(mean))
        return mean + torch.exp(0.5 * self.log_var) * torch.randn_like(mean)

    def free_energy(self, v: torch.Tensor) -> torch.Tensor:
        """F(v) with p(v) ∝ exp(-F(v)), shape (B,); used by the tests to check the gradient."""
        hidden_term = torch.nn.functional.softplus(self._scaled(v) @ self.W + self.a).sum(1)
        if self.log_var is None:
            return -v @ self.b - hidden_term
        return 0.5 * (((v - self.b) ** 2) * torch.exp(-self.log_var)).sum(1) - hidden_term

    def gradients(
        self,
        v_data: torch.Tensor,
        v_model: torch.Tensor,
        ph_data: torch.Tensor,
        ph_model: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """CD gradient of the negative log-likelihood: E_data[∂E/∂θ] - E_model[∂E/∂θ]."""
        batch = v_data.shape[0]
        sd, sm = self._scaled(v_data), self._scaled(v_model)
        grads = {
            "W": -(sd.T @ ph_data - sm.T @ ph_model) / batch,
            "a": -(ph_data.mean(0) - ph_model.mean(0)),
        }
        if self.log_var is None:
            grads["b"] = -(v_data.mean(0) - v_model.mean(0))
            return grads
        precision = torch.exp(-self.log_var)
        grads["b"] = -((v_data - self.b).mean(0) - (v_model - self.b).mean(0)) * precision

        # ∂E/∂log_var_i = C⁻¹_i v_i (W h)_i - ½ C⁻¹_i (v_i - b_i)², with h at its probabilities.
        def energy_grad(v: torch.Tensor, ph: torch.Tensor) -> torch.Tensor:
            return (precision * (v * (ph @ self.W.T) - 0.5 * (v - self.b) ** 2)).mean(0)

        grads["log_var"] = energy_grad(v_data, ph_data) - energy_grad(v_model, ph_model)
        return grads


def cd_chain(rbm: ReferenceRBM, v_data: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """k steps of block Gibbs sampling from the data: (v_model, ph_data, ph_model)."""
    ph_data = rbm.hidden_probs(v_data)
    h = torch.bernoulli(ph_data)
    v_model = v_data
    ph_model = ph_data
    for _ in range(k):
        v_model = rbm.sample_visible(h)
        ph_model = rbm.hidden_probs(v_model)
        h = torch.bernoulli(ph_model)
    return v_model, ph_data, ph_model


def spectral_step(grad: torch.Tensor) -> torch.Tensor:
    """The S∞ steepest-descent direction ‖σ(G)‖₁·UVᵀ by a full SVD."""
    u, s, vh = torch.linalg.svd(grad, full_matrices=False)
    return s.sum() * (u @ vh)


def linf_step(grad: torch.Tensor) -> torch.Tensor:
    """The l∞ steepest-descent direction ‖g‖₁·sign(g) for a vector."""
    return grad.abs().sum() * torch.sign(grad)


class ReferenceLoop:
    """A plain CD-k training loop over a data tensor: one `step()` is one iteration."""

    def __init__(self, config: ReferenceConfig, data: torch.Tensor, *, seed: int = 0) -> None:
        self.config = config
        self.data = data
        self.rbm = ReferenceRBM(config, device=data.device, seed=seed)
        self.velocity: dict[str, torch.Tensor] = {}
        torch.manual_seed(seed)

    def step(self) -> None:
        """One iteration: draw a minibatch, run CD-k, update every parameter."""
        config = self.config
        index = torch.randint(0, self.data.shape[0], (config.batch_size,), device=self.data.device)
        v_data = self.data[index]
        v_model, ph_data, ph_model = cd_chain(self.rbm, v_data, config.cd_k)
        grads = self.rbm.gradients(v_data, v_model, ph_data, ph_model)
        for name, param in self.rbm.parameters().items():
            param -= config.lr * self._direction(name, grads[name])

    def _direction(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        optimizer = self.config.optimizer
        if optimizer == "ssd":
            return spectral_step(grad) if grad.ndim == 2 else linf_step(grad)
        if optimizer == "nesterov":
            velocity = self.config.momentum * self.velocity.get(name, torch.zeros_like(grad)) + grad
            self.velocity[name] = velocity
            return grad + self.config.momentum * velocity
        return grad
