"""Benchmark: a class on one server (issue 42) -- N students on the Prune page pressing the sparsity
slider, each student a protocol-level client (bench/_stclient.py: Streamlit's websocket protocol,
what a student's browser costs the server and nothing more), calibrated against one real Chromium.

`bench/bench_browser.py --class` runs N Chromium sessions on the server's own 2 cores: there the
browsers eat the CPU (its 12-session p50 is the browsers' figure, not the server's). In a class each
student's browser runs on the student's laptop; the server only answers the websocket. So here:

1. Calibration (one real Chromium beside one protocol client, one server): interleaved pairs
   (bench/_timing.compare, self-timed), one key press each, the same moves. The Chromium page is loaded
   through a relay (bench/_wstap.py) that notes when each websocket frame passes: its press is timed
   from its rerun frame reaching the relay to that run's script_finished frame reaching it -- the
   server's part of a browser's key press -- and the client's from its send to the same message's
   arrival. Per side: min / median / max and the per-pair ratio, the server's CPU per press (/proc,
   the press and 0.3 s after it), messages, kB and HTTP requests per press, the side's own CPU per
   press (this process for the client; Chromium's processes and Playwright's driver for the browser),
   and whether the client sent the same widget states as the browser. Beside them, the browser's own parts: when Chromium's network stack
   logged the script_finished frame (DevTools) and the whole key press -> redrawn grid (its page's
   drawing included). The browser is then closed.
2. Class rounds, N = 1, 4, 12 (--sessions), one after another in the same run: N clients open the
   Prune page (SmolLM2, MP-G, z = 2, sparsity 0.3, policy global), then all start at once and each
   presses the sparsity slider (--slider z: the z slider) --presses times (5 steps right, 5 left, ...) at a person's pace: a press,
   its redraw, then --think seconds. Per N: p50 / p95 seconds from a press to the delta that redraws
   the mask and to the run's script_finished (the key press's figure: a browser shows the page as
   settled only then), the server's CPU seconds per press (its user + system time over the pressing
   phase, from /proc, over the presses), the clients' own CPU per press (this process), and the load
   average (1, 5, 15 min) before and after.

All sessions start pressing together and stay nearly in step, so a press often waits for the other
students' runs: a class's presses come less bunched, so this is the harder case.

    .venv/bin/python -m bench.bench_class [--sessions 1,4,12] [--presses 20] [--think 0.5] [--slider sparsity|z]
                                          [--pairs 10] [--max-pairs 21] [--no-browser]
    (self-contained: starts `streamlit run app.py` on a free local port and stops it; 2-4 minutes)
--no-browser skips the calibration (no Chromium on the machine). Target: p50 key press <= 1 s for 12
sessions on 2 cores (issue 42).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench._stclient import Session  # noqa: E402
from bench._timing import compare, load_average, load_text  # noqa: E402
from bench.bench_browser import (DONE_JS, GRID_TITLE, N_HEADS, PRUNE_URL, browser_cpu_seconds, percentile,  # noqa: E402
                                 server_cpu_seconds)
from tests.e2e.serving import CHROMIUM, served_app  # noqa: E402

TARGET_S = 1.0
SLIDER_KEY = "hs.w.prune.sparsity"
START = 0.3
STEP = 0.01
# the class rounds' slider (--slider): widget key, start value (the URL's), one key press's step
SLIDERS = {"sparsity": (SLIDER_KEY, START, STEP), "z": ("hs.w.prune.z", 2.0, 0.05)}
GRID_OPEN = 'class="hsm-t">'         # in every mask grid the page draws
SETTLE_S = 0.3                       # after a calibration press: the server's last sends and their CPU
PATH, QUERY = PRUNE_URL.split("?")


def heads_pruned(sparsity: float) -> str:
    """The mask grid's title at `sparsity` (floor(s * L * H) heads), as the text between its tags."""
    return f"{math.floor(sparsity * N_HEADS + 1e-9)} of {N_HEADS} heads pruned"


