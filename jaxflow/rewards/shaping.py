"""Reward shaping on the response length: DAPO's overlong reward shaping (Yu et al. 2025,
arXiv 2503.14476, section 3.4; verl's ``reward_model.overlong_buffer``, applied by its DAPO
reward manager).

A response of ``l`` tokens (EOS included) under a hard limit ``L_max`` with a buffer of
``L_cache`` tokens gets, besides its score::

    r_overlong(l) = min(-(l - (L_max - L_cache)) / L_cache * penalty_factor, 0)

0 up to ``L_max - L_cache`` tokens, then falling linearly to ``-penalty_factor`` at
``L_max``: long answers are discouraged before they are cut off.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class OverlongBuffer:
    """verl's ``reward_model.overlong_buffer`` with the response limit it applies to.

    Attributes:
      length: ``L_cache``, the buffer's tokens (> 0, at most ``max_response_length``).
      penalty_factor: the penalty at the hard limit.
      max_response_length: ``L_max`` (``data.max_response_length``).
      log: also report each response's ``overlong_reward`` and ``overlong`` (1 when
        penalised) as the reward's named values (verl's ``reward_extra_info``).
    """

    length: int
    penalty_factor: float
    max_response_length: int
    log: bool = False

    def __post_init__(self):
        if self.length <= 0:
            raise ValueError(
                f"overlong_buffer.len must be positive when the overlong penalty is enabled, got {self.length} "
                "(to disable it set overlong_buffer.enable=false)"
            )
        if self.max_response_length < self.length:
            raise ValueError(
                f"overlong_buffer.len={self.length} exceeds the response length {self.max_response_length} "
                "(data.max_response_length)"
            )

    def penalty(self, response_lengths: np.ndarray) -> np.ndarray:
        """``r_overlong`` ``[B]`` float32 of responses of ``response_lengths`` tokens (see the
        module docstring)."""
        expected = self.max_response_length - self.length
        exceed = np.asarray(response_lengths, np.float64) - expected
        return np.minimum(-exceed / self.length * self.penalty_factor, 0.0).astype(np.float32)
