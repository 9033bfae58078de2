"""Named model endpoints: the registry `prime-rl eval -m NAME` reads (`configs/endpoints.toml`).

    [[endpoint]]
    endpoint_id = "gpt-4.1-mini"          # the name given to -m / endpoint_id
    model = "gpt-4.1-mini"                # the model name sent in requests
    url = "https://api.openai.com/v1"     # OpenAI-compatible base URL, ending in /v1
    key = "OPENAI_API_KEY"                # the environment variable holding the API key

The file names the variable, never the key, and nothing prime-rl writes holds the key:
the eval process reads the variable when it starts. A variable that is not set means no
Authorization header, which suits a local server that needs no key.

Imports neither torch nor the orchestrator: the launcher checks names before anything starts.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import ValidationError, model_validator

from prime_rl.config import StrictModel
from prime_rl.settings import ConfigError, format_validation_error, read_config_file


class Endpoint(StrictModel):
    endpoint_id: str
    """Name of the endpoint (what `-m` takes)."""

    model: str
    """Model name sent in requests."""

    url: str
    """OpenAI-compatible base URL, ending in `/v1` (requests go to `URL/chat/completions`)."""

    key: str | None = None
    """Name of the environment variable holding the API key; None or unset = no key is sent."""

    @model_validator(mode="after")
    def _shape(self) -> Endpoint:
        if not re.match(r"https?://", self.url):
            raise ValueError(f"endpoint {self.endpoint_id!r}: url {self.url!r} must start with http:// or https://")
        if self.key is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.key):
            raise ValueError(
                f"endpoint {self.endpoint_id!r}: key {self.key!r} must name an environment variable (e.g. OPENAI_API_KEY), not hold the key"
            )
        return self


class EndpointsFile(StrictModel):
    endpoint: list[Endpoint] = []
    """The `[[endpoint]]` tables."""


def load_endpoints(path: Path) -> dict[str, Endpoint]:
    """Endpoints by name; a missing file, bad TOML, an unknown key or a name used twice is a
    ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"endpoints file {str(path)!r} not found (expected [[endpoint]] tables; see --endpoints-path)")
    try:
        parsed = EndpointsFile.model_validate(read_config_file(path))
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path))) from None
    endpoints: dict[str, Endpoint] = {}
    for endpoint in parsed.endpoint:
        if endpoint.endpoint_id in endpoints:
            raise ConfigError(f"{path}: endpoint_id {endpoint.endpoint_id!r} is defined twice")
        endpoints[endpoint.endpoint_id] = endpoint
    return endpoints
