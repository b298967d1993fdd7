"""What an iteration program carries from one iteration to the next (and a checkpoint saves)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxflow.algos.kl import get_kl_controller
from jaxflow.algos.safe_rlhf import LagrangeMultiplier
from jaxflow.algos.settings import AlgorithmConfig, AlgorithmSettings, SafeRLHFConfig
from jaxflow.programs.steps import KLController


@dataclasses.dataclass
class AlgoState:
    """What a program carries across iterations (and a checkpoint saves).

    Attributes:
      kl_coef: the in-reward KL controller's current coefficient (``algorithm.kl_ctrl``);
        None until the first iteration that uses it (then ``kl_ctrl.kl_coef``).
      lagrange_multiplier: Safe-RLHF's ``lambda``; None until first used (then
        ``safe_rlhf.lambda_init``).

    The controllers themselves are rebuilt from the config each iteration around these values
    (`kl_controller`, `lagrange`) and written back by `store`.
    """

    kl_coef: float | None = None
    lagrange_multiplier: float | None = None

    @classmethod
    def initial(cls, settings: AlgorithmSettings) -> AlgoState:
        """The initial state of the algorithm of ``settings``."""
        algo, safe = settings.algorithm, settings.safe_rlhf
        kl_coef = float(algo.kl_ctrl.kl_coef) if algo.use_kl_in_reward else None
        lam = float(safe.lambda_init) if safe.enable else None
        return cls(kl_coef=kl_coef, lagrange_multiplier=lam)

    def kl_controller(self, algo: AlgorithmConfig) -> KLController | None:
        """The in-reward KL controller of ``algo`` (verl's ``algorithm``) at the current
        coefficient; None without ``use_kl_in_reward``."""
        if not algo.use_kl_in_reward:
            return None
        ctrl = get_kl_controller(algo.kl_ctrl)
        if self.kl_coef is not None:
            ctrl.value = self.kl_coef
        return ctrl

    def lagrange(self, settings: SafeRLHFConfig) -> LagrangeMultiplier:
        """Safe-RLHF's multiplier (``settings``: ``jaxflow.safe_rlhf``) at the current value."""
        value = settings.lambda_init if self.lagrange_multiplier is None else self.lagrange_multiplier
        return LagrangeMultiplier(
            float(value),
            float(settings.cost_threshold),
            float(settings.lambda_lr),
            settings.lambda_update_scale,
            None if settings.lambda_max is None else float(settings.lambda_max),
        )

    def store(self, kl_ctrl: KLController | None = None, multiplier: LagrangeMultiplier | None = None) -> None:
        """Keeps the controllers' new values."""
        if kl_ctrl is not None:
            self.kl_coef = float(kl_ctrl.value)
        if multiplier is not None:
            self.lagrange_multiplier = float(multiplier.value)

    def state_dict(self) -> dict[str, float]:
        """The values that are set, as JSON-able floats."""
        return {f.name: float(v) for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restores `state_dict`'s values (absent keys leave their field unchanged)."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"unknown AlgoState key(s) {unknown}; valid: {names}")
        for k, v in d.items():
            setattr(self, k, None if v is None else float(v))
