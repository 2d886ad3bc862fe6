"""What every measured run (in process or against an endpoint) says the same way, and the orders runs take turns in."""

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


def balanced_orders(n: int) -> list[list[int]]:
    """A Williams design over n configurations: orders in which each takes every position equally often and
    follows every other one equally often (n orders for even n, 2n for odd n). A run can leave state behind
    that slows or speeds the next (caches, memory another llama.cpp context touched): rotating one fixed
    order let every configuration follow the same one every time, which confounds that carry-over with the
    configuration itself; here it averages out."""
    first, low, high = [0], 1, n - 1
    for j in range(1, n):
        if j % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    orders = [[(x + i) % n for x in first] for i in range(n)]
    return orders + [order[::-1] for order in orders] if n % 2 else orders
