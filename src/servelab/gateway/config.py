"""The gateway's settings (the `servelab serve` flags beyond the engine's). Validation only."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
ROUTERS = ("least-loaded", "prefix")  # engine/async_llm.py


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
    # Hostile-input limits (vLLM's --max-logprobs; the others have no vLLM name)
    max_n: int = 16
    max_logprobs: int = 20
    max_stop_strings: int = 64
    max_stop_string_len: int = 256
    # Slow clients: seconds to send the request headers / the whole body (slowloris), and the most
    # generated tokens a stream may hold unsent before the request is aborted (a reader that stopped).
    header_read_timeout: float = 10.0
    body_read_timeout: float = 30.0
    max_unsent_tokens: int = 4096
    allowed_origins: tuple[str, ...] = ()  # CORS is off unless origins are given
    # split <think>...</think> out of chat output as reasoning_content (vLLM's --reasoning-parser names)
    reasoning_parser: str | None = None
    router: str = "least-loaded"  # which engine core takes a request (one of ROUTERS)

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
            (self.max_n >= 1, f"max_n must be >= 1, got {self.max_n}"),
            (0 <= self.max_logprobs <= 20, f"max_logprobs must be in [0, 20], got {self.max_logprobs}"),
            (self.max_stop_strings >= 0, f"max_stop_strings must be >= 0, got {self.max_stop_strings}"),
            (self.max_stop_string_len >= 1, f"max_stop_string_len must be >= 1, got {self.max_stop_string_len}"),
            (self.header_read_timeout > 0, f"header_read_timeout must be > 0, got {self.header_read_timeout}"),
            (self.body_read_timeout > 0, f"body_read_timeout must be > 0, got {self.body_read_timeout}"),
            (self.max_unsent_tokens >= 1, f"max_unsent_tokens must be >= 1, got {self.max_unsent_tokens}"),
            (self.router in ROUTERS, f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def model_name(self) -> str:
        """The name responses carry unless the request named another alias."""
        return self.served_model_names[0]
