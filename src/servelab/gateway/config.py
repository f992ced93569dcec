"""The gateway's settings (the `servelab serve` flags beyond the engine's). Validation only."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...] = (DEFAULT_SERVED_MODEL_NAME,)
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    protect_metrics: bool = False
    max_num_queued_requests: int = 256
    max_queued_tokens: int = 131072
    max_request_bytes: int = 4 * 1024 * 1024
    request_timeout: float | None = 600.0  # seconds; None = no limit
    shutdown_grace: float = 30.0
    metrics_interval: float = 1.0

    def __post_init__(self) -> None:
        checks = [
            (bool(self.served_model_names) and all(self.served_model_names), "served model names must not be empty"),
            (0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}"),
            (all(self.api_keys), "an API key must not be empty"),
            (self.max_num_queued_requests >= 1,
             f"max_num_queued_requests must be >= 1, got {self.max_num_queued_requests}"),
            (self.max_queued_tokens >= 1, f"max_queued_tokens must be >= 1, got {self.max_queued_tokens}"),
            (self.max_request_bytes >= 1, f"max_request_bytes must be >= 1, got {self.max_request_bytes}"),
            (self.request_timeout is None or self.request_timeout > 0,
             f"request_timeout must be > 0, got {self.request_timeout}"),
            (self.shutdown_grace >= 0, f"shutdown_grace must be >= 0, got {self.shutdown_grace}"),
            (self.metrics_interval > 0, f"metrics_interval must be > 0, got {self.metrics_interval}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def model_name(self) -> str:
        """The name responses carry unless the request named another alias."""
        return self.served_model_names[0]
