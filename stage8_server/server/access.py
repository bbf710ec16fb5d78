"""Who may use the server, and how much one request may ask: the checks an HTTP request passes
before any handler runs (README, "Exposing the server").

A server on 127.0.0.1 answers every program of the machine, and every web page its user opens: a
page cannot read another origin's answers, but its browser will send that origin "simple" requests
(a POST of text/plain or a form, or with no body) without asking anyone first. So, in this order:

1. Host (421): a page of evil.example whose name is made to resolve to 127.0.0.1 (DNS rebinding)
   sends `Host: evil.example`; only the address the server listens on, or a name given with
   --allowed-hosts, is answered. Names are compared, not ports (a rebinding page must use our port
   anyway); an IP address is always a fine Host on a wildcard address (0.0.0.0), since rebinding
   needs a name.
2. Origin (403): a browser names the page that sent a request; a page that is neither this server's
   own (the playground) nor one of --allowed-origins is refused, so no page can spend compute or
   flush the cache. Allowed origins get CORS headers, and their preflights an answer; no other
   origin gets any CORS permission.
3. The key (401): `Authorization: Bearer KEY` on every route but /health and the playground page
   (static; it asks for the key) when --api-key (or $SGLANG_API_KEY) is set. A page cannot add that
   header cross-origin without a preflight, which step 2 refuses.
4. A body must say it is JSON (415): text/plain and forms are what a page may send unasked.
5. A body longer than --max-request-body-bytes (413): its Content-Length is checked before any of it
   is read; a body sent without one (chunked) is counted as it is read (api_server.read_body).
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

from .protocol import APIError

HEALTH_ROUTES = ("/health", "/health_generate")  # a load balancer's probes need no key
PAGE_ROUTE = "/"  # the playground: a static page that asks for the key
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
WILDCARD_ADDRESSES = {"", "0.0.0.0", "::"}
BODY_METHODS = {"POST", "PUT", "PATCH"}
CORS_MAX_AGE_S = 600


@dataclass
class AccessPolicy:
    api_key: str | None = None
    host_names: set[str] = field(default_factory=set)  # lower case, no port; "*": any
    any_ip_host: bool = False  # a wildcard bind: any IP address is a fine Host
    origins: set[str] = field(default_factory=set)  # besides the server's own; "*": any
    max_body_bytes: int = 16 * 2**20

    @classmethod
    def for_server(cls, host: str, allowed_hosts: list[str], allowed_origins: list[str],
                   api_key: str | None, max_body_bytes: int) -> "AccessPolicy":
        names = {host.lower().strip("[]")} | {h.lower().rstrip(".") for h in allowed_hosts}
        wildcard = host in WILDCARD_ADDRESSES
        if wildcard or is_loopback(host):
            names |= LOOPBACK_NAMES
        if wildcard:  # clients may use any of the machine's names
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        return cls(api_key, names, wildcard, set(allowed_origins), max_body_bytes)

    # ---------------------------------------------------------------- the checks, in order
    def check(self, scope: dict) -> APIError | None:
        """The refusal for this request, or None to let it through."""
        headers = header_map(scope)
        host = headers.get("host")
        if host is not None and not self.host_allowed(host):
            return APIError(421, f"this server does not answer for the host {host!r}; start it "
                            "with --allowed-hosts naming it to allow that name", "host",
                            "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, scope, host):
            return APIError(403, f"requests from pages of {origin} are refused; start the server "
                            "with --allowed-origins naming it to allow them", "origin",
                            "origin_not_allowed")
        if scope["method"] == "OPTIONS":
            return None  # a preflight: answered by the guard itself, with CORS headers
        if self.api_key is not None and not self.public(scope) and not key_matches(
                headers.get("authorization", ""), self.api_key):
            return APIError(401, "missing or wrong API key: send the header "
                            "`Authorization: Bearer <key>` (the server's --api-key)", None,
                            "invalid_api_key")
        return self.check_body(scope["method"], headers)

    def host_allowed(self, host: str) -> bool:
        name = host_name(host)
        if "*" in self.host_names or name in self.host_names:
            return True
        return self.any_ip_host and is_ip(name)

    def origin_allowed(self, origin: str, scope: dict, host: str | None) -> bool:
        own = host is not None and origin == f"{scope.get('scheme', 'http')}://{host}"
        return own or self.cors_allowed(origin)

    def cors_allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    @staticmethod
    def public(scope: dict) -> bool:
        path = scope["path"]
        return path in HEALTH_ROUTES or (path == PAGE_ROUTE and scope["method"] in ("GET", "HEAD"))

    def check_body(self, method: str, headers: dict[str, str]) -> APIError | None:
        length = headers.get("content-length")
        chunked = "transfer-encoding" in headers
        if length is not None and not length.isdigit():
            return APIError(400, f"Content-Length must be a number of bytes, got {length!r}")
        if method not in BODY_METHODS or (not chunked and int(length or 0) == 0):
            return None  # no body: nothing to check (POST /flush_cache, say)
        media_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            return APIError(415, f"the body must be JSON, sent with `Content-Type: "
                            f"application/json` (got {media_type or 'no Content-Type'})", None,
                            "unsupported_media_type")
        if length is not None and int(length) > self.max_body_bytes:
            return body_too_large(int(length), self.max_body_bytes)
        return None


def body_too_large(size: int, limit: int, exact: bool = True) -> APIError:
    what = f"{size} bytes" if exact else f"more than {limit} bytes"
    return APIError(413, f"the request body is {what}; this server takes at most {limit} "
                    "(--max-request-body-bytes)", None, "request_too_large")


class AccessGuard:
    """ASGI middleware: AccessPolicy.check on every HTTP request; CORS headers for an allowed
    origin, and the answer to its preflight."""

    def __init__(self, app, policy: AccessPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self.policy.check(scope)
        headers = header_map(scope)
        origin = headers.get("origin")
        cors = origin is not None and self.policy.cors_allowed(origin)
        extra = [(b"access-control-allow-origin", origin.encode("latin-1")),
                 (b"vary", b"Origin")] if cors else []
        if error is None and scope["method"] == "OPTIONS" and cors and \
                "access-control-request-method" in headers:
            extra += [(b"access-control-allow-methods", b"GET, POST"),
                      (b"access-control-allow-headers", b"Authorization, Content-Type"),
                      (b"access-control-max-age", str(CORS_MAX_AGE_S).encode())]
            return await respond(send, 204, b"", extra)
        if error is not None:
            body = json.dumps(error.body()).encode()
            if error.status == 401:
                extra.append((b"www-authenticate", b"Bearer"))
            return await respond(send, error.status, body,
                                 [(b"content-type", b"application/json")] + extra)

        async def send_with_cors(message):
            if message["type"] == "http.response.start" and extra:
                message = dict(message, headers=list(message.get("headers", [])) + extra)
            await send(message)

        await self.app(scope, receive, send_with_cors)


async def respond(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    headers = headers + [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------- small helpers
def header_map(scope: dict) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def key_matches(authorization: str, api_key: str) -> bool:
    scheme, _, given = authorization.partition(" ")
    # compare_digest: the time taken does not tell how much of a guess was right
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(),
                                                                 api_key.encode())


def host_name(host: str) -> str:
    """'Example.COM:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]")[0]
    name, sep, port = host.rpartition(":")
    return (name if sep and port.isdigit() else host).rstrip(".")


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    return host == "localhost" or (is_ip(host) and ipaddress.ip_address(host).is_loopback)


