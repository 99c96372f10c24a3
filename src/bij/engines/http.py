"""The http engine: an existing OpenAI-compatible server (vLLM, SGLang, KServe, a hosted API) answers the rows.

bij keeps its own guarantees (shards, claims, commits, resume, error rows, publish); the engine only
sends each row's request to `model.http.baseUrl` and reads the answer. It is a continuous engine
(submit / step, as vLLM): the worker keeps up to `maxInFlight` rows submitted, each is sent from a
thread pool as soon as the congestion window has room, and a step returns whichever answers came
back, so one slow row holds up no other (each sending thread keeps its connection alive):

- the window is cut to 0.7 of itself on a 429, a 503, a 504 or a timeout (at most once per round trip),
  and the size it was cut at is the fleet's ceiling; it then grows by a request per window's worth of
  successes before any cut, and after one as BIC (Xu, Harfoush and Rhee, 2004) does: halfway back to the
  ceiling each round trip (at least 0.1, at most 4 requests), then slowly past it and faster the longer no
  cut comes, so it spends its time near what the fleet takes rather than climbing back from half of it
  (halving and adding one a round trip kept it at about 3/4 of the ceiling). A cut below the last ceiling
  (the fleet took on other lanes) sets the ceiling lower still, leaving room for them. Between 1 and
  `maxInFlight`;
- a `Retry-After` on such an answer pauses every request of the lane until it has passed;
- 408, 429, 5xx, timeouts and lost connections are retried, anything else is the row's error row at
  once; a row is sent at most `retries + 1` times, and its error row carries the last status and body.

Before the lane's first row, `load` asks the server whether it serves `servedModel` (GET /v1/models, or one
tiny request where the server has no such list): a wrong baseUrl, model or credential fails the lane as a
bad configuration naming the URL and the status, instead of turning every row into an error row.

`HttpTransport` is all of that, whatever the task; `HttpEngine` sends embed, generate and chat rows to the
OpenAI endpoints, and `http_pooling.HttpPoolingEngine` classify, score and rerank rows to vLLM's.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import os
import queue
import random
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from bij.contract.spec_model import HTTP_AUTHORIZATION_ENV as AUTHORIZATION_ENV
from bij.contract.spec_model import HttpOptions
from bij.engines.base import (
    BASIC_SAMPLING,
    EngineBase,
    EngineConfig,
    EstimatedTokens,
    Request,
    Result,
    estimate_tokens,
    request_text,
    run_to_completion,
)
from bij.engines.echo import truncate_text

# Sampling fields sent to the server as OpenAI body fields (camelCase spec name -> body name).
SENT_FIELDS = {"topP": "top_p", "stop": "stop", "presencePenalty": "presence_penalty",
               "frequencyPenalty": "frequency_penalty"}
RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})
CONGESTION = frozenset({429, 503, 504})  # the fleet says it is full: shrink the window
BODY_CUT = 1000  # characters of a server's error body kept in the error row
MAX_RETRY_AFTER = 300.0  # seconds; a longer Retry-After is waited this long
START_WINDOW = 4
CUT = 0.7  # the window after a congestion signal, of what it was (TCP CUBIC's beta, RFC 9438)
STEP_MIN = 0.1  # requests a round trip the window grows by, at least, once it has been cut
STEP_MAX = 4.0  # and at most
BACKOFF_BASE = 0.05  # seconds before a retry without Retry-After, doubled per attempt (jittered)
BACKOFF_MAX = 5.0
STEP_WAIT = 0.5  # seconds a step waits for an answer before it hands control back to the worker


@dataclass
class _Send:
    """One submitted row: its request, its future, and whether the worker dropped it (abort)."""

    tag: int
    request: Request
    future: Future[Result]
    dropped: bool = False


@dataclass
class _Answer:
    status: int | None  # None: no answer (timeout, lost connection)
    body: bytes = b""
    retry_after: float | None = None
    timed_out: bool = False
    reason: str = ""  # why there was no answer


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A Retry-After header's wait in seconds (delta-seconds or an HTTP date), capped; None when absent or bad."""
    if not value:
        return None
    try:
        secs = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value).timestamp()
        except (TypeError, ValueError):
            return None
        secs = when - (time.time() if now is None else now)
    return min(max(secs, 0.0), MAX_RETRY_AFTER)


