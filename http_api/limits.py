"""What the HTTP server enforces per request before the deployment sees it: the API key, the tenant's cache
salt, the per-client concurrency bound, the prompt-token and max_tokens caps and the default deadline
(HttpConfig).

A tenant is its API key when keys are configured, else the body's `user`; requests of different tenants never
share cached prefix blocks (their salts differ), which closes the prefix-cache timing side channel vLLM closes
with `cache_salt`. A key is never logged, echoed or sent on: the salt is a hash of it.
"""

import hashlib
import hmac
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from cluster_configs.cluster_config import HttpConfig
from http_api.errors import APIError


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as the HTTP layer knows it."""
    api_key: str | None = None  # checked by Tenancy.authenticate
    host: str | None = None  # the peer's address


ANONYMOUS = Caller()


class Tenancy:
    def __init__(self, config: HttpConfig):
        self.config = config
        self._keys = [k.encode() for k in config.api_keys]
        self._open: Counter[str] = Counter()  # client -> requests in flight

    def authenticate(self, authorization: str | None) -> str | None:
        """-> the request's API key (None when no keys are configured), else 401."""
        if not self._keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and any(hmac.compare_digest(token.strip().encode(), k)
                                              for k in self._keys):
            return token.strip()
        raise APIError(401, "missing or invalid API key; send one of the deployment's keys as the header "
                            "'Authorization: Bearer <key>' (the openai client's api_key)",
                       code="invalid_api_key")

    @staticmethod
    def cache_salt(api_key: str | None, user: str | None, body_salt: str | None) -> str | None:
        """The tenant's salt (API key, else user), mixed with the body's cache_salt; None: no tenant, no
        salt."""
        tenant = f"key:{api_key}" if api_key is not None else f"user:{user}" if user is not None else None
        if tenant is None and body_salt is None:
            return None
        return hashlib.sha256(f"{tenant}\x00{body_salt}".encode()).hexdigest()[:32]

    @staticmethod
    def client(caller: Caller, user: str | None) -> str:
        """Whose concurrency a request counts against: its API key, else its user, else its peer address."""
        if caller.api_key is not None:
            return "key:" + hashlib.sha256(caller.api_key.encode()).hexdigest()
        return f"user:{user}" if user is not None else f"host:{caller.host}"

    def admit(self, client: str) -> Callable[[], None]:
        """Count one open request of client (429 past max_concurrent_per_client); -> its release, to call
        once."""
        limit = self.config.max_concurrent_per_client
        if self._open[client] >= limit:
            raise APIError(429, f"this client already has {limit} requests open, the limit "
                                f"max_concurrent_per_client={limit}; wait for one to finish, or raise the "
                                "limit (http: {max_concurrent_per_client: N} in the config, or numaserve "
                                "serve --max-concurrent-per-client N)", type="rate_limit_error",
                           param="max_concurrent_per_client", code="too_many_concurrent_requests",
                           headers={"Retry-After": "1"})
        self._open[client] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._open[client] -= 1
                if self._open[client] <= 0:
                    del self._open[client]
        return release

    def check_max_tokens(self, max_tokens: int) -> None:
        cap = self.config.max_tokens_cap
        if max_tokens > cap:
            raise APIError(400, f"max_tokens={max_tokens} exceeds this server's max_tokens_cap={cap}; ask "
                                f"for at most {cap}, or raise the cap (http: {{max_tokens_cap: N}}, or "
                                "numaserve serve --max-tokens-cap N)", param="max_tokens",
                           code="max_tokens_exceeded")

    def check_prompt(self, num_prompt_tokens: int, param: str) -> None:
        limit = self.config.max_prompt_tokens
        if limit is not None and num_prompt_tokens > limit:
            raise APIError(400, f"the prompt has {num_prompt_tokens} tokens, more than this server's "
                                f"max_prompt_tokens={limit}; shorten it, or raise the limit (http: "
                                "{max_prompt_tokens: N}, or numaserve serve --max-prompt-tokens N)",
                           param=param, code="prompt_too_long")

    def deadline_s(self, requested: float | None) -> float | None:
        return requested if requested is not None else self.config.default_deadline_s

    def deadline_error(self, deadline_s: float | None) -> APIError:
        return APIError(408, f"the request passed its deadline ({deadline_s} s) before any of it was sent, "
                             "and was aborted; set a longer deadline_s in the body, or raise the server's "
                             "default (http: {default_deadline_s: S}, or numaserve serve "
                             "--default-deadline-s S)",
                        type="timeout_error", param="deadline_s", code="deadline_exceeded")


async def release_after(stream: AsyncIterator[bytes], release: Callable[[], None]) -> AsyncIterator[bytes]:
    """The stream, then release (also when the client goes away and the stream is closed)."""
    try:
        async for item in stream:
            yield item
    finally:
        release()