# ---------------------------------------------------------------- a prompt's bytes vs. the context
def max_token_bytes(model_path: str | Path) -> int | None:
    """The most UTF-8 bytes of text one token can stand for, or None where that cannot be proved
    from tokenizer.json.

    Proved for byte-level BPE (GPT-2's scheme: SmolLM2, Llama 3, Qwen, Mistral's newer tokenizers)
    with no normalizer: the text's UTF-8 bytes, each written as one character of the byte alphabet,
    are cut into vocabulary entries (or added tokens, matched as literal text), so every token
    stands for as many bytes as its entry has characters, and a prompt of B bytes has at least
    B / max_token_bytes tokens. A normalizer could shrink or delete text (NFKC maps a 4-byte
    character to 1 byte; a Strip deletes), an unknown-token fallback can stand for a whole word:
    then None, and only the tokenizer worker's count applies."""
    path = Path(model_path) / "tokenizer.json"
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    model = spec.get("model") or {}
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or not byte_level or spec.get("normalizer") is not None:
        return None
    vocab = model.get("vocab") or {}
    longest = max((len(entry) for entry in vocab), default=1)
    added = [len(t.get("content", "").encode()) for t in spec.get("added_tokens", [])]
    return max([longest, *added])


def prompt_bytes_limit(max_req_len: int, token_bytes: int | None) -> int | None:
    """The most bytes a prompt may have and still fit: a prompt must leave room for one generated
    token (at most max_req_len - 1 tokens), and each token stands for at most token_bytes bytes, so
    a longer prompt has at least max_req_len tokens and would be refused after tokenizing."""
    return None if token_bytes is None else (max_req_len - 1) * token_bytes


@dataclass
class RequestLimits:
    """How much one HTTP request may ask, checked before any of it reaches the engine."""

    max_requests_per_call: int = 256  # prompts x n
    prompt_bytes: int | None = None  # prompt_bytes_limit(); None: only counted in tokens
    token_bytes: int | None = None

    def check_fan_out(self, prompts: int, n: int) -> None:
        if prompts * n > self.max_requests_per_call:
            raise APIError(
                400, f"{prompts} prompt(s) x n={n} make {prompts * n} requests; this server takes "
                f"at most {self.max_requests_per_call} per call (--max-requests-per-call)",
                "n" if prompts == 1 else "prompt")

    def check_prompt_bytes(self, texts: list[str], param: str) -> None:
        """Refuse, before tokenizing, text that cannot fit the context however it is cut."""
        if self.prompt_bytes is None:
            return
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if size > self.prompt_bytes:
            raise APIError(
                400, f"the prompt is {size} bytes of text; one token of this model stands for at "
                f"most {self.token_bytes} bytes, so it has more tokens than a prompt may have "
                f"here: at most {self.prompt_bytes} bytes fit", param, "context_length_exceeded")
