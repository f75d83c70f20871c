"""A griffe extension for the documentation site: reST markup in docstrings.

cudafut's docstrings are Google style (``Args:``, ``Raises:``, ``Returns:``,
``Attributes:``) but refer to other objects with Sphinx roles
(``:class:`CudaFuture```) and introduce examples with reST's ``::``.
mkdocstrings renders docstrings as Markdown, where those would show as
written; this turns each role into a code span and each ``::`` into ``:``
(the indented block after it is already a Markdown code block). It is
loaded by ``mkdocs.yml`` and changes only what the site shows.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# :class:`~cudafut.CudaFuture`, :meth:`result`, :func:`text <target>`, ...
_ROLE = re.compile(r":(?:py:)?[a-z]+:`(~?)([^`<]*?)(?:\s*<([^`>]*)>)?`")
# "an example::" at the end of a line: "an example:".
_TRAILING = re.compile(r"(?m)(?<=\S)::$")
# "::" alone on a line: dropped.
_ALONE = re.compile(r"(?m)^[ \t]*::\n")


def _code(match: re.Match[str]) -> str:
    short, text, target = match.group(1), match.group(2).strip(), match.group(3)
    if target and text:  # :role:`text <target>`: show the text
        return f"`{text}`"
    name = (target or text).lstrip("!")
    if short:  # :role:`~a.b.C`: show the last component
        name = name.rsplit(".", 1)[-1]
    return f"`{name}`"


def markdown(text: str) -> str:
    """``text`` with its Sphinx roles and ``::`` markers made Markdown."""
    text = _ROLE.sub(_code, text)
    text = _TRAILING.sub(":", text)
    return _ALONE.sub("", text)


class RestToMarkdown(griffe.Extension):
    """Rewrite every docstring that griffe reads, as it reads it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
