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

A body is read as JSON whatever its Content-Type says (`curl -d` sends form encoding); every error,
a wrong method included, has OpenAI's shape. Shutting down (APIServer) goes in order: stop
accepting, end every live request (a stream gets an error event and [DONE]), close the sockets.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine_client import Disconnected, EngineClient, RequestHandle
from .messages import EngineInfo, PortArgs
from .openai_serving import ChatBuilder, CompletionBuilder, GenerateBuilder, ResponseBuilder
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, GenerateRequest

PLAYGROUND = Path(__file__).parent / "static" / "playground.html"


def sse(body: dict | str) -> str:
    """One server-sent event: `data: <payload>` and a blank line."""
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


async def read_body(request: Request, model: type[BaseModel]):
    """The body as JSON, whatever its Content-Type (FastAPI would hand a form-encoded one over as
    bytes, and the error would speak of a dictionary); its errors go to FastAPI's handler."""
    try:
        return model.model_validate_json(await request.body() or b"{}")
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


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


def create_app(ports: PortArgs, served_model_name: str, info: EngineInfo,
               server_info: dict) -> FastAPI:
    """server_info: what /get_server_info reports besides the scheduler's state (model path, engine
    arguments, process ids); the launcher fills it in."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = EngineClient(ports)  # sockets made inside the event loop that will use them
        client.start()
        app.state.client, app.state.loop = client, asyncio.get_running_loop()
        yield
        client.close()

    app = FastAPI(title="sglang-from-zero", lifespan=lifespan)
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
        body = await read_body(request, ChatCompletionRequest)
        check_model(body.model)
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
        body = await read_body(request, CompletionRequest)
        check_model(body.model)
        return_logprob = body.logprobs is not None
        params = body.sampling_params(body.max_new_tokens())
        handle = await client_of(request).generate(
            body.prompts(), params, body.n, return_logprob, body.logprobs or 0,
            logprob_start_len=body.logprob_start_len, echo=body.echo)
        builder = CompletionBuilder(served_model_name, len(handle.index), body.n,
                                    body.include_usage, return_logprob, body.continuous_usage,
                                    echo=body.echo, drop_output=body.max_tokens == 0)
        return await respond(request, handle, builder, body.stream)

    @app.post("/generate")
    async def generate(request: Request):
        body = await read_body(request, GenerateRequest)
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids", "text")
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