class Window:
    """The lane's congestion window and its shared pause, over every request the engine sends: cut to `CUT`
    of itself on congestion, grown as BIC grows it (see the module's docstring)."""

    def __init__(self, max_in_flight: int, start: int = START_WINDOW):
        self.max = max_in_flight
        self.size = float(min(start, max_in_flight))
        self.in_flight = 0
        self.peak_in_flight = 0
        self.smallest = self.size
        self.largest = self.size
        self.cuts = 0
        self.ceiling: float | None = None  # the size of the last cut: what the fleet took then
        self.sent = 0
        self.paused_seconds = 0.0  # time requests were held back by Retry-After
        self._pause_until = 0.0
        self._cut_at = 0  # a failure of a request sent before the last cut does not cut again
        self._queued = 0  # turns taken by acquire
        self._serving = 0  # the turn that may go next
        self._lock = threading.Lock()
        # Each waiting request's own condition, by turn: only the next in line is woken (waking all of up to
        # maxInFlight waiting threads on every answer cost more CPU than sending).
        self._waiting: dict[int, threading.Condition] = {}

    def acquire(self) -> int:
        """Wait for room in the window and for any Retry-After to pass, first come first served (rows go out
        in the order the worker submitted them, so chunks complete, and commit, in input order); returns the
        request's send number."""
        with self._lock:
            turn = self._queued
            self._queued += 1
            me = threading.Condition(self._lock)
            while True:
                now = time.monotonic()
                if now < self._pause_until:
                    wait = self._pause_until - now
                    self._waiting[turn] = me
                    me.wait(wait)
                    if turn == self._serving:  # count the pause once, not once per waiting request
                        self.paused_seconds += max(0.0, min(wait, time.monotonic() - now))
                    continue
                if turn == self._serving and self.in_flight < int(self.size):
                    break
                self._waiting[turn] = me
                me.wait()
            self._waiting.pop(turn, None)
            self._serving += 1
            self._wake_next()  # the next in line may fit too
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            self.sent += 1
            return self.sent

    def _wake_next(self) -> None:
        nxt = self._waiting.get(self._serving)
        if nxt is not None:
            nxt.notify()

    def release(self, ticket: int, congested: bool, retry_after: float | None) -> None:
        with self._lock:
            self.in_flight -= 1
            if congested:
                if ticket > self._cut_at:
                    self._cut()
                if retry_after:
                    self._pause_until = max(self._pause_until, time.monotonic() + retry_after)
            else:
                self.size = min(float(self.max), self.size + self._step() / self.size)
                self.largest = max(self.largest, self.size)
            self._wake_next()

    def _cut(self) -> None:
        size = self.size
        # Cut below the last ceiling: the fleet serves more than this lane now; aim lower (BIC's fast convergence).
        self.ceiling = size * (1 + CUT) / 2 if self.ceiling is not None and size < self.ceiling else size
        self.size = max(1.0, size * CUT)
        self._cut_at = self.sent
        self.cuts += 1
        self.smallest = min(self.smallest, self.size)

    def _step(self) -> float:
        """Requests the window grows by over a round trip (a window's worth of successes)."""
        if self.ceiling is None:
            return 1.0
        if self.size < self.ceiling:  # binary search toward the ceiling
            return min(STEP_MAX, max(STEP_MIN, (self.ceiling - self.size) / 2))
        return min(STEP_MAX, max(STEP_MIN, self.size - self.ceiling))  # past it: probing, faster with no cut

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"window": self.size, "smallest": self.smallest, "largest": self.largest, "cuts": self.cuts,
                    "ceiling": self.ceiling, "sent": self.sent, "peakInFlight": self.peak_in_flight,
                    "pausedSeconds": self.paused_seconds}


