"""The HTTP server: OpenRLHF's remote reward protocol on aiohttp.

    POST /get_reward  {"query": [...], "prompts": [...], "labels": [...]}
                      -> {"rewards": [...], "format_rewards": [...], "acc_rewards": [...]}
                         (the boxed profile adds "scores": the accuracies)
    GET  /health      -> {"status": "ok", "scoring": profile, counters...}

Every answer is JSON. A request that breaks the protocol gets 400 with {"error": "..."} saying
what is wrong; one over a per-request limit (max_body bytes, max_items items) gets 413, whose
reply also names the setting, its limit, what the request had and the flag and variable that
raise it; anything unexpected gets a 500 with {"error": ...} and no traceback (the traceback
goes to the server's log), and the server keeps serving.

/health is answered on the event loop from counters: it never waits for a request's
preparation (the prep thread) or verification (the pool). See `scorer.Scorer.score_body` for
how requests share the prep thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from podagent.rewards import audit, func, listeners
from podagent.rewards.dataset import GoldIndex
from podagent.rewards.pool import VerifierPool
from podagent.rewards.scorer import (
    BadRequest,
    BoxedScorer,
    OpenrlhfMScorer,
    OverLimit,
    Scorer,
)
from podagent.rewards.settings import RewardSettings, describe

log = logging.getLogger("podagent.rewards")

SCORER = web.AppKey("scorer", Scorer)
MAX_BODY = web.AppKey("max_body", int)
# On SIGTERM, requests still running get this long before they are cancelled; their clients
# then retry elsewhere (or against the restarted server).
SHUTDOWN_GRACE = 3.0


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """Last line of defence: whatever happens, the client gets JSON and the server lives."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        keep = {k: v for k, v in exc.headers.items()
                if k.lower() not in ("content-type", "content-length")}
        return _error(exc.status, exc.reason.lower(), keep)
    except asyncio.CancelledError:
        raise
    except Exception:
        request.app[SCORER].stats.errors += 1
        log.exception("internal error answering %s %s", request.method, request.path)
        return _error(500, "internal error in the reward server (details in its log)")


def _over(exc: OverLimit) -> web.Response:
    return web.json_response(exc.reply(), status=413)


def _too_large(size: int | None, limit: int) -> web.Response:
    return _over(OverLimit("max_body", limit, size, "body is", "bytes"))


async def get_reward(request: web.Request) -> web.Response:
    scorer, limit = request.app[SCORER], request.app[MAX_BODY]
    if request.content_length is not None and request.content_length > limit:
        scorer.stats.bad_requests += 1
        return _too_large(request.content_length, limit)
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:  # a chunked body that grew past the limit
        body = None
    if body is None or len(body) > limit:
        scorer.stats.bad_requests += 1
        return _too_large(None if body is None else len(body), limit)
    try:
        return web.json_response(await scorer.score_body(body))
    except OverLimit as exc:
        return _over(exc)
    except BadRequest as exc:
        return _error(400, str(exc))


async def health(request: web.Request) -> web.Response:
    return web.json_response(request.app[SCORER].health())


def make_app(scorer: Scorer, max_body: int) -> web.Application:
    # client_max_size a little above max_body, so the handler (not aiohttp) answers bodies
    # just over the limit, with JSON.
    app = web.Application(client_max_size=max_body + 1, middlewares=[json_errors])
    app[SCORER], app[MAX_BODY] = scorer, max_body
    app.router.add_post("/get_reward", get_reward)
    app.router.add_get("/health", health)
    return app


@dataclass(frozen=True)
class Running:
    scorer: Scorer
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def make_scorer(settings: RewardSettings, pool: VerifierPool,
                golds: GoldIndex | None = None) -> Scorer:
    common: dict[str, Any] = {"max_items": settings.max_items,
                              "format_weight": settings.format_weight, "golds": golds,
                              "extra_logs": settings.extra_logs,
                              "batch_wait": settings.batch_wait / 1000}
    source = func.source_of(settings.scoring, settings.func)
    if source is not None:
        return func.FuncScorer(pool, source, default=settings.default_reward, **common)
    if settings.scoring == "boxed":
        return BoxedScorer(pool, **common)
    return OpenrlhfMScorer(pool, template=settings.template, strict=settings.strict, **common)


async def _audit(settings: RewardSettings, golds: GoldIndex | None, scorer: Scorer,
                 pool: VerifierPool, say: bool = True) -> None:
    """The dataset's gold answers the profile cannot read (`audit`), for /health; logged when
    `say`."""
    if golds is None:
        return
    scoring = "func" if settings.func else settings.scoring
    found = await audit.audit(golds, scoring, settings.strict, pool)
    if found is not None:
        scorer.dataset_audit = found.to_json()
        if found.line and say:
            log.warning("%s", found.line)


