"""components.errors: a user's mistake is shown with its fix, a bug as a short note with folded
details, Streamlit's own stop/rerun pass through, and nothing ever shows a raw traceback element."""
from streamlit.testing.v1 import AppTest


def _app(kind: str):
    def script(kind):
        import streamlit as st

        from analysis.core.errors import CancelledError, InputError
        from components import shell
        from components.errors import shown_errors

        raising = {
            "user": lambda: (_ for _ in ()).throw(InputError("z must be between 0 and 10; move the slider.")),
            "bug": lambda: 1 / 0,
            "cancel": lambda: (_ for _ in ()).throw(CancelledError("Scoring was cancelled; start it again.")),
            "stop": st.stop,
            "end": shell.end_run,
            "fine": lambda: None,
        }[kind]
        failed = True
        with shown_errors("Scoring"):
            raising()
            st.write("after the work")
            failed = False
        st.write(f"failed={failed}")

    return AppTest.from_function(script, args=(kind,), default_timeout=30).run()


def _markdown(at):
    return [m.value for m in at.markdown]


def test_user_error_shows_its_message_only():
    at = _app("user")
    assert not at.exception
    assert [e.value for e in at.error] == ["z must be between 0 and 10; move the slider."]
    assert not at.expander
    assert "failed=True" in _markdown(at) and "after the work" not in _markdown(at)


def test_bug_shows_a_short_note_and_folded_details():
    at = _app("bug")
    assert not at.exception
    (error,) = at.error
    assert error.value.startswith("Scoring failed unexpectedly (ZeroDivisionError")
    assert "Traceback" not in error.value
    (details,) = at.expander
    assert details.label == "Details"
    assert "Traceback" in details.code[0].value and "ZeroDivisionError" in details.code[0].value


def test_cancel_is_a_warning():
    at = _app("cancel")
    assert not at.exception and not at.error
    assert [w.value for w in at.warning] == ["Scoring was cancelled; start it again."]


def test_streamlit_stop_passes_through():
    at = _app("stop")
    assert not at.exception and not at.error
    assert _markdown(at) == []          # st.stop ended the script: nothing after it ran


def test_end_run_passes_through_and_ends_the_script():
    at = _app("end")
    assert not at.exception and not at.error
    assert _markdown(at) == []


def test_ending_a_run_by_its_exception_keeps_the_key_presses_queued_meanwhile():
    """Why end_run() raises the exception st.stop() raises instead of calling st.stop(): st.stop()'s
    request_stop() drops a fragment rerun asked for during the run (a slider's key press while the
    page drew: the slider moved, the page never followed); a run that ends without it runs them next."""
    from streamlit.runtime.scriptrunner_utils.script_requests import RerunData, ScriptRequests, ScriptRequestType

    def queued_after(stop_request: bool):
        requests = ScriptRequests()
        requests.request_rerun(RerunData())
        assert requests.on_scriptrunner_ready().type == ScriptRequestType.RERUN      # the run starts
        requests.request_rerun(RerunData(fragment_id="sliders"))                    # a key press meanwhile
        assert requests.on_scriptrunner_yield() is None       # a fragment rerun does not cut the run short
        if stop_request:
            requests.request_stop()
        return requests.on_scriptrunner_ready()               # the run ended: what runs next

    kept = queued_after(stop_request=False)
    assert kept.type == ScriptRequestType.RERUN and kept.rerun_data.fragment_id_queue == ["sliders"]
    assert queued_after(stop_request=True).type == ScriptRequestType.STOP


def test_no_app_code_calls_st_stop():
    """Every early end goes through shell.end_run() (which keeps queued key presses); st.stop() only
    as its fallback there."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    calls = []
    for path in [root / "app.py", *sorted((root / "pages").glob("*.py")), *sorted((root / "components").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "stop" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "st":
                calls.append(f"{path.relative_to(root)}:{node.lineno}")
    assert len(calls) == 1 and calls[0].startswith("components/shell.py"), calls


def test_success_runs_the_whole_block():
    at = _app("fine")
    assert _markdown(at) == ["after the work", "failed=False"]
