"""What kind of forward pass a batch is."""

from __future__ import annotations

import enum


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill new tokens on top of a (possibly empty) cached prefix
    DECODE = 2  # one new token per request
    MIXED = 3  # extends and decodes in one batch (mixed chunk)
    IDLE = 4  # no forward: host-tier copies that no step would carry, the engine being idle