def grid_mark(sparsity: float) -> str:
    """The HTML that only the grid drawn at `sparsity` holds (its title element)."""
    return f"{GRID_OPEN}{heads_pruned(sparsity)}<"


def user_key(widget_id: str) -> str:
    """'hs.w.prune.sparsity' of the widget id '$$ID-<hash>-hs.w.prune.sparsity'."""
    return widget_id.split("-", 2)[-1]


def request_fields(back_msg) -> dict:
    """What a rerun request tells the server, by field, for comparing two senders' (the context's URL,
    whose port differs, and the order of the widgets left out): {name: value}, one per widget state."""
    state = back_msg.rerun_script
    fields = {name: getattr(state, name) for name in ("query_string", "page_name", "page_script_hash", "fragment_id")}
    fields["cached message hashes"] = len(state.cached_message_hashes)
    for w in state.widget_states.widgets:
        kind = w.WhichOneof("value")
        value = getattr(w, kind)
        fields[user_key(w.id)] = (kind, list(value.data) if kind.endswith("array_value") else value)
    return fields


def move(i: int, value: float, step: float = STEP) -> float:
    """The slider's value after press i from `value`: 5 steps right, 5 left, and so on."""
    return round(value + (step if (i // 5) % 2 == 0 else -step), 4)


class Loop:
    """An asyncio loop on a thread of its own: the protocol clients run there while the main thread
    drives Chromium through Playwright's sync API (which cannot run inside a running asyncio loop)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 900.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# -- 1. calibration: one client beside one Chromium ------------------------------------------------

class ClientPresses:
    """The protocol client's side of the calibration: one key press per call, timed from its rerun's
    send to its script_finished; the server's CPU and the traffic of each press kept beside."""

    def __init__(self, loop: Loop, base):
        self.loop, self.base = loop, base
        self.session = Session(base, PATH, QUERY)
        loop.call(self.session.open(watch=(grid_mark(START),)))
        self.value, self.presses = START, 0
        self.cpu, self.own, self.traffic = [], [], []

    def press(self) -> float:
        self.value = move(self.presses, self.value)
        self.presses += 1
        cpu0, own0 = server_cpu_seconds(self.base.pid), time.process_time()
        run = self.loop.call(self.session.set_widget(SLIDER_KEY, self.value, watch=(grid_mark(self.value),)))
        time.sleep(SETTLE_S)
        self.cpu.append(server_cpu_seconds(self.base.pid) - cpu0)
        self.own.append(time.process_time() - own0)
        self.traffic.append((run.msgs, run.bytes, run.fetches))
        return run.seconds()


class BrowserPresses:
    """Chromium's side: a key press on the focused sparsity slider, the page loaded through a relay
    (bench/_wstap.py) that notes when each websocket frame passed it. `press` returns the server's part
    of the key press: from the rerun frame the frontend sent reaching the relay to the server's
    script_finished frame of that run reaching it. Kept beside, per press: when Chromium's network stack
    logged that script_finished (`network`: DevTools' Network.webSocketFrameReceived) and the whole key
    press to the grid redrawn with the script ended (`redrawn`, as bench_browser times it)."""

    def __init__(self, browser, base, loop: Loop):
        from bench._wstap import Tap
        self.base, self.loop = base, loop
        self.tap = Tap(int(base.rsplit(":", 1)[1]))
        relay = f"http://127.0.0.1:{loop.call(self.tap.start())}"
        self.page = browser.new_page(viewport={"width": 1280, "height": 800})
        self.logged: list[tuple[float, str]] = []       # (DevTools timestamp s, direction) of stream frames
        cdp = self.page.context.new_cdp_session(self.page)
        cdp.on("Network.webSocketFrameReceived", lambda e: self._logged(e, "down"))
        cdp.on("Network.webSocketFrameSent", lambda e: self._logged(e, "up"))
        cdp.send("Network.enable")
        self.page.goto(relay + PRUNE_URL)
        self.page.locator(GRID_TITLE, has_text=heads_pruned(START)).first.wait_for(timeout=600_000)
        self.page.wait_for_timeout(2000)
        self.slider = self.page.get_by_test_id("stSlider").filter(has_text="Sparsity").first.get_by_role("slider")
        self.value, self.presses, self.last_rerun = START, 0, None
        self.cpu, self.own, self.traffic, self.network, self.redrawn = [], [], [], [], []

    def _logged(self, event, side: str) -> None:
        frame = event["response"]
        if frame["opcode"] == 2:
            self.logged.append((event["timestamp"], side, base64.b64decode(frame["payloadData"])))

    def _wait_for(self, frames: list, first: int, side: str, kind: str) -> int:
        """Index of the first `side` frame of ForwardMsg/BackMsg type `kind` from `first` (waits up to 60 s)."""
        from streamlit.proto.BackMsg_pb2 import BackMsg
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
        parse = ForwardMsg.FromString if side == "down" else BackMsg.FromString
        for _ in range(6000):
            for i in range(first, len(frames)):
                if frames[i][1] == side and parse(frames[i][2]).WhichOneof("type") == kind:
                    return i
            self.page.wait_for_timeout(10)                # DevTools events reach Playwright in its calls
        raise TimeoutError(f"no {kind} frame in 60 s")

    def press(self) -> float:
        before, self.value = self.value, move(self.presses, self.value)
        self.presses += 1
        self.slider.focus()
        first, first_logged, first_request = len(self.tap.frames), len(self.logged), len(self.tap.requests)
        cpu0, own0 = server_cpu_seconds(self.base.pid), browser_cpu_seconds(self.base.pid)
        t0 = self.page.evaluate("() => performance.now()")
        self.page.keyboard.press("ArrowRight" if self.value > before else "ArrowLeft")
        self.page.wait_for_function(DONE_JS, arg=[GRID_TITLE, heads_pruned(self.value)], polling="raf",
                                    timeout=120_000)
        self.redrawn.append((self.page.evaluate("() => performance.now()") - t0) / 1e3)
        sent = self._wait_for(self.tap.frames, first, "up", "rerun_script")
        done = self._wait_for(self.tap.frames, sent, "down", "script_finished")
        logged_sent = self._wait_for(self.logged, first_logged, "up", "rerun_script")
        logged_done = self._wait_for(self.logged, logged_sent, "down", "script_finished")
        self.page.wait_for_timeout(SETTLE_S * 1e3)
        self.cpu.append(server_cpu_seconds(self.base.pid) - cpu0)
        self.own.append(browser_cpu_seconds(self.base.pid) - own0)
        down = [len(payload) for _, side, payload in self.tap.frames[sent:done + 1] if side == "down"]
        self.traffic.append((len(down), sum(down), len(self.tap.requests) - first_request))
        self.network.append(self.logged[logged_done][0] - self.logged[logged_sent][0])
        from streamlit.proto.BackMsg_pb2 import BackMsg
        self.last_rerun = BackMsg.FromString(self.tap.frames[sent][2])
        return self.tap.frames[done][0] - self.tap.frames[sent][0]

    def close(self) -> None:
        self.loop.call(self.tap.stop())


def calibration(loop: Loop, base, pairs: int, max_pairs: int) -> dict:
    from playwright.sync_api import sync_playwright

    from tests.e2e.serving import CHROMIUM_ARGS
    client = ClientPresses(loop, base)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
            try:
                chromium = BrowserPresses(browser, base, loop)
                try:
                    cmp = compare({"protocol client": client.press, "Chromium": chromium.press}, min_pairs=pairs,
                                  max_pairs=max(pairs, max_pairs), max_seconds=240.0, self_timed=True)
                finally:
                    chromium.close()
            finally:
                browser.close()
    finally:
        loop.call(client.session.close())
    if client.session.http.failed:
        raise RuntimeError(f"the client's HTTP requests failed: {client.session.http.failed[:3]}")
    return dict(cmp=cmp, client=client, chromium=chromium,
                requests=(request_fields(client.session.last_request), request_fields(chromium.last_rerun)))


def print_calibration(cal: dict) -> None:
    cmp, client, chromium = cal["cmp"], cal["client"], cal["chromium"]
    cmp.report("Calibration, one session: key press -> script_finished, protocol client (its own clock) vs "
               "Chromium (the server's part: its rerun frame -> the script_finished frame, at the relay)",
               caches="warm (the page and its model loaded, one untimed press of each side first)")
    for name, side in (("protocol client", client), ("Chromium", chromium)):
        cpu = side.cpu[1:]                                         # [0]: the untimed warm-up press
        msgs, kb, fetches = (statistics.median(t[i] for t in side.traffic[1:]) for i in range(3))
        own = side.own[1:]
        print(f"    {name:>20}: server CPU {sum(cpu) / len(cpu) * 1e3:.1f} ms per press (press + {SETTLE_S:g} s); "
              f"per press (median): {msgs:.0f} messages, {kb / 1e3:.1f} kB, {fetches:.0f} HTTP requests; "
              f"its own CPU {sum(own) / len(own) * 1e3:.1f} ms per press")
    for what, values in (("its network stack logs script_finished", chromium.network[1:]),
                         ("whole key press -> redrawn grid", chromium.redrawn[1:])):
        print(f"    {'Chromium':>20}: {what}: min {min(values) * 1e3:.4g} / median {statistics.median(values) * 1e3:.4g}"
              f" / max {max(values) * 1e3:.4g} ms")
    ours, theirs = cal["requests"]
    differ = {k: (ours.get(k), theirs.get(k)) for k in {*ours, *theirs} if ours.get(k) != theirs.get(k)}
    n = sum(isinstance(v, tuple) for v in ours.values())               # the widget states
    print(f"    the last rerun request of each: "
          + (f"the same ({n} widget states, query string, page hash, fragment id, cached hashes)" if not differ
             else f"DIFFER (client, Chromium): {differ}"))


# -- 2. class rounds: N clients at a person's pace -------------------------------------------------

async def _student(session: Session, slider: str, go: asyncio.Event, presses: int, think_s: float,
                   runs: list) -> None:
    """One student: `presses` key presses on `slider`, each waited for (its mask delta: the grid with
    the new count for the sparsity, any redrawn grid for z), then `think_s` seconds."""
    key, value, step = SLIDERS[slider]
    await go.wait()
    for i in range(presses):
        value = move(i, value, step)
        mark = grid_mark(value) if slider == "sparsity" else GRID_OPEN
        run = await session.set_widget(key, value, watch=(mark,))
        runs.append((run.seconds(mark), run.seconds()))
        await asyncio.sleep(think_s)


async def class_round(base, n: int, presses: int, think_s: float, slider: str = "sparsity") -> dict:
    sessions = [Session(base, PATH, QUERY) for _ in range(n)]
    try:
        for s in sessions:
            await s.open(watch=(grid_mark(START),))
        await asyncio.sleep(2.0)
        go, runs = asyncio.Event(), []
        tasks = [asyncio.create_task(_student(s, slider, go, presses, think_s, runs)) for s in sessions]
        load0, cpu0, own0, t0 = load_average(), server_cpu_seconds(base.pid), time.process_time(), time.perf_counter()
        go.set()
        await asyncio.gather(*tasks)
        cpu, own, wall = (server_cpu_seconds(base.pid) - cpu0, time.process_time() - own0, time.perf_counter() - t0)
    finally:
        for s in sessions:
            await s.close()
    failed = [f for s in sessions for f in s.http.failed]
    if failed:
        raise RuntimeError(f"{len(failed)} of the clients' HTTP requests failed, e.g. {failed[:3]}")
    mask, done = [m for m, _ in runs], [d for _, d in runs]
    return dict(sessions=n, presses=len(runs), mask_p50=statistics.median(mask), mask_p95=percentile(mask, 0.95),
                p50=statistics.median(done), p95=percentile(done, 0.95), cpu=cpu / len(runs), own=own / len(runs),
                busy=cpu / wall, wall=wall, load=(load0, load_average()))


def print_rounds(rows: list[dict], presses: int, think_s: float, slider: str) -> None:
    print(f"Class rounds: Prune page, SmolLM2, MP-G; every session a protocol client pressing the {slider} slider "
          f"{presses} times, {think_s:g} s after each redraw, all starting together; {os.cpu_count()} CPUs "
          f"(shared: other work may run, see the load)")
    print(f"  {'sessions':>8} {'presses':>7} | {'-> mask delta p50 / p95 s':>25} | {'-> script_finished p50 / p95 s':>30} | "
          f"{'server CPU ms/press':>19} {'server busy':>11} | {'clients CPU ms/press':>20} | load before ; after")
    for r in rows:
        print(f"  {r['sessions']:8d} {r['presses']:7d} | {r['mask_p50']:12.3f} / {r['mask_p95']:.3f}     | "
              f"{r['p50']:15.3f} / {r['p95']:.3f}       | {r['cpu'] * 1e3:19.1f} {r['busy']:10.0%} | "
              f"{r['own'] * 1e3:20.1f} | {load_text(r['load'][0])} ; {load_text(r['load'][1])}")
    print("  server busy: the server's CPU seconds over the phase's wall time (100% = one core). "
          "clients: this process, every protocol client together.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="1,4,12", help="the session counts, one round each, in one run")
    parser.add_argument("--presses", type=int, default=20, help="key presses per session and round")
    parser.add_argument("--think", type=float, default=0.5, help="seconds between a redraw and the next press")
    parser.add_argument("--slider", choices=sorted(SLIDERS), default="sparsity",
                        help="the slider the class rounds press (the calibration presses the sparsity slider)")
    parser.add_argument("--pairs", type=int, default=10, help="calibration: least number of interleaved pairs")
    parser.add_argument("--max-pairs", type=int, default=21, help="calibration: most interleaved pairs")
    parser.add_argument("--no-browser", action="store_true", help="skip the Chromium calibration")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sessions.split(",")]
    log = Path(tempfile.mkdtemp()) / "server.log"
    loop = Loop()
    started = load_average()
    try:
        with served_app(log) as base:
            warm = Session(base, PATH, QUERY)             # the model loaded and profiled once, untimed
            loop.call(warm.open(watch=(grid_mark(START),)))
            loop.call(warm.close())
            cal = None
            if not args.no_browser and CHROMIUM.exists():
                cal = calibration(loop, base, args.pairs, args.max_pairs)
            rows = [loop.call(class_round(base, n, args.presses, args.think, args.slider)) for n in sizes]
    finally:
        loop.stop()
    print(f"bench_class: one `streamlit run app.py` of its own (a free local port); load average {load_text(started)} "
          f"at the start")
    if cal is not None:
        print_calibration(cal)
    else:
        print("Calibration skipped (--no-browser, or no Chromium at " + str(CHROMIUM) + ")")
    print_rounds(rows, args.presses, args.think, args.slider)
    biggest = rows[-1]
    ok = biggest["p50"] <= TARGET_S
    print(f"{biggest['sessions']} sessions: p50 key press -> script_finished {biggest['p50']:.3f} s, p95 "
          f"{biggest['p95']:.3f} s, server CPU {biggest['cpu'] * 1e3:.1f} ms per press; target p50 <= {TARGET_S:g} s "
          f"on 2 cores: {'OK' if ok else 'MISSED'} (load average {load_text(load_average())} at the end)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
