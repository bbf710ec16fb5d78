"""The HTTP front: a FastAPI app served by uvicorn in the main process.

    POST /v1/chat/completions, /v1/completions   OpenAI's API, streaming (SSE) or not
    GET  /v1/models, /v1/models/{id}             the one model served
    POST /generate                               SGLang's native API
    GET  /health                                 200 while every process is alive
    GET  /get_server_info                        engine settings, process ids, scheduler state
                                                 (?check=1: and the full integrity check)
    POST /flush_cache                            empty the radix cache of what no request uses
    GET  /                                       the playground: one HTML page that chats with the
                                                 server

A handler turns the body into prompts + SamplingParams names, hands them to the EngineClient, and
turns what comes back into OpenAI's shape. Streaming uses server-sent events: each chunk is one line
`data: {json}` followed by a blank line; the stream ends with `data: [DONE]`. A client that
disconnects has its requests aborted.

Before a handler runs, access.AccessGuard checks who asks (Host, Origin, the API key) and what is
sent (a JSON body, not too large); each handler then checks how much it asks (RequestLimits: prompts
x n, a prompt's bytes against the context). The request models are declared in /openapi.json, so
that schema-driven clients and fuzzers see the contract; the handlers read the raw body themselves,
to name a bad field in OpenAI's error shape. Every error, a wrong method included, has that shape.
Shutting down (APIServer) goes in order: stop accepting, end every live request (a stream gets an
error event and [DONE]), close the sockets.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .access import AccessGuard, AccessPolicy, RequestLimits, body_too_large
from .engine_client import Disconnected, EngineClient, RequestHandle
from .messages import EngineInfo, PortArgs
from .openai_serving import ChatBuilder, CompletionBuilder, GenerateBuilder, ResponseBuilder
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, ErrorResponse,
                       GenerateRequest)

PLAYGROUND = Path(__file__).parent / "static" / "playground.html"


def sse(body: dict | str) -> str:
    """One server-sent event: `data: <payload>` and a blank line."""
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


REQUEST_BODIES = {"/v1/chat/completions": ChatCompletionRequest,
                  "/v1/completions": CompletionRequest, "/generate": GenerateRequest}
# What a route may answer besides 200, all in OpenAI's error shape (declared in /openapi.json)
ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": description} for status,
                   description in [(400, "a bad request, naming the field"),
                                   (401, "missing or wrong API key"),
                                   (403, "a web page of another origin"),
                                   (404, "no such route or model"), (413, "body too large"),
                                   (415, "a body that is not JSON"), (421, "a Host not served"),
                                   (503, "the engine is stopping")]}
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


async def read_body(request: Request, model: type[BaseModel], limit: int):
    """The body (JSON: the AccessGuard checked its Content-Type) as `model`, read up to `limit`
    bytes (a body sent without a Content-Length is counted here); its errors go to FastAPI's
    handler."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise body_too_large(len(body), limit, exact=False)
    try:
        return model.model_validate_json(bytes(body) or b"{}")
    except ValidationError as exc:
        errors = exc.errors()
        lone = lone_surrogate(bytes(body)) if errors[0].get("type") == "json_invalid" else None
        if lone is not None:
            where = str(errors[0].get("ctx", {}).get("error", "")).rpartition(" at ")[2]
            raise APIError(
                400, f"malformed JSON body: a lone UTF-16 surrogate escape ({lone}"
                f"{' at ' + where if where else ''}) is half of a character: JSON text must be "
                "valid Unicode (send the character, or both halves of its surrogate pair)"
            ) from None
        raise RequestValidationError(errors) from None


def lone_surrogate(body: bytes) -> str | None:
    """The first surrogate escape of a body that is JSON except for unpaired surrogates (which
    Python's json accepts and pydantic's parser does not), else None."""
    try:
        json.loads(body)
    except ValueError:
        return None
    escapes = list(SURROGATE_ESCAPE.finditer(body))
    for i, found in enumerate(escapes):
        high = found.group()[3] in b"89abAB"
        paired = high and i + 1 < len(escapes) and escapes[i + 1].start() == found.end() and \
            escapes[i + 1].group()[3] not in b"89abAB"
        after_high = i > 0 and escapes[i - 1].end() == found.start() and not high
        if not (paired or after_high):
            return found.group().decode()
    return None


