"""headscope: the Streamlit entry point. Navigation over pages/ and the sidebar model picker.

Run with `streamlit run app.py` (or `bash scripts/run_app.sh`). The view (model, scorer, z,
sparsity, page) lives in the URL's query parameters via `components.state`, so a view can be
shared and reloaded; the model picked in the sidebar is shared by every page.
"""
from pathlib import Path

import streamlit as st

from analysis.arch.models import BUILTIN_MODELS
from components import shell, state

OTHER = "other"
PAGES = {
    "model": dict(path="pages/model.py", title="Model", icon=":material/memory:"),
    "walkthrough": dict(path="pages/walkthrough.py", title="Walkthrough", icon=":material/school:"),
    "profiles": dict(path="pages/profiles.py", title="Profiles", icon=":material/bar_chart:"),
    "prune": dict(path="pages/prune.py", title="Prune", icon=":material/content_cut:"),
    "long_context": dict(path="pages/long_context.py", title="Long context", icon=":material/view_timeline:"),
    "compare": dict(path="pages/compare.py", title="Compare", icon=":material/compare_arrows:"),
    "heads": dict(path="pages/heads.py", title="Heads", icon=":material/grid_view:"),
    "export": dict(path="pages/export.py", title="Export", icon=":material/download:"),
    "pipeline": dict(path="pages/pipeline.py", title="Pipeline", icon=":material/autorenew:"),
}


def _label(choice: str) -> str:
    if choice == OTHER:
        return "Other: hub id or local folder"
    return BUILTIN_MODELS[choice].title     # "(built-in)" went past the sidebar's box: the caption says it


def model_picker() -> None:
    """Sidebar: built-in models or any id/folder, plus the trust_remote_code switch (off)."""
    st.sidebar.header("Model")
    current = str(state.get("model") or "")
    choices = [*BUILTIN_MODELS, OTHER]
    choice = st.sidebar.selectbox(
        "Model", choices, format_func=_label, label_visibility="collapsed",
        key=state.widget_key("model_choice", value=current if current in BUILTIN_MODELS else OTHER))
    if choice == OTHER:
        typed = st.sidebar.text_input(
            "Hugging Face id or local folder", placeholder="org/model or /path/to/folder",
            key=state.widget_key("model_text", value="" if current in BUILTIN_MODELS else current),
            help="A folder with config.json, *.safetensors and the tokenizer files, or a hub id that "
                 "is in the local Hugging Face cache (this machine may be offline).")
        name = typed.strip()
    else:
        name = choice
        st.sidebar.caption(f"Built-in (shipped with headscope, works offline). {BUILTIN_MODELS[choice].description}")
    trust = st.sidebar.toggle("trust_remote_code", key=state.widget_key("trust", value=state.trust()),
                              help="Run Python code shipped with the model. Off by default; turn on only "
                                   "for models whose code you trust. Never taken from a shared link.")
    state.set_trust(trust)
    if trust:
        st.sidebar.warning("Custom model code will run on this machine.")
    if name != current:
        state.set("model", name)


# A local image: a material-icon or emoji page icon is fetched from an outside host (the app works offline)
ICON = Path(__file__).resolve().parent / "assets" / "favicon.png"
st.set_page_config(page_title="headscope", page_icon=str(ICON), layout="wide")
state.init()
pages = {name: st.Page(p["path"], title=p["title"], icon=p["icon"], url_path=name, default=(name == "model"))
         for name, p in PAGES.items()}
current = st.navigation(list(pages.values()))
state.follow_url_page(current, pages)
state.set("page", next(name for name, page in pages.items() if page.title == current.title))
for note in state.url_notes():
    st.warning(note)
stopped = state.stopped_note()
if stopped:
    st.warning(stopped, icon=":material/stop_circle:")
model_picker()
state.sync_url()
st.sidebar.divider()
st.sidebar.caption("headscope: see, score and cut the attention heads of transformer models.")
with shell.inside_app():
    current.run()
