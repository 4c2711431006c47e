"""MkDocs hooks (mkdocs.yml `hooks:`): the generated pages and tables of scripts/docs_gen.py.

The API and CLI references replace their placeholders (docs/reference/, which say so where the
site is not built, e.g. when the Markdown is read in a repository browser); a `<!-- generated: NAME -->` line in
any page is followed by the table NAME (settings, metrics). Nothing is written into docs/.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import docs_gen  # a sibling script, found through the path set just above
from mkdocs.structure.files import File, Files


def on_files(files: Files, config: Any) -> Files:
    """Put the generated reference pages in place of their placeholders in docs/reference/."""
    for path, render in docs_gen.PAGES.items():
        placeholder = files.get_file_from_path(path)
        if placeholder is not None:
            files.remove(placeholder)
        files.append(File.generated(config, path, content=render()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Fill the generated tables a page asks for."""
    return docs_gen.fill_tables(markdown)
