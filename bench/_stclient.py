"""A Streamlit client without a browser: it speaks the app's websocket protocol (/_stcore/stream, the
BackMsg / ForwardMsg protobufs of streamlit.proto) the way the browser's frontend does, so a benchmark
can load the server with many sessions that cost the server what a student's browser costs it and
the benchmark's machine almost nothing (bench/bench_class.py).

What it copies from the frontend (checked against the frames Chromium sends, bench_class's calibration):
- the first rerun names the page (page_name, the URL's query string, the browser's context_info);
- a widget's value is kept once the server sets it (`set_value` on the widget's element: the page's
  widget_key values) or the user changes it, and every kept value goes with each rerun, as the
  frontend's widget state manager sends them;
- a key press on a slider inside a fragment reruns that fragment (ClientState.fragment_id, from the
  widget's delta) with the shown page's script hash (st.navigation's message; new_session's names the
  main script) and the query string the server last sent;
- cacheable messages (large elements) are remembered by hash and reported back
  (cached_message_hashes), so the server sends a reference for an unchanged one, as to a browser;
- permessage-deflate is offered, as every browser does (Streamlit's server declines it);
- the HTTP requests Chromium makes for a run (seen at bench_class's relay): the page icon's file on
  every run (the frontend sets the icon anew), and a download button's file whenever its URL changed
  (a new mask gives a new CSV), sent once the run's messages are in (the page fetches as it draws);
  one keep-alive connection, as a browser reuses one.

Times are taken when a frame arrives (time.perf_counter, before parsing).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

# element type -> (WidgetState field, the value the frontend keeps), from the element's proto
WIDGET_STATES = {
    "slider": lambda e: ("double_array_value", list(e.value)),
    "selectbox": lambda e: ("string_value", e.raw_value),
    "radio": lambda e: ("string_value", e.raw_value),
    "checkbox": lambda e: ("bool_value", bool(e.value)),
    "text_input": lambda e: ("string_value", e.value),
    "text_area": lambda e: ("string_value", e.value),
    "number_input": lambda e: (("double_value", float(e.value)) if e.data_type == FLOAT_INPUT
                               else ("int_value", int(e.value))),
}
FLOAT_INPUT = 1                                          # NumberInput.DataType.FLOAT
# cacheable messages are forgotten after this many script runs without being used (Streamlit's
# global.maxCachedMessageAge default, which the frontend's cache follows)
CACHE_AGE = 2
# what Chromium's fetch of a media file says about itself that changes the server's work (it compresses
# for a client that accepts it: starlette's gzip middleware)
HEADERS = "Accept: */*\r\nAccept-Encoding: gzip, deflate, br, zstd\r\nAccept-Language: en-US,en;q=0.9\r\n"
CONTEXT = dict(timezone="UTC", timezone_offset=0, locale="en-US", is_embedded=False, color_scheme="light")


@dataclass
class Run:
    """One script run as the client saw it: when it was asked for and when its messages arrived."""
    sent: float
    msgs: int = 0
    bytes: int = 0
    deltas: int = 0
    refs: int = 0                                  # ref_hash messages (elements the client had cached)
    fetches: int = 0                               # HTTP requests the run's messages led to
    marks: dict = field(default_factory=dict)      # text -> arrival of the first delta that shows it
    finished: float | None = None
    status: str = ""

    def seconds(self, text: str | None = None) -> float:
        """Seconds from the request to the delta showing `text` (None: to the script_finished message)."""
        return (self.finished if text is None else self.marks[text]) - self.sent


class ProtocolError(RuntimeError):
    """The server answered in a way this client does not follow (a run that failed, a missing widget)."""


class Http:
    """GET requests over one keep-alive HTTP/1.1 connection, one at a time (the page's media files)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.lock = asyncio.Lock()
        self.done = 0
        self.failed: list[tuple[str, int]] = []          # (path, status) of answers other than 200
        self._conn = None

    async def get(self, path: str) -> int:
        """Status code of GET `path`; the body is read and dropped."""
        async with self.lock:
            for attempt in (0, 1):                       # a connection the server closed: once more, anew
                if self._conn is None:
                    self._conn = await asyncio.open_connection(self.host, self.port)
                reader, writer = self._conn
                try:
                    writer.write(f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{HEADERS}\r\n".encode())
                    status, close = await self._response(reader)
                    break
                except (ConnectionError, asyncio.IncompleteReadError):
                    self._conn = None
                    if attempt:
                        raise
            if close:
                writer.close()
                self._conn = None
            self.done += 1
            if status != 200:
                self.failed.append((path, status))
            return status

    @staticmethod
    async def _response(reader) -> tuple[int, bool]:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                await reader.readexactly(size + 2)
            await reader.readuntil(b"\r\n")
        else:
            await reader.readexactly(int(headers.get("content-length", 0)))
        return int(head[0].split()[1]), headers.get("connection", "").lower() == "close"

    def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None


class Session:
    """One browser tab's worth of Streamlit session, over one websocket.

    `await open()` loads the page (its first full run); `await set_widget(key, value, watch=[...])`
    sends the rerun a key press sends and returns its `Run` once script_finished arrived."""

    def __init__(self, base_url: str, path: str, query: str = ""):
        parts = urlsplit(base_url)
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.ws_url = f"ws://{parts.netloc}/_stcore/stream"
        self.http = Http(parts.hostname, parts.port)
        self.icon = ""                                     # the page icon's URL path (a file the server serves)
        self.downloads: dict[str, str] = {}                # download button id -> the URL of its file
        self._fetching: set = set()                        # GETs under way
        self._later: list[str] = []                        # GETs asked for by the run under way
        self.page_name = path.strip("/")
        self.url = f"{self.origin}/{self.page_name}"
        self.query = query
        self.page_hash = ""
        self.widgets: dict[str, tuple[str, object]] = {}   # widget id -> (WidgetState field, value)
        self.fragment_of: dict[str, str] = {}              # widget id -> its fragment's id
        self.field_of: dict[str, str] = {}                 # every widget id drawn -> its WidgetState field
        self.cache: dict[str, tuple[object, int]] = {}     # hash -> (ForwardMsg, last run it was used)
        self.runs_done = 0
        self.unknown_widgets: set[str] = set()             # element types with a value this client does not keep
        self._ws = None
        self._reader = None
        self._run: Run | None = None
        self._done = asyncio.Event()
        self._watch: tuple[str, ...] = ()
        self._error: BaseException | None = None             # why the reader stopped, if it did
        self.last_request = None                             # the last BackMsg sent

    # -- connection ---------------------------------------------------------------------------------
    async def open(self, watch: tuple[str, ...] = (), timeout: float = 600.0) -> Run:
        """Connect and run the page once (as a browser opening the URL does); returns that run."""
        from websockets.asyncio.client import connect
        self._ws = await connect(self.ws_url, subprotocols=["streamlit"], origin=self.origin,
                                 max_size=None, open_timeout=60)
        self._reader = asyncio.create_task(self._read())
        return await self._rerun(dict(page_name=self.page_name), watch, timeout, fragment=False)

    async def close(self) -> None:
        if self._fetching:
            await asyncio.gather(*self._fetching, return_exceptions=True)
        self.http.close()
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):      # noqa: BLE001 - closing either way
                pass

    # -- what a user does ---------------------------------------------------------------------------
    def widget_id(self, key: str) -> str:
        """The id of the widget whose user key ends the id ('hs.w.prune.sparsity'), as the server sent it."""
        found = [wid for wid in self.field_of if wid.endswith("-" + key)]
        if len(found) != 1:
            raise ProtocolError(f"the page has {len(found)} widgets with key {key!r}")
        return found[0]

    async def set_widget(self, key: str, value, watch: tuple[str, ...] = (), timeout: float = 300.0) -> Run:
        """The rerun a browser sends when the user moves widget `key` to `value` (a key press on a
        slider: its new [value]); returns the run, with the arrival of the first delta showing each
        text in `watch` and of its script_finished message."""
        wid = self.widget_id(key)
        kind = self.field_of[wid]
        if not kind:
            raise ProtocolError(f"this client does not set widget {key!r} (an element it keeps no value of)")
        self.widgets[wid] = (kind, [float(value)] if kind == "double_array_value" else value)
        fragment = self.fragment_of.get(wid, "")
        return await self._rerun(dict(page_script_hash=self.page_hash, fragment_id=fragment), watch, timeout,
                                 fragment=bool(fragment))

    # -- the protocol -------------------------------------------------------------------------------
    def _back_msg(self, extra: dict) -> bytes:
        from streamlit.proto.BackMsg_pb2 import BackMsg
        msg = BackMsg()
        state = msg.rerun_script
        state.query_string = self.query
        state.widget_states.SetInParent()
        for wid, (kind, value) in self.widgets.items():
            w = state.widget_states.widgets.add()
            w.id = wid
            if kind == "double_array_value":
                w.double_array_value.data.extend(value)
            else:
                setattr(w, kind, value)
        for name, value in extra.items():
            if value:
                setattr(state, name, value)
        state.cached_message_hashes.extend(self.cache)
        for name, value in CONTEXT.items():
            setattr(state.context_info, name, value)
        state.context_info.url = self.url
        self.last_request = msg
        return msg.SerializeToString()

    async def _rerun(self, extra: dict, watch, timeout: float, *, fragment: bool) -> Run:
        if self._run is not None and self._run.finished is None:
            raise ProtocolError("a rerun was asked for while the last one runs (one key press at a time)")
        if self._error is not None:
            raise ProtocolError(f"the connection's reader stopped: {self._error!r}") from self._error
        payload = self._back_msg(extra)
        self._watch = tuple(watch)
        self._done.clear()
        self._run = run = Run(sent=time.perf_counter())
        await self._ws.send(payload)
        try:
            await asyncio.wait_for(self._done.wait(), timeout)
        except asyncio.TimeoutError:
            raise ProtocolError(f"no script_finished within {timeout:g} s") from None
        if self._error is not None:
            raise ProtocolError(f"the connection's reader stopped: {self._error!r}") from self._error
        wanted = "FINISHED_FRAGMENT_RUN_SUCCESSFULLY" if fragment else "FINISHED_SUCCESSFULLY"
        if run.status != wanted:
            raise ProtocolError(f"the run ended with {run.status}, not {wanted}")
        missing = [t for t in self._watch if t not in run.marks]
        if missing:
            raise ProtocolError(f"the run showed no element with {missing}")
        return run

    async def _read(self) -> None:
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
        try:
            async for raw in self._ws:
                arrived = time.perf_counter()
                self._take(ForwardMsg.FromString(raw), arrived, len(raw))
            self._error = ProtocolError("the server closed the connection")
        except Exception as err:  # noqa: BLE001 - handed to the waiting rerun
            self._error = err
        self._done.set()

    def _take(self, msg, arrived: float, size: int) -> None:
        run = self._run
        kind = msg.WhichOneof("type")
        if run is not None and run.finished is None:
            run.msgs += 1
            run.bytes += size
        if kind == "ref_hash":
            if run is not None:
                run.refs += 1
            cached = self.cache.get(msg.ref_hash)
            if cached is None:
                raise ProtocolError(f"the server referred to a message this client never had ({msg.ref_hash})")
            self.cache[msg.ref_hash] = (cached[0], self.runs_done)
            msg = cached[0]
            kind = "delta"
        elif msg.metadata.cacheable:
            self.cache[msg.hash] = (msg, self.runs_done)
        if kind == "new_session":
            self.page_hash = msg.new_session.page_script_hash
            if self.icon:
                self._fetch(self.icon)
        elif kind == "navigation":                      # st.navigation: the page shown (new_session names app.py)
            self.page_hash = msg.navigation.page_script_hash or self.page_hash
        elif kind == "page_config_changed":
            icon = msg.page_config_changed.favicon
            if icon.startswith("/") and icon != self.icon:
                self.icon = icon
                self._fetch(icon)
        elif kind == "page_info_changed":
            self.query = msg.page_info_changed.query_string
        elif kind == "delta":
            self._delta(msg.delta, arrived)
        elif kind == "script_finished":
            self._finished(msg, arrived)

    def _delta(self, delta, arrived: float) -> None:
        run = self._run
        if run is not None and run.finished is None:
            run.deltas += 1
        if delta.WhichOneof("type") != "new_element":
            return
        element = delta.new_element
        etype = element.WhichOneof("type")
        body = getattr(element, etype)
        if etype == "html" and run is not None:
            for text in self._watch:
                if text not in run.marks and text in body.body:
                    run.marks[text] = arrived
        wid = getattr(body, "id", "") if etype not in ("html", "markdown") else ""
        if not wid:
            return
        if etype == "download_button" and body.url and self.downloads.get(wid) != body.url:
            self.downloads[wid] = body.url
            self._fetch(body.url)
        if delta.fragment_id:
            self.fragment_of[wid] = delta.fragment_id
        if etype not in WIDGET_STATES:                    # buttons and the like: no value kept
            self.field_of.setdefault(wid, "")
            if getattr(body, "set_value", False):
                self.unknown_widgets.add(etype)
            return
        state_field, value = WIDGET_STATES[etype](body)
        self.field_of[wid] = state_field
        if body.set_value:
            self.widgets[wid] = (state_field, value)

    def _fetch(self, path: str) -> None:
        """GET `path` once the run has ended: Chromium's page fetches a file as it draws the element,
        after the run's messages came in (seen at bench_class's relay); nothing waits for it."""
        if self._run is not None and self._run.finished is None:
            self._run.fetches += 1
            self._later.append(path)
            return
        task = asyncio.get_running_loop().create_task(self.http.get(path))
        self._fetching.add(task)
        task.add_done_callback(self._fetching.discard)

    def _finished(self, msg, arrived: float) -> None:
        status = type(msg).ScriptFinishedStatus.Name(msg.script_finished)
        if status == "FINISHED_EARLY_FOR_RERUN":               # st.rerun(): the run that follows is the one
            return
        self.runs_done += 1
        self.cache = {h: (m, used) for h, (m, used) in self.cache.items() if self.runs_done - used <= CACHE_AGE}
        run = self._run
        if run is not None and run.finished is None:
            run.finished, run.status = arrived, status
            self._done.set()
        later, self._later = self._later, []
        for path in later:
            self._fetch(path)