class ServerRefused(ValueError):
    """The server answered the preflight in a way no retry changes (401, 403, 404, a model it does not serve):
    a bad configuration (a ValueError, as the worker treats a model that cannot load)."""


class ServerUnreachable(ConnectionError):
    """The server did not answer the preflight (no connection, a timeout, 429 or 5xx through every try): worth
    retrying the lane later or elsewhere, not a bad configuration."""


PREFLIGHT_TIMEOUT = 10.0  # seconds one preflight request may take at most
PREFLIGHT_WAIT = 1.0  # seconds before the preflight's next try, doubled per try


class HttpTransport(EstimatedTokens, EngineBase):
    """What every http engine class shares: `model.http: {baseUrl, servedModel, maxInFlight, ...}`, the
    preflight, the sending threads and their kept-alive connections, the window, retries and error rows. A
    subclass says where its task's rows go (`path`), what each sends (`body`) and reads back (`_result`), and
    the one tiny row a preflight may send (`tiny_request`)."""

    name = "http"
    continuous = True  # submit / step: answers come back as they arrive, the window bounds what is in flight
    schedules_itself = True
    parallel_prepare = True  # its threads wait on sockets, which lets go of the interpreter
    honours: frozenset[str] = frozenset()
    path: str  # where the task's rows go, under baseUrl (set by the subclass)

    def __init__(self, config: EngineConfig):
        opts = config.http or HttpOptions()  # validated as the spec validates it (contract.spec_model.HttpOptions)
        self.config = config
        self.base_url = (opts.base_url or "").rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"model.http.baseUrl must be an http:// or https:// URL, not {self.base_url!r}")
        served = opts.served_model or config.name
        if not served:
            raise ValueError("model.http.servedModel (or model.name) must name the server's model")
        self.served_model = served
        self.max_in_flight = opts.max_in_flight
        self.timeout = opts.timeout_seconds
        self.retries = opts.retries
        self.window = Window(self.max_in_flight)
        # Daemon threads, not a ThreadPoolExecutor: a request hanging until its timeout must not hold up
        # the worker's exit after it dropped the row (an executor's threads are joined at exit).
        self._queue: queue.SimpleQueue[_Send | None] = queue.SimpleQueue()  # None: a thread's last
        self._threads: list[threading.Thread] = []
        self._sends: dict[int, _Send] = {}
        # Sends whose answer came back, as they come: a step takes them in O(answers), where waiting on every
        # submitted row's future (the worker keeps thousands submitted) cost more CPU than the requests.
        self._done: queue.SimpleQueue[_Send] = queue.SimpleQueue()
        self.steps = 0
        self.occupied = 0
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        url = urllib.parse.urlsplit(self.base_url)
        self._scheme, self._host, self._port = url.scheme, url.hostname or "", url.port
        self._prefix = url.path  # a server behind a path: http://gateway/fleet-a
        proxy = urllib.request.getproxies().get(url.scheme)
        self._proxy = urllib.parse.urlsplit(proxy) if proxy and not urllib.request.proxy_bypass(url.netloc) else None
        if self._proxy is not None and url.scheme == "http":
            self._prefix = f"http://{url.netloc}{url.path}"  # a plain-http proxy takes the absolute URL
        self._local = threading.local()  # each sending thread's kept-alive connection
        auth = os.environ.get(AUTHORIZATION_ENV)
        if auth:
            # A bare key is a bearer token; a value with a scheme ("Bearer x", "Basic y") is sent as it is.
            self._headers["Authorization"] = auth if " " in auth.strip() else f"Bearer {auth.strip()}"

    def load(self) -> None:
        """The preflight: the server answers, knows the credential and serves `servedModel` (see the module)."""
        self.preflight()

    def preflight(self) -> None:
        """GET /v1/models must list servedModel; a server without that list (404, 405) answers one tiny request
        instead. Raises ServerRefused (a bad configuration) or ServerUnreachable (worth a later retry)."""
        answer = self._try(lambda: self._call("GET", "/v1/models", None, min(self.timeout, PREFLIGHT_TIMEOUT)))
        if answer.status is not None and 200 <= answer.status < 300:
            served = self._listed_models(answer.body)
            if served is None or self.served_model in served:
                return
            listed = ", ".join(sorted(served)[:20]) or "none"
            raise ServerRefused(f"{self.base_url}/v1/models does not list model.http.servedModel "
                                f"{self.served_model!r}; it serves: {listed}")
        if answer.status in (404, 405, 501):  # no model list here: one tiny request shows what the rows would meet
            tiny = self.body(self.tiny_request())
            answer = self._try(lambda: self._call("POST", self.path, json.dumps(tiny).encode(), self.timeout))
            if answer.status is not None and 200 <= answer.status < 300:
                return
            self._refuse(answer, self.path)
        self._refuse(answer, "/v1/models")

    def _refuse(self, answer: _Answer, path: str) -> None:
        url = self.base_url + path
        if answer.status is None:
            raise ServerUnreachable(f"preflight: no answer from {url} after {self.retries + 1} tries: {answer.reason}")
        body = answer.body.decode("utf-8", "replace")[:BODY_CUT]
        if answer.status in RETRYABLE:
            raise ServerUnreachable(f"preflight: {url} answered {answer.status} through {self.retries + 1} tries: "
                                    f"{body}")
        hint = {401: "the credential (model.http.headersSecret, or env BIJ_HTTP_AUTHORIZATION) is missing or wrong",
                403: "the credential (model.http.headersSecret, or env BIJ_HTTP_AUTHORIZATION) may not use it",
                404: f"model.http.baseUrl or model.http.servedModel {self.served_model!r} is wrong"}.get(
                    answer.status, f"it refuses a one-token request for model {self.served_model!r}")
        raise ServerRefused(f"preflight: {url} answered {answer.status}: {hint}: {body}")

    def _try(self, call: Any) -> _Answer:
        """One preflight request, tried again (retries + 1 times in all) while it is retryable."""
        answer = _Answer(None)
        for attempt in range(self.retries + 1):
            answer = call()
            if answer.status is not None and answer.status not in RETRYABLE:
                return answer
            if attempt < self.retries:
                time.sleep(answer.retry_after if answer.retry_after is not None
                           else min(BACKOFF_MAX, PREFLIGHT_WAIT * 2 ** attempt))
        return answer

    @staticmethod
    def _listed_models(raw: bytes) -> set[str] | None:
        """The ids an OpenAI /v1/models answer lists; None when the answer is not such a list (then it proves
        only that the server answers)."""
        try:
            data = json.loads(raw)["data"]
            return {str(m["id"]) for m in data}
        except (ValueError, KeyError, TypeError):
            return None

    def stats(self) -> dict[str, Any]:
        """The congestion window's story: its size now, smallest and largest, cuts, the last ceiling, sends,
        pauses."""
        return self.window.stats()

    def concurrency(self) -> int:
        return self.max_in_flight

    def submit(self, tag: int, request: Request) -> None:
        if not self._threads:
            # Threads block in the window while it is full: maxInFlight of them cover every slot it may open.
            for i in range(self.max_in_flight):
                t = threading.Thread(target=self._serve, name=f"bij-http-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        send = _Send(tag, request, Future())
        self._sends[tag] = send
        self._queue.put(send)

    def close(self) -> None:
        """Drop every row not yet returned and end the sending threads, each closing its kept-alive
        connection once its request on the wire (if any) is over; a thread is not waited for. Again:
        nothing."""
        self.abort()
        threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        self._drop_connection()  # the preflight's, on this thread

    def _serve(self) -> None:
        while True:
            send = self._queue.get()
            if send is None:
                self._drop_connection()
                return
            if not send.future.set_running_or_notify_cancel():
                continue  # dropped before it was sent
            try:
                send.future.set_result(self._row(send))
            except BaseException as e:  # the worker sees it when it takes the row's result
                send.future.set_exception(e)
            self._done.put(send)

    def unfinished(self) -> int:
        return len(self._sends)

    def step(self) -> list[tuple[int, Result]]:
        """The rows whose answers (or final errors) came back: waits for the first, at most STEP_WAIT."""
        if not self._sends:
            return []
        came: list[_Send] = []
        try:
            came.append(self._done.get(timeout=STEP_WAIT))
            while True:
                came.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self.steps += 1
        self.occupied += self.window.in_flight
        out = []
        for send in came:
            if self._sends.get(send.tag) is send:  # not a dropped row's late answer (its tag may be reused)
                del self._sends[send.tag]
                out.append((send.tag, send.future.result()))
        return out

    def abort(self, tags: Sequence[int] | None = None) -> None:
        """Drop rows not yet returned: one not yet sent is never sent, one on the wire is not sent again."""
        for tag in list(self._sends) if tags is None else tags:
            send = self._sends.pop(tag, None)
            if send is not None:
                send.dropped = True
                send.future.cancel()

    def run(self, requests: list[Request]) -> list[Result]:
        return run_to_completion(self, requests)

    def _row(self, send: _Send) -> Result:
        req = send.request
        data = json.dumps(self.body(req)).encode()
        answer = _Answer(None)
        for attempt in range(self.retries + 1):
            if send.dropped:
                return Result(error="dropped by the worker", extra={"code": "aborted"})
            ticket = self.window.acquire()
            answer = self._send(data)
            congested = answer.timed_out or answer.status in CONGESTION
            self.window.release(ticket, congested, answer.retry_after)
            if answer.status is not None and 200 <= answer.status < 300:
                return self._result(req, answer.body)
            retryable = answer.status is None or answer.status in RETRYABLE
            if not retryable or attempt == self.retries:
                break
            if answer.retry_after is None:  # a Retry-After is waited in the window, by every request
                time.sleep(min(BACKOFF_MAX, BACKOFF_BASE * 2 ** attempt) * (0.5 + random.random()))
        sends = f" after {self.retries + 1} sends" if (answer.status is None or answer.status in RETRYABLE) else ""
        if answer.status is None:
            return Result(error=f"no answer from {self.base_url}{self.path}{sends}: {answer.reason}",
                          extra={"code": "timeout" if answer.timed_out else "server_error"})
        body = answer.body.decode("utf-8", "replace")[:BODY_CUT]
        code = ("invalid_request" if answer.status in (400, 422)
                else "server_error" if answer.status in RETRYABLE else "http_error")
        return Result(error=f"the server answered {answer.status}{sends}: {body}",
                      extra={"code": code, "status": answer.status})

    def _send(self, data: bytes) -> _Answer:
        return self._call("POST", self.path, data, self.timeout)

    def _call(self, method: str, path: str, data: bytes | None, timeout: float) -> _Answer:
        """One request on this thread's kept-alive connection (a new TCP connection per row cost more CPU than
        the rest of the row); a kept connection the server closed meanwhile is opened again once."""
        for fresh in (False, True):
            conn, reused = self._connection(timeout, fresh)
            try:
                conn.request(method, self._prefix + path, body=data, headers=self._headers)
                resp = conn.getresponse()
                body = resp.read()
            except TimeoutError as e:
                self._drop_connection()
                return _Answer(None, timed_out=True, reason=f"timed out after {timeout:g}s ({e})")
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                self._drop_connection()
                if reused:  # closed while idle (a server's keep-alive timeout): not this request's fault
                    continue
                return _Answer(None, reason=str(e) or type(e).__name__)
            except (OSError, http.client.HTTPException) as e:  # refused, unknown host, a garbled answer
                self._drop_connection()
                return _Answer(None, reason=str(e) or type(e).__name__)
            if resp.will_close:
                self._drop_connection()
            if 200 <= resp.status < 300:
                return _Answer(resp.status, body)
            return _Answer(resp.status, body, retry_after_seconds(resp.getheader("Retry-After")))
        return _Answer(None, reason="the server closed the connection")

    def _connection(self, timeout: float, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to the server (and whether it was used before), its timeout set."""
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            kind = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            if self._proxy is None:
                conn = kind(self._host, self._port, timeout=timeout)
            else:  # HTTP(S)_PROXY, as urllib honours it: http through the proxy, https tunnelled (CONNECT)
                conn = kind(self._proxy.hostname or "", self._proxy.port, timeout=timeout)
                if self._scheme == "https":
                    conn.set_tunnel(self._host, self._port)
            self._local.conn = conn
            return conn, False
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, True

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def tiny_request(self) -> Request:
        """The one small row a preflight sends to a server without a model list."""
        raise NotImplementedError

    def body(self, req: Request) -> dict[str, Any]:
        """The JSON body the server expects for this row (model = servedModel)."""
        raise NotImplementedError

    def _result(self, req: Request, raw: bytes) -> Result:
        """The row's result from the server's answer (2xx); one it cannot read is the row's error row."""
        raise NotImplementedError


class HttpEngine(HttpTransport):
    """Rows sent to an OpenAI-compatible server's /v1/chat/completions, /v1/completions or /v1/embeddings."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.honours = frozenset() if config.task == "embed" else BASIC_SAMPLING | frozenset(SENT_FIELDS)
        self.path = {"chat": "/v1/chat/completions", "generate": "/v1/completions",
                     "embed": "/v1/embeddings"}[config.task]

    def tiny_request(self) -> Request:
        return Request(text="Hi", max_tokens=1, temperature=0.0)

    def body(self, req: Request) -> dict[str, Any]:
        """The OpenAI body the server expects for this row (model = servedModel)."""
        out: dict[str, Any] = {"model": self.served_model}
        if self.config.task == "embed":
            out["input"] = self._text(req, head=True)
            return out
        if self.config.task == "chat":
            out["messages"] = req.messages if req.messages is not None else [{"role": "user", "content": req.text}]
        else:
            out["prompt"] = self._text(req, head=False)
        out["max_tokens"] = req.max_tokens
        out["temperature"] = req.temperature
        if req.seed is not None:
            out["seed"] = req.seed
        s = req.sampling
        for key in SENT_FIELDS.values():
            value = getattr(s, key)  # the body's name is the Sampling field's
            if value is not None:
                out[key] = list(value) if isinstance(value, tuple) else value
        return out

    def _text(self, req: Request, head: bool) -> str:
        text = request_text(req)
        limit = self.config.max_input_tokens
        if self.config.truncate and limit is not None and estimate_tokens(text) > limit:
            # The worker marked this row truncated by the same estimate: cut it so.
            text = truncate_text(text, limit, head=head)
        return text

    def _result(self, req: Request, raw: bytes) -> Result:
        try:
            doc = json.loads(raw)
            usage = doc.get("usage") or {}
            if self.config.task == "embed":
                emb = doc["data"][0]["embedding"]
                return Result(embedding=[float(v) for v in emb],
                              prompt_tokens=usage.get("prompt_tokens") or estimate_tokens(request_text(req)))
            choice = doc["choices"][0]
            text = choice["message"]["content"] if self.config.task == "chat" else choice["text"]
            text = text or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            return Result(error=f"the server's answer is not an OpenAI {self.path} answer ({type(e).__name__}: {e}): "
                                f"{raw.decode('utf-8', 'replace')[:BODY_CUT]}", extra={"code": "server_error"})
        extra = {"finish_reason": choice["finish_reason"]} if choice.get("finish_reason") else {}
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        return Result(output=text,
                      prompt_tokens=prompt if isinstance(prompt, int) else estimate_tokens(request_text(req)),
                      completion_tokens=completion if isinstance(completion, int) else estimate_tokens(text),
                      extra=extra)
