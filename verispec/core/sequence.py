"""The committed token sequence, mirrored on the host (list) and on the device (buffer)."""

from __future__ import annotations

import torch

from verispec.core.timing import device_tensor


class TokenSequence:
    """Committed tokens: `ids` on the host, `buffer[:len]` on the device. Appending device tokens
    writes the buffer without a host round-trip; the host list is filled from the round's one sync."""

    def __init__(self, prompt: list[int], capacity: int, device: torch.device) -> None:
        self.ids: list[int] = list(prompt)
        self.prompt_length = len(prompt)
        self.buffer = torch.empty(max(capacity, len(prompt)), dtype=torch.long, device=device)
        self.buffer[: len(prompt)] = device_tensor(prompt, device)
        self._presence: torch.Tensor | None = None  # [V] bool over ids[:_presence_len]
        self._presence_len = 0

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def device_ids(self) -> torch.Tensor:
        return self.buffer[: len(self.ids)]

    @property
    def generated(self) -> list[int]:
        """A copy of the generated ids (O(n): per round, count them with `new_tokens`)."""
        return self.ids[self.prompt_length :]

    @property
    def new_tokens(self) -> int:
        """How many ids were generated."""
        return len(self.ids) - self.prompt_length

    def extend(self, host: list[int], device: torch.Tensor) -> None:
        """Append tokens known both on the host and the device (same values)."""
        start = len(self.ids)
        self.buffer[start : start + len(host)] = device
        self.ids.extend(host)

    def truncate(self, length: int) -> None:
        del self.ids[length:]
        self._presence = None

    def presence(self, vocab_size: int) -> torch.Tensor:
        """[V] bool: which tokens occur in the sequence (for the repetition penalty). Kept up to date
        incrementally, so the draft and the verifier share one O(new tokens) update per round.
        Callers must not modify it in place."""
        if self._presence is None or self._presence.numel() != vocab_size:
            self._presence = torch.zeros(vocab_size, dtype=torch.bool, device=self.buffer.device)
            self._presence_len = 0
        if self._presence_len < len(self.ids):
            self._presence.index_fill_(0, self.buffer[self._presence_len : len(self.ids)], True)
            self._presence_len = len(self.ids)
        return self._presence
