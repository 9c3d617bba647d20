"""docs/flags.md is generated from the scripts' config dataclasses: it must list every flag as it is now."""

from __future__ import annotations

import importlib.util

from conftest import REPO_ROOT


def test_docs_flags_md_is_what_the_generator_prints():
    spec = importlib.util.spec_from_file_location("flag_reference", REPO_ROOT / "tools" / "flag_reference.py")
    flag_reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flag_reference)
    written = (REPO_ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    assert written == flag_reference.render(), "docs/flags.md is out of date: run venv/bin/python tools/flag_reference.py docs/flags.md"
