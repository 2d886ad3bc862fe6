"""What every measured run (in process or against an endpoint) says the same way."""

from __future__ import annotations


class Measured:
    """A run with `new_tokens`, `seconds` and `error` (None: it measured): whether it did, and its tokens/s."""

    new_tokens: int
    seconds: float
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.ok and self.seconds > 0 else 0.0
