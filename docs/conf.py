"""Sphinx configuration for the kldiv_jax documentation (``make docs``)."""

import jax
from sphinx.util.typing import stringify_annotation

import kldiv_jax

project = "kldiv_jax"
author = "kldiv_jax authors"
copyright = "kldiv_jax authors"  # noqa: A001 (Sphinx's name)
release = kldiv_jax.__version__
version = release

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
  # MathJax 3 from a PyPI package, copied into _static: the formulas render offline.
  "sphinx-mathjax-offline",
  "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "README.md"]
templates_path = ["_templates"]

# MyST: $...$ math in the pages, anchors for the headings down to ###.
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

# API pages: one per public name, generated from the docstrings.
autosummary_generate = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# kldiv_jax.tunix imports Flax and Tunix (the `tunix` extra), which the docs environment
# lacks: its API pages are built from the docstrings with those two mocked.
autodoc_mock_imports = ["flax", "tunix"]

html_theme = "furo"
html_title = f"kldiv_jax {release}"
html_static_path: list[str] = []


# Signatures: Python expands ``jax.typing.ArrayLike`` (a Union) into its eight
# members; show the name the source writes instead, and ``jax.Array`` for the
# private class path ``jax.jaxlib._jax.Array``.
_SHORTHANDS = [
  (stringify_annotation(float | jax.typing.ArrayLike, "smart"), "float | ~jax.typing.ArrayLike"),
  (stringify_annotation(jax.typing.ArrayLike, "smart"), "~jax.typing.ArrayLike"),
  (stringify_annotation(jax.Array, "smart"), "~jax.Array"),
]


def _shorten(text: str | None) -> str | None:
  for long, short in _SHORTHANDS:
    text = text and text.replace(long, short)
  return text


def _process_signature(app, what, name, obj, options, signature, return_annotation):
  del app, what, name, obj, options  # the hook's other arguments
  return _shorten(signature), _shorten(return_annotation)


def setup(app):
  app.connect("autodoc-process-signature", _process_signature)
