"""components.errors: a user's mistake is shown with its fix, a bug as a short note with folded
details, Streamlit's own stop/rerun pass through, and nothing ever shows a raw traceback element."""
from streamlit.testing.v1 import AppTest


def _app(kind: str):
    def script(kind):
        import streamlit as st

        from analysis.core.errors import CancelledError, InputError
        from components.errors import shown_errors

        raising = {
            "user": lambda: (_ for _ in ()).throw(InputError("z must be between 0 and 10; move the slider.")),
            "bug": lambda: 1 / 0,
            "cancel": lambda: (_ for _ in ()).throw(CancelledError("Scoring was cancelled; start it again.")),
            "stop": st.stop,
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


def test_success_runs_the_whole_block():
    at = _app("fine")
    assert _markdown(at) == ["after the work", "failed=False"]
