"""A stand-in for ``unified``'s protection controller whose tables change at a known lookup: the frequency
exponent falls from 4 to 1 (what the recency/frequency balance does when frequency stops paying), weights fixed,
the whole budget as the protected target. Both storages (the pool's ``UnifiedPolicy`` and the plugin's run queue)
read only these members of the controller."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvretain.core.policies import rules
from kvretain.core.policy import PolicyConfig

SWITCH_AT = 5
"""The lookup (counted from 1) at which the exponent falls."""


class SwitchingController:
    def __init__(self, num_blocks: int, cfg: PolicyConfig) -> None:
        self._cfg = cfg
        self.weights = rules.retention_weights(cfg.priority_weight)
        self.frequency = rules.frequency_terms(dataclasses.replace(cfg, frequency_exponent=4.0))
        self.target = cfg.budget * num_blocks
        self.lookups = 0

    def on_arrival(self, *args: Any, **kwargs: Any) -> None:
        return None

    def on_lookup(self, *args: Any, **kwargs: Any) -> bool:
        self.lookups += 1
        if self.lookups == SWITCH_AT:
            self.frequency = rules.frequency_terms(dataclasses.replace(self._cfg, frequency_exponent=1.0))
            return True
        return False

    def stats(self) -> dict[str, float]:
        return {}
