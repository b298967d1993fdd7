"""The model roles of an RL run, and what each one is.

=========  ======  ======  ====================================================
role       head    trains  what it does
=========  ======  ======  ====================================================
``actor``  lm      yes     generates the rollouts; the policy update
``ref``    lm      no      the reference policy's log-probs (KL terms)
``critic`` value   yes     token values; the value update
``reward`` reward  no      a reward model's scores
``cost``   reward  no      a cost model's scores (Safe-RLHF)
=========  ======  ======  ====================================================

`Role` is a ``StrEnum``: a member equals its name (``Role.ACTOR == "actor"``), so the role
names that configs, placements and worker groups carry are its values. The enum's order is
the order a run lists its roles in.
"""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    """A model role (see the module docstring)."""

    ACTOR = "actor"
    REF = "ref"
    CRITIC = "critic"
    REWARD = "reward"
    COST = "cost"

    @property
    def head(self) -> str:
        """The output head of the role's model (`jaxflow.models.HEADS`): ``lm``, ``value`` or
        ``reward``."""
        return _HEADS[self]

    @property
    def trains(self) -> bool:
        """Whether the role has an optimizer step (the actor and the critic)."""
        return self in (Role.ACTOR, Role.CRITIC)


_HEADS = {Role.ACTOR: "lm", Role.REF: "lm", Role.CRITIC: "value", Role.REWARD: "reward", Role.COST: "reward"}

# The names as plain strings (what messages and reports print), in the enum's order.
ROLES: tuple[str, ...] = tuple(r.value for r in Role)
TRAINING_ROLES: tuple[str, ...] = tuple(r.value for r in Role if r.trains)
