"""Evaluation: reconstruction error, pseudo-log-likelihood, free-energy gap, ‖W‖₂, stuck hidden
units, log Z, log p."""

from __future__ import annotations

from ssdcore.evaluation.ais import AISResult, ais_log_partition, annealing_schedule
from ssdcore.evaluation.annealing import data_base_rates
from ssdcore.evaluation.certified import LikelihoodBounds, certified_log_likelihood
from ssdcore.evaluation.likelihood import log_likelihood
from ssdcore.evaluation.metrics import (
    free_energy_gap,
    mean_free_energy,
    pseudo_log_likelihood,
    reconstruction_error,
    saturated_hidden_fraction,
    spectral_norm,
)
from ssdcore.evaluation.partition import MAX_ENUMERATED_UNITS, exact_log_partition
from ssdcore.evaluation.reverse_ais import ReverseAISResult, reverse_ais_log_likelihood

__all__ = [
    "MAX_ENUMERATED_UNITS",
    "AISResult",
    "LikelihoodBounds",
    "ReverseAISResult",
    "ais_log_partition",
    "annealing_schedule",
    "certified_log_likelihood",
    "data_base_rates",
    "exact_log_partition",
    "free_energy_gap",
    "log_likelihood",
    "mean_free_energy",
    "pseudo_log_likelihood",
    "reconstruction_error",
    "reverse_ais_log_likelihood",
    "saturated_hidden_fraction",
    "spectral_norm",
]