class APIServer(uvicorn.Server):
    """uvicorn's server, with one step added to its graceful shutdown (SIGTERM, SIGINT): after it
    stops accepting and before it waits for the open connections, every live request is ended (a
    stream with an error event and [DONE]) and nothing more is sent to the engine; the lifespan then
    closes the sockets."""

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()  # stop accepting (uvicorn does it again, harmlessly)
        client = getattr(self.config.app.state, "client", None)
        if client is not None and client.dead is None:
            client.fail_all("the server is shutting down")
        await super().shutdown(sockets)


def create_app(ports: PortArgs, served_model_name: str, info: EngineInfo, server_info: dict,
               access: AccessPolicy | None = None, limits: RequestLimits | None = None) -> FastAPI:
    """server_info: what /get_server_info reports besides the scheduler's state (model path, engine
    arguments, process ids); the launcher fills it in. access, limits: who may ask, and how much
    (default: anyone on the bound address, and the default limits)."""
    access = access or AccessPolicy.for_server("127.0.0.1", [], [], None, 16 * 2**20)
    limits = limits or RequestLimits()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = EngineClient(ports)  # sockets made inside the event loop that will use them
        client.start()
        app.state.client, app.state.loop = client, asyncio.get_running_loop()
        yield
        client.close()

    app = FastAPI(title="sglang-from-zero", lifespan=lifespan, responses=ERROR_RESPONSES)
    app.add_middleware(AccessGuard, policy=access)
    app.openapi = lambda: app.openapi_schema or describe_bodies(app)
    created = int(time.time())

    def client_of(request: Request) -> EngineClient:
        return request.app.state.client

    def check_model(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{served_model_name}`.",
                "model", "model_not_found")

    # ---------------------------------------------------------------- errors: OpenAI's shape,
    # always
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        if err.get("type") == "json_invalid":
            param, message = (
                None,
                f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}",
            )
        elif not loc:
            message = f"the body must be a JSON object ({err.get('msg')})"
        elif err.get("type") == "extra_forbidden":
            message = f"unsupported parameter: {param}"
        else:
            message = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
        return JSONResponse(APIError(400, message, param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code == 405:
            allowed = exc.headers.get("Allow")
            message = f"{request.method} is not allowed on {request.url.path}; use {allowed}"
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        return JSONResponse(APIError(500, f"internal error: {exc!r}").body(), status_code=500)

    # ---------------------------------------------------------------- generation
    async def respond(request: Request, handle: RequestHandle, builder: ResponseBuilder,
                      stream: bool):
        watcher = asyncio.get_running_loop().create_task(handle.abort_on_disconnect(request))
        try:
            # a refusal arrives first: answer it with its status, not a stream
            first = await handle.next()
        except Disconnected:
            return Response(status_code=499)
        except BaseException:
            watcher.cancel()
            raise
        if not stream:
            try:
                builder.add(*first)
                while not handle.done:
                    builder.add(*await handle.next())
            except Disconnected:
                return Response(status_code=499)  # nobody reads it
            finally:
                watcher.cancel()
                await handle.abort()  # no-op when all finished; else (an error) the others stop too
            return JSONResponse(builder.response())

        async def events():
            try:
                out = first
                while True:
                    for chunk in builder.stream_chunks(*out):
                        yield sse(chunk)
                    if handle.done:
                        break
                    out = await handle.next()
                for chunk in builder.final_chunks():
                    yield sse(chunk)
            except Disconnected:
                return
            except APIError as exc:  # a later prompt was refused, or the engine stopped, mid-stream
                yield sse(exc.body())
            finally:
                watcher.cancel()
                # the client went away (or an error): free the requests' KV pages
                await handle.abort()
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request, ChatCompletionRequest, access.max_body_bytes)
        check_model(body.model)
        limits.check_fan_out(1, body.n)
        # assistant turns are left out: a template may drop part of them (Qwen3's reasoning)
        limits.check_prompt_bytes([m.as_template_input()["content"].strip() for m in body.messages
                                   if m.role != "assistant"], "messages")
        return_logprob, top = body.logprob_args()
        params = body.sampling_params(body.max_new_tokens())
        messages = [m.as_template_input() for m in body.messages]
        handle = await client_of(request).generate([{"messages": messages}], params, body.n,
                                                   return_logprob, top)
        builder = ChatBuilder(served_model_name, len(handle.index), body.n, body.include_usage,
                              return_logprob, body.continuous_usage, tool_format=body.tool_format())
        return await respond(request, handle, builder, body.stream)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request, CompletionRequest, access.max_body_bytes)
        check_model(body.model)
        return_logprob = body.logprobs is not None
        params = body.sampling_params(body.max_new_tokens())
        prompts = body.prompts()
        limits.check_fan_out(len(prompts), body.n)
        for prompt in prompts:
            limits.check_prompt_bytes([prompt.get("text", "")], "prompt")
        handle = await client_of(request).generate(
            prompts, params, body.n, return_logprob, body.logprobs or 0,
            logprob_start_len=body.logprob_start_len, echo=body.echo)
        builder = CompletionBuilder(served_model_name, len(handle.index), body.n,
                                    body.include_usage, return_logprob, body.continuous_usage,
                                    echo=body.echo, drop_output=body.max_tokens == 0)
        return await respond(request, handle, builder, body.stream)

    @app.post("/generate")
    async def generate(request: Request):
        body = await read_body(request, GenerateRequest, access.max_body_bytes)
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids", "text")
        limits.check_prompt_bytes([body.text or ""], "text")
        if body.logprob_start_len >= 0 and not body.return_logprob:
            raise APIError(400, "logprob_start_len needs return_logprob set to true",
                           "logprob_start_len")
        prompt = {"text": body.text} if body.text is not None else {"input_ids": body.input_ids}
        handle = await client_of(request).generate([prompt], body.sampling_params.model_dump(), 1,
                                                   body.return_logprob, body.top_logprobs_num,
                                                   logprob_start_len=body.logprob_start_len)
        builder = GenerateBuilder(served_model_name, 1, logprobs=body.return_logprob)
        return await respond(request, handle, builder, body.stream)

    # ---------------------------------------------------------------- the rest
    def model_card() -> dict:
        return {"id": served_model_name, "object": "model", "created": created,
                "owned_by": "sglang-from-zero", "max_model_len": info.max_context_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.get("/health")
    async def health(request: Request):
        client_of(request).check_alive()
        return {"status": "ok"}

    @app.get("/get_server_info")
    async def get_server_info(request: Request, check: bool = False):
        state = await client_of(request).control("status", check_integrity=check)
        return dict(server_info, served_model_name=served_model_name,
                    max_context_len=info.max_context_len, max_total_tokens=info.max_total_tokens,
                    internal_state=state)

    @app.post("/flush_cache")
    async def flush_cache(request: Request):
        return await client_of(request).control("flush_cache")

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return PLAYGROUND.read_text()

    return app


def describe_bodies(app: FastAPI) -> dict:
    """FastAPI's schema, with the body model of each generating route (the handlers read the raw
    body, so FastAPI cannot see them) and no 422 (a bad request is a 400 here)."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in REQUEST_BODIES.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        operation = schema["paths"][path]["post"]
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        ok = operation["responses"]["200"]
        ok["description"] = "the response; with stream: true, server-sent events"
        ok["content"]["text/event-stream"] = {"schema": {
            "description": "each event's data: a JSON chunk, or [DONE] last"}}
    for operations in schema["paths"].values():
        for operation in operations.values():
            operation["responses"].pop("422", None)
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    app.openapi_schema = schema
    return schema
