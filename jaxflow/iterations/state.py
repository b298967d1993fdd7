"""What an algorithm carries from one iteration to the next (and a checkpoint saves).

Each algorithm owns its state: a dataclass of optional floats (None until first used),
registered with the algorithm (`jaxflow.iterations.register_algorithm`'s ``state``) and made
by ``initial(settings)``. `AlgoState` is the base (it carries nothing); `KLState` carries
the in-reward KL coefficient (the PPO family, ReMax); Safe-RLHF's adds its Lagrange
multiplier (`jaxflow.iterations.safe_rlhf.SafeRLHFState`). The trainer keeps the state and
checkpoints ``state_dict()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxflow.algos.kl import get_kl_controller
from jaxflow.algos.settings import AlgorithmConfig, AlgorithmSettings
from jaxflow.iterations.steps import KLController


@dataclasses.dataclass
class AlgoState:
    """What an algorithm carries across iterations (see the module docstring): the base of
    every algorithm's state, with nothing in it. Fields are optional floats."""

    @classmethod
    def initial(cls, settings: AlgorithmSettings) -> AlgoState:
        """The state before the first iteration of the algorithm of ``settings``."""
        del settings
        return cls()

    def state_dict(self) -> dict[str, float]:
        """The values that are set, as JSON-able floats."""
        return {f.name: float(v) for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restores `state_dict`'s values (absent keys leave their field unchanged)."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"unknown {type(self).__name__} key(s) {unknown}; valid: {names}")
        for k, v in d.items():
            setattr(self, k, None if v is None else float(v))


@dataclasses.dataclass
class KLState(AlgoState):
    """The in-reward KL controller's coefficient (``algorithm.kl_ctrl``).

    Attributes:
      kl_coef: the coefficient; None without ``algorithm.use_kl_in_reward``.

    The controller is rebuilt from the settings each iteration around this value
    (`kl_controller`) and its new value kept by `store`.
    """

    kl_coef: float | None = None

    @classmethod
    def initial(cls, settings: AlgorithmSettings) -> KLState:
        algo = settings.algorithm
        return cls(kl_coef=float(algo.kl_ctrl.kl_coef) if algo.use_kl_in_reward else None)

    def kl_controller(self, algo: AlgorithmConfig) -> KLController | None:
        """The in-reward KL controller of ``algo`` (verl's ``algorithm``) at the current
        coefficient; None without ``use_kl_in_reward``."""
        if not algo.use_kl_in_reward:
            return None
        ctrl = get_kl_controller(algo.kl_ctrl)
        if self.kl_coef is not None:
            ctrl.value = self.kl_coef
        return ctrl

    def store(self, kl_ctrl: KLController | None = None) -> None:
        """Keeps the controller's new value."""
        if kl_ctrl is not None:
            self.kl_coef = float(kl_ctrl.value)
