"""A server's limits and access settings: what `create_app` takes, and the defaults `verispec serve` shows (kept
free of the web framework, so the command line reads them without importing it)."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.names.options import SERVER_MAX_TOKENS


@dataclass(frozen=True)
class ServerSettings:
    model_names: tuple[str, ...]
    max_queue: int = 64
    max_prompt_tokens: int = 8192
    max_tokens_cap: int = 4096
    default_max_tokens: int = SERVER_MAX_TOKENS
    max_body_bytes: int = 1 << 20
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ("127.0.0.1", "localhost", "::1")  # "*": any Host header
    enable_docs: bool = False
    max_in_flight: int = 256  # requests handled at once (streams included); beyond it 429
    max_batch: int = 1  # sequences decoded together (continuous batching), where the pipeline can batch

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_prompt_tokens", "max_tokens_cap", "default_max_tokens", "max_body_bytes",
                     "max_in_flight", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not self.allowed_hosts:
            raise ValueError("allowed_hosts is empty: no request could be served (use '*' to allow any)")
