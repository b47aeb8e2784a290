"""The one rule for comparing priorities, shared by the Policy (queue order, evicting the worst
queued request, holding back a candidate that cannot preempt) and the Adder (choosing victims).

SGLang's `schedule_low_priority_values_first` picks the direction; a `level` is a priority turned
so that lower always goes first, and nothing else in the scheduler looks at that flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.config import CoreConfig


@dataclass(frozen=True, slots=True)
class PriorityRule:
    low_values_first: bool = False
    preemption_threshold: int = 10

    @classmethod
    def of(cls, config: CoreConfig) -> PriorityRule:
        return cls(config.schedule_low_priority_values_first, config.priority_scheduling_preemption_threshold)

    def level(self, priority: int) -> int:
        """Lower levels are more important."""
        return priority if self.low_values_first else -priority

    def may_preempt(self, priority: int, victim_priority: int) -> bool:
        """More important than the victim by strictly more than the threshold (SGLang's rule)."""
        return self.level(victim_priority) - self.level(priority) > self.preemption_threshold
