"""bench/_stclient.py, the protocol-level client of bench/bench_class.py, against a real `streamlit run
app.py` (no browser): it opens the Prune page of a tiny model, moves the sparsity slider with one
rerun of the slider's fragment (as a browser's key press does) and sees the redrawn mask delta, then the
fragment run's script_finished; the widget states it sends are the page's, and it fetches the files a
browser fetches for the run (the page icon, the changed downloads); the relay (bench/_wstap.py) reads
back the frames it passes. One server for the module (about 15 s)."""
import asyncio
import math
import threading

import pytest

from tests._apptools import tiny_dir  # noqa: F401
from tests.e2e.serving import served_app

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

N_HEADS = 4 * 4                       # the tiny Llama: 4 layers x 4 query heads


def _mark(sparsity: float) -> str:
    return f'class="hsm-t">{math.floor(sparsity * N_HEADS + 1e-9)} of {N_HEADS} heads pruned<'


def _run(coro):
    """asyncio.run on a thread of its own: a module before this one in the same pytest worker may have
    left sync Playwright's event loop running on the main thread, where asyncio.run refuses to start."""
    out = {}

    def target():
        try:
            out["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            out["error"] = exc

    thread = threading.Thread(target=target, name="stclient")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture(scope="module")
def base(tiny_dir, tmp_path_factory):  # noqa: F811 - the fixture imported above
    tmp = tmp_path_factory.mktemp("served")
    with served_app(tmp / "server.log", {"HEADSCOPE_CACHE": str(tmp / "cache")}) as url:
        yield url


def test_one_key_press_reruns_the_fragment_and_redraws_the_mask(base, tiny_dir):  # noqa: F811
    from bench._stclient import ProtocolError, Session

    async def drive():
        session = Session(base, "/prune", f"model={tiny_dir}&scorer=mp&z=2&sparsity=0.5&policy=global")
        try:
            load = await session.open(watch=(_mark(0.5),), timeout=120)
            press = await session.set_widget("hs.w.prune.sparsity", 0.75, watch=(_mark(0.75),), timeout=60)
            with pytest.raises(ProtocolError, match="no.such"):
                session.widget_id("no.such")
            return session, load, press
        finally:
            await session.close()

    session, load, press = _run(drive())
    assert load.status == "FINISHED_SUCCESSFULLY" and _mark(0.5) in load.marks
    assert press.status == "FINISHED_FRAGMENT_RUN_SUCCESSFULLY"
    assert press.sent <= press.marks[_mark(0.75)] <= press.finished          # the mask, then the run's end
    assert 0 < press.deltas < load.deltas                                      # the fragment, not the page
    assert "sparsity=0.75" in session.query                                     # the URL the server sent back
    sent = {wid.split("-", 2)[-1]: value for wid, (_, value) in session.widgets.items()}
    assert sent["hs.w.prune.sparsity"] == [0.75] and sent["hs.w.prune.z"] == [2.0]
    assert not session.unknown_widgets
    assert press.fetches >= 2 and session.http.done >= load.fetches + press.fetches and not session.http.failed


def test_relay_reads_back_the_frames_it_passes(base, tiny_dir):  # noqa: F811
    from streamlit.proto.BackMsg_pb2 import BackMsg
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

    from bench._stclient import Session
    from bench._wstap import Tap

    async def drive():
        tap = Tap(int(base.rsplit(":", 1)[1]))
        port = await tap.start()
        session = Session(f"http://127.0.0.1:{port}", "/prune", f"model={tiny_dir}&scorer=mp&sparsity=0.5")
        try:
            load = await session.open(timeout=120)
            press = await session.set_widget("hs.w.prune.sparsity", 0.25, timeout=60)
        finally:
            await session.close()
            await tap.stop()
        return tap, load, press

    tap, load, press = _run(drive())
    up = [BackMsg.FromString(p).rerun_script for _, side, p in tap.frames if side == "up"]
    down = [ForwardMsg.FromString(p).WhichOneof("type") for _, side, p in tap.frames if side == "down"]
    assert [(m.page_name, m.fragment_id != "") for m in up] == [("prune", False), ("", True)]
    ends = [i for i, kind in enumerate(down) if kind == "script_finished"]
    assert len(ends) == 2 and ends[0] == load.msgs - 1                  # the load run, as the client saw it
    begins = down.index("new_session", ends[0])                          # the press's run begins
    # the press's run as the client saw it: its new_session .. script_finished, plus any message the server
    # sent between the two runs (a status message can land just before the press's run begins)
    assert ends[1] - begins + 1 <= press.msgs <= ends[1] - ends[0]
