"""The OpenAI-compatible HTTP API of a worker: `POST /v1/chat/completions`, `POST /v1/completions`
(both also streamed as server-sent events), `POST /v1/responses` (on chat's path: responses.py) and
`GET /v1/models`; beside them what operators and tools probe: `GET /health` (200 serving, 503 warming
up or draining; no credentials), `GET /metrics` (the worker's Prometheus registry), `POST /tokenize`
and `POST /detokenize` (vLLM's shapes).

The HTTP edge of the worker's front door (`services/worker/front.py:FrontDoor`), as the gRPC servicer is the
other: a request's JSON becomes an `Ask` (convert.py) and goes in by the same door as a gRPC call (the same
checks, admission, deadlines and engine); its domain errors become HTTP codes with OpenAI's error body.
Without tokens the tenant is the `X-Tenant` header, else the default one (OpenAI's `user`, an end-user
id, never makes one); with tenant tokens, `Authorization: Bearer <token>` names it (an `X-Tenant` header
naming another is refused). Each call has a request id and one access log line (observe.py); browsers
are answered cross-origin only from `allowed_origins` (CORS). Chat replies' reasoning: reasoning.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ...core.errors import PermissionDenied, TRServeError
from ...engine.request.history import reads_tool_calls
from ...engine.results import StepChunk
from ..common.errors import status_for
from . import convert
from .convert import BadParam, ModelNotFound
from .errors import ClientGone, HttpDeadline, TooLarge, Unauthenticated, error_body, error_response
from .observe import RequestLog
from .options import Vocabulary
from .reasoning import Reasoning
from .responses import Responses
from .toolparse import marker_tokens, resolve_parser
from .streams import all_or_none, first_items, merged
from ..worker.checks import tenant_of
from ..worker.front import FrontDoor, StreamEnd

log = logging.getLogger("trserve.openai")
DISCONNECT_POLL_S = 0.25  # how often a unary call checks that its HTTP client is still there


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, separators=(',', ':'))}\n\n"


class OpenAIApp:
    """The routes, bound to one worker's front door (its decoder, config, admission and metrics)."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.config = door.config
        self.model_id = door.model_name
        self.fingerprint = door.decoder.fingerprint
        self.created, decoder = int(time.time()), door.decoder
        self.tools = resolve_parser(self.config.tool_call_parser, decoder.prompts.tool_template)  # "auto"'s format
        self.tool_markers = marker_tokens(decoder.tokenizer, self.tools)  # its markers as tokens of their own
        self.tool_fold = not reads_tool_calls(decoder.prompts.tool_template)  # earlier calls as text (toolchoice.py)
        # each token's own bytes, as the grammar engine reads the vocabulary (its view is built on first use)
        self.vocab = Vocabulary(decoder.tokenizer, lambda token: decoder.grammars.tokenizer().decode_bytes([token]))
        self.reasoning = Reasoning(self.config.reasoning_parser, decoder.prompts)  # --reasoning-parser

    def asgi(self):
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/responses", Responses(self).create, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"]),
                  Route("/tokenize", self.tokenize, methods=["POST"]),
                  Route("/detokenize", self.detokenize, methods=["POST"])]
        middleware = []
        if self.config.allowed_origins:
            middleware.append(Middleware(
                CORSMiddleware, allow_origins=list(self.config.allowed_origins), allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type", "x-request-id", "x-tenant", "x-request-timeout"],
                expose_headers=["x-request-id", "retry-after", "retry-after-ms"], max_age=600))
        app = Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: self._http_error})
        return RequestLog(app)  # outermost: the id and the access line cover CORS refusals too

    # ---- routes ------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        try:
            self._token_tenant(request)
        except TRServeError as exc:
            return error_response(exc)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        try:
            self._token_tenant(request)
            if request.path_params["model"] != self.model_id:
                raise ModelNotFound(f"the model {request.path_params['model']!r} does not exist here: this server "
                                    f"serves {self.model_id!r}", "model")
        except TRServeError as exc:
            return error_response(exc)
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        if self.door.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not self.door.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        """The worker's registry, on a server without tenant tokens. With tokens the API port faces
        tenants, and the series name every tenant: they are on --metrics-port only."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self.config.tenant_tokens is not None:
            return error_response(PermissionDenied(
                "with tenant tokens the metrics (which name every tenant) are served on --metrics-port only"))
        body = await asyncio.to_thread(generate_latest, self.door.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: {"prompt": text} or {"messages": [...]} -> {"count", "max_model_len", "tokens"}:
        the ids Generate would see (a chat's template applied with the assistant turn opened)."""
        try:
            request.state.tenant = tenant_of(self._tenant(request, None, self._token_tenant(request)),
                                             self.config.default_tenant)
            body = await self._body(request)
            ids = await self.door.tokenize(*convert.tokenize_request(body))
        except Exception as exc:  # noqa: BLE001 - mapped
            self._count("openai.tokenize", exc)
            return error_response(exc)
        self._count("openai.tokenize", None)
        return JSONResponse({"count": len(ids), "max_model_len": self.door.decoder.max_context, "tokens": ids,
                             "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
        try:
            request.state.tenant = tenant_of(self._tenant(request, None, self._token_tenant(request)),
                                             self.config.default_tenant)
            body = await self._body(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise BadParam("tokens must be a list of token ids", "tokens")
            text = await self.door.detokenize(tokens)
        except Exception as exc:  # noqa: BLE001 - mapped
            self._count("openai.detokenize", exc)
            return error_response(exc)
        self._count("openai.detokenize", None)
        return JSONResponse({"prompt": text})

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "text")

    # ---- one generation ----------------------------------------------------------------------
    async def _generate(self, request: Request, kind: str) -> Response:
        method = "openai.chat.completions" if kind == "chat" else "openai.completions"
        try:
            token_tenant = self._token_tenant(request)
            body = await self._body(request)
            req = convert.parse_request(body, kind, self.model_id, self._tenant(request, body, token_tenant), self.tools,
                                        self.tool_markers, self.tool_fold)
            deadline = HttpDeadline(request)
            if req.stream:
                return await self._stream(req, method, deadline, request.state)
            # n choices decode side by side (each its own request in the batch)
            done = await all_or_none([self._complete_while_connected(request, ask, deadline)
                                       for ask in convert.choice_asks(req)])
        except Exception as exc:  # noqa: BLE001 - every failure is mapped, never dropped
            self._count(method, exc)
            return error_response(exc)
        self._count(method, None)
        results, tenant = [d.result for d in done], done[0].call.tenant
        request.state.tenant = tenant
        request.state.tokens = (results[0].stats.prompt_tokens, sum(r.stats.generated_tokens for r in results))
        body = convert.completion(req, results, done[0].queue_s, self.fingerprint, self.vocab, tenant)
        return JSONResponse(await self.reasoning.answer(req, body))

    async def _complete_while_connected(self, request: Request, ask, deadline: HttpDeadline):
        """The front door's complete of one choice, cancelled (its decode slot freed at the next step)
        once the client has gone: an HTTP unary call otherwise decodes to the end for nobody."""
        task = asyncio.ensure_future(self.door.complete(ask, deadline))
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    raise ClientGone("the client closed the connection: its generation was cancelled")
            return task.result()
        finally:
            if not task.done():  # this handler itself was cancelled
                task.cancel()

    async def _stream(self, req: convert.OpenAIRequest, method: str, deadline: HttpDeadline, state) -> Response:
        """Waits for each choice's first chunk (after the prefills), so refusals are still plain HTTP errors."""
        streams = [self.door.stream(ask, deadline) for ask in convert.choice_asks(req)]
        firsts = await first_items(streams)
        writers = await self.reasoning.writers(req, convert.ChunkWriter.of(req, self.fingerprint, self.vocab), len(streams))
        return StreamingResponse(self._events(writers, merged(streams, firsts, StreamEnd), method, state),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                          "X-Accel-Buffering": "no"})

    async def _events(self, writers: list[convert.ChunkWriter], items: AsyncIterator[tuple[int, StepChunk | StreamEnd]],
                      method: str, state) -> AsyncIterator[str]:
        """Each choice's chunks as they come (index i by writers[i]), its last chunk when it ends, then
        the usage of them all."""
        error: BaseException | None = ClientGone("the client closed the stream")  # until the end is sent
        ends: dict[int, StreamEnd] = {}
        async with contextlib.aclosing(items):
            try:
                async for i, item in items:
                    writer = writers[i]
                    first = not writer.started
                    if isinstance(item, StreamEnd):
                        ends[i], state.tenant = item, item.call.tenant
                        reason = "shutdown" if item.drained else item.result.finish_reason
                        yield sse(writer.last_chunk(item.rest, item.result, reason, item.queue_s, item.call.tenant))
                    elif item.text or first:
                        yield sse(writer.chunk(item.text, role=first, token_ids=item.tokens, logprobs=item.logprobs))
                    else:  # tokens whose text is held back (a possible stop string) or not yet whole
                        yield sse(writer.chunk(None if writer.req.kind == "chat" else "", token_ids=item.tokens,
                                               logprobs=item.logprobs))
                    writer.started = True
                end = ends[0]
                results = [ends[i].result for i in sorted(ends)]
                state.tokens = (end.result.stats.prompt_tokens, sum(r.stats.generated_tokens for r in results))
                if writers[0].req.include_usage:
                    reason = "shutdown" if end.drained else end.result.finish_reason
                    yield sse(writers[0].usage_chunk(end.result, reason, end.queue_s, end.call.tenant,
                                                     tuple(results[1:])))
                error = None
            except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes in the stream
                error = exc
                yield sse(error_body(exc)[1])
            finally:
                self._count(method, error)
        yield sse("[DONE]")

    # ---- helpers -----------------------------------------------------------------------------
    async def _body(self, request: Request) -> object:
        limit, size, parts = self.config.max_request_bytes, 0, []
        try:
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise TooLarge(f"the request body is over {limit} bytes (--max-request-bytes): shorten it")
                parts.append(part)
        except ClientDisconnect:
            raise ClientGone("the client closed the connection before its body was whole") from None
        try:
            return json.loads(b"".join(parts))
        except RecursionError:
            raise BadParam("the request body nests JSON too deeply") from None
        except ValueError:
            raise BadParam("the request body is not valid JSON") from None

    def _token_tenant(self, request: Request) -> str | None:
        """With tenant tokens: the tenant the bearer token belongs to (else Unauthenticated); None without."""
        tokens = self.config.tenant_tokens
        if tokens is None:
            return None
        auth = request.headers.get("authorization", "")
        if not auth.startswith("Bearer "):
            raise Unauthenticated("missing credentials: send the header 'Authorization: Bearer <tenant token>'")
        tenant = tokens.tenant_of(auth[len("Bearer "):])
        if tenant is None:
            raise Unauthenticated("unknown tenant token")
        return tenant

    def _tenant(self, request: Request, body: object, token_tenant: str | None) -> str | None:
        """With tokens, the token's tenant (an X-Tenant header naming another is refused); without, the
        X-Tenant header, else None (the default tenant). Checked by the front door, as a gRPC call's.
        OpenAI's `user` (an end-user id) never picks a tenant: any caller could otherwise make tenants
        (each a matrix in memory and series in /metrics)."""
        asked = request.headers.get("x-tenant") or None
        user = body.get("user") if isinstance(body, dict) else None
        if user is not None:
            if not isinstance(user, str):
                raise BadParam("user must be a string (an end-user id; it is not used)", "user")
            log.debug("OpenAI API: the user field is ignored (the tenant comes from the API key or X-Tenant)")
        if token_tenant is not None:
            if asked is not None and asked != token_tenant:
                raise PermissionDenied(f"this token belongs to another tenant than {asked!r} (X-Tenant)")
            return token_tenant
        return asked

    def _model_card(self) -> dict:
        """OpenAI's model object, and trserve's parsers (as ModelInfo's): "" for none."""
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "trserve",
                "trserve": {"tool_call_parser": self.tools or "", "reasoning_parser": self.config.reasoning_parser or ""}}

    def _count(self, method: str, exc: BaseException | None) -> None:
        code = "OK" if exc is None else status_for(exc).name
        self.door.metrics.requests.labels(method, code).inc()

    @staticmethod
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = {"error": {"message": f"{request.method} {request.url.path}: {exc.detail}", "type": kind,
                          "param": None, "code": str(exc.status_code)}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
