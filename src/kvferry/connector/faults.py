"""Deterministic fault injection (`--faults SPEC` / `KVFERRY_FAULTS`).

SPEC is `name=probability,...` plus `seed=N`; `slow` takes milliseconds instead of a probability.
Whether a fault fires is a pure function of (seed, name, transfer_id), so P, D, a test and `kvferry
chaos` all agree on which transfers fail without talking to each other."""

from __future__ import annotations

from dataclasses import dataclass, field

import xxhash

# In pipeline order: when several fire for one transfer, the first one decides what happens.
FAULT_NAMES = ("bootstrap", "p_not_ready", "drop_reply", "error_reply", "err_reqs", "transport", "corrupt")
SLOW = "slow"

# The failure cause the decode side reports for each fault (docs/design.md).
CAUSE_OF_FAULT = {
    "bootstrap": "bootstrap",
    "p_not_ready": "err_reqs",
    "drop_reply": "deadline",  # a live P is asked again until the request's deadline (liveness on)
    "error_reply": "error_reply",
    "err_reqs": "err_reqs",
    "transport": "transport",
    "corrupt": "checksum",
}


@dataclass(frozen=True)
class FaultSpec:
    probabilities: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    slow_ms: float = 0.0

    @classmethod
    def parse(cls, spec: str | None) -> FaultSpec:
        probabilities: dict[str, float] = {}
        seed, slow_ms = 0, 0.0
        for item in (spec or "").split(","):
            item = item.strip()
            if not item:
                continue
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep:
                raise ValueError(f"fault {item!r}: expected name=value")
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"fault {name!r}: {value!r} is not a number") from None
            if name == "seed":
                seed = int(number)
            elif name == SLOW:
                if number < 0:
                    raise ValueError("slow must be >= 0 ms")
                slow_ms = number
            elif name in FAULT_NAMES:
                if not 0.0 <= number <= 1.0:
                    raise ValueError(f"fault {name!r}: probability {number} not in [0, 1]")
                probabilities[name] = number
            else:
                raise ValueError(f"unknown fault {name!r}; known: {', '.join((*FAULT_NAMES, SLOW, 'seed'))}")
        return cls(probabilities, seed, slow_ms)

    def __bool__(self) -> bool:
        return bool(self.probabilities) or self.slow_ms > 0

    def fires(self, name: str, transfer_id: str) -> bool:
        p = self.probabilities.get(name, 0.0)
        if p <= 0.0:
            return False
        draw = xxhash.xxh64_intdigest(f"{self.seed}\0{name}\0{transfer_id}".encode()) / 2.0**64
        return draw < p

    def fault_for(self, transfer_id: str) -> str | None:
        """The fault that takes effect for this transfer (the earliest in the pipeline), or None."""
        return next((name for name in FAULT_NAMES if self.fires(name, transfer_id)), None)

    def expected_cause(self, transfer_id: str) -> str | None:
        fault = self.fault_for(transfer_id)
        return None if fault is None else CAUSE_OF_FAULT[fault]

    def to_spec(self) -> str:
        parts = [f"{name}={p}" for name, p in self.probabilities.items()]
        if self.slow_ms:
            parts.append(f"{SLOW}={self.slow_ms}")
        parts.append(f"seed={self.seed}")
        return ",".join(parts)