def load_golds(settings: RewardSettings) -> GoldIndex | None:
    """The dataset's gold table, or None without --dataset. Raises DatasetError."""
    if settings.dataset is None:
        return None
    # A prompt given twice keeps its last answer under openrlhf-m, as the seed's table does.
    repeated = "last" if settings.scoring == "openrlhf-m" else "first"
    return GoldIndex.load(settings.dataset, settings.prompt_key, settings.answer_key, repeated)


@contextlib.asynccontextmanager
async def running(settings: RewardSettings, golds: GoldIndex | None = None,
                  listener: int = 0, members: listeners.Members | None = None
                  ) -> AsyncIterator[Running]:
    """The server, listening, inside the current event loop; stopped (pool too) on exit.
    `listener`: which of `settings.listeners` processes this is (`listeners`); the first
    listens once the others (`members`) do.

    Raises OSError if the address cannot be bound."""
    pool = VerifierPool(settings.workers, settings.item_timeout,
                        preload=func.source_of(settings.scoring, settings.func),
                        item_memory=settings.item_memory)
    try:
        scorer = make_scorer(settings, pool, golds)
        # Listening only once the workers answer: a probe that gets 200 means ready.
        try:
            await pool.warm(scorer.probe)
            scorer.listener = (listener + 1, settings.listeners)
            # Each listener audits (whichever answers /health has it); the first one says it.
            await _audit(settings, golds, scorer, pool, say=listener == 0)
            if members is not None:
                await asyncio.get_running_loop().run_in_executor(None, members.wait_listening)
        except BaseException:
            scorer.close()
            raise
        runner = web.AppRunner(make_app(scorer, settings.max_body), access_log=None,
                               shutdown_timeout=SHUTDOWN_GRACE)
        await runner.setup()
        try:
            site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True,
                               reuse_port=settings.listeners > 1 or None)
            await site.start()
            sockets = site._server.sockets if site._server else ()  # type: ignore[union-attr]
            port = sockets[0].getsockname()[1] if sockets else settings.port
            yield Running(scorer, settings.host, port)
        finally:
            await runner.cleanup()
            scorer.close()
    finally:
        # Not on the loop: joining the workers blocks for up to a few seconds.
        await asyncio.get_running_loop().run_in_executor(None, pool.close)


async def _serve(settings: RewardSettings, golds: GoldIndex | None, listener: int = 0,
                 members: listeners.Members | None = None, parent: int | None = None,
                 listening: Any = None) -> int:
    """Serves until SIGTERM or SIGINT (0), or until another listener exits (1); a listener
    other than the first (`parent` set) also stops when the first is gone."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    failed = None
    async with running(settings, golds, listener, members) as server:
        if listening is not None:  # the first listener waits for this before it listens
            listening.send(True)
        log.info("listening on %s: scoring %s; %d workers%s, item timeout %g s, format weight "
                 "%g%s", server.url,
                 describe(settings.scoring, settings.template, settings.strict, settings.func),
                 settings.workers,
                 f" (listener {listener + 1} of {settings.listeners})"
                 if settings.listeners > 1 else "",
                 settings.item_timeout, settings.format_weight,
                 f", {len(golds)} dataset prompts" if golds is not None else "")
        waits = [asyncio.ensure_future(stop.wait())]
        if members is not None:
            waits.append(asyncio.ensure_future(listeners.watch_members(members.processes,
                                                                       stop)))
        if parent is not None:
            waits.append(asyncio.ensure_future(listeners.orphaned(parent)))
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        failed = next((w.result() for w in done if isinstance(w.result(), str)), None)
        if failed:
            log.error("stopping: %s", failed)
        log.info("stopping: %s", _summary(server.scorer))
    log.info("stopped")
    return 1 if failed else 0


def serve_listener(settings: RewardSettings, listener: int, parent: int,
                   listening: Any) -> None:
    """A listener other than the first, in its own process (`listeners`)."""
    configure_logging()
    run_loop(_serve(settings, load_golds(settings), listener, parent=parent,
                    listening=listening))


def _summary(scorer: Scorer) -> str:
    s = scorer.stats
    return (f"{s.requests} requests, {s.items} items, {s.fast_path} fast path, "
            f"{s.cache_hits} cache hits, {s.verified} verified, {s.timeouts} timeouts")


def configure_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s [reward-server] %(levelname)s %(message)s")


def serve(settings: RewardSettings, golds: GoldIndex | None = None) -> int:
    """Runs until SIGTERM or SIGINT, then stops the pool; returns the exit code (0; 1 when
    one of several listeners died). Raises OSError when the address cannot be bound."""
    configure_logging()
    members = None
    if settings.listeners > 1:
        settings, members = listeners.start_members(settings, serve_listener)
    try:
        return run_loop(_serve(settings, golds, members=members))
    finally:
        if members is not None:
            listeners.stop_members(members.processes)


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """`main` on uvloop where it is installed (the reward extra brings it; vLLM images have
    it): it takes about a fifth less of the event loop's CPU per request, and with a sample per
    request (upstream OpenRLHF) that loop is what caps the server. asyncio's loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    if sys.version_info < (3, 11):  # no asyncio.Runner: the policy (this process is the server)
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
