"""Compare page (being built)."""
import streamlit as st

from components import shell

shell.ensure_app()

st.title("Compare")
st.info("This page is not available yet.")
