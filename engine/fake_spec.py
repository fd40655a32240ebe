"""``--model fake:RATE[:stamp]``: the spec of the fake engine (``engine/fake.py``).

Apart from the fake engine itself, which imports torch: ``wsinfer serve``
checks its ``--model`` while it parses its flags, and the supervisor never
imports torch (it would cost it two seconds and, worse, torch's import of
numpy swallows a Ctrl-C that lands inside it, which then never stops serve).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FAKE_PREFIX = "fake:"


class FakeSpecError(ValueError):
    """A ``fake:`` model spec that cannot be parsed."""


@dataclass(frozen=True)
class FakeSpec:
    tokens_per_s: float
    stamp: bool = False

    @classmethod
    def parse(cls, spec: str) -> FakeSpec:
        parts = spec.removeprefix(FAKE_PREFIX).split(":")
        try:
            rate = float(parts[0])
        except ValueError:
            raise FakeSpecError(f"{spec!r}: expected fake:TOKENS_PER_S[:stamp]") from None
        if not rate > 0 or math.isnan(rate):
            raise FakeSpecError(f"{spec!r}: the rate must be a positive number (or inf)")
        if parts[1:] not in ([], ["stamp"]):
            raise FakeSpecError(f"{spec!r}: the only option is ':stamp'")
        return cls(rate, stamp=parts[1:] == ["stamp"])


def is_fake(spec: str | None) -> bool:
    return spec is not None and spec.startswith(FAKE_PREFIX)
