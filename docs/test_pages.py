"""The docs cover the whole public API: an API page and a README row per name."""

import re
from pathlib import Path

import kldiv_jax

DOCS = Path(__file__).resolve().parent


def test_every_public_name_has_an_api_page():
  listed = set(re.findall(r"^   (\w+)$", (DOCS / "api.md").read_text(), re.M))
  assert set(kldiv_jax.__all__) <= listed, set(kldiv_jax.__all__) - listed


def test_every_public_name_is_in_the_readme_api_table():
  readme = (DOCS.parent / "README.md").read_text()
  table = readme.split("## API", 1)[1].split("\n## ", 1)[0]
  rows = set(re.findall(r"^\| `(\w+)\(", table, re.M))
  assert set(kldiv_jax.__all__) <= rows, set(kldiv_jax.__all__) - rows


def test_user_facing_text_speaks_of_the_product():
  pages = [DOCS.parent / "README.md", DOCS.parent / "benchmarks" / "README.md", *DOCS.glob("*.md")]
  for page in pages:
    assert not re.search(r"\bissues?[- ]\d", page.read_text(), re.I), page


def test_page_code_never_shadows_a_public_name():
  """A page's code that defines a library name (``def token_log_probs``) misleads its reader."""
  for page in [DOCS.parent / "README.md", *DOCS.glob("*.md")]:
    code = "".join(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
    defined = set(re.findall(r"^\s*(?:def|class)\s+(\w+)", code, re.M))
    defined |= set(re.findall(r"^(\w+)\s*=", code, re.M))
    assert not defined & set(kldiv_jax.__all__), (page.name, defined & set(kldiv_jax.__all__))


def test_torch_install_advice_names_the_cpu_wheel():
  """A plain ``pip install torch`` on Linux brings the CUDA build and its NVIDIA libraries."""
  for page in [
    DOCS.parent / "README.md",
    DOCS.parent / "benchmarks" / "README.md",
    *DOCS.glob("*.md"),
  ]:
    for command in re.findall(r"pip install torch\b[^`\n]*", page.read_text()):
      assert "--index-url https://download.pytorch.org/whl/cpu" in command, (page.name, command)


def test_the_offline_check_flags_scripts_from_the_network():
  """``make docs`` runs ``check_offline.py`` over the site: a CDN script fails it."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("check_offline", DOCS / "check_offline.py")
  assert spec is not None and spec.loader is not None
  check = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(check)
  page = """<script src="_static/doctools.js?v=1"></script>
  <script defer="defer" src="_static/mathjax/tex-chtml.js"></script>
  <script async src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"></script>
  <script src='//cdnjs.cloudflare.com/ajax/libs/mathjax/2.7.7/MathJax.js'></script>
  <SCRIPT SRC=http://example.com/x.js></SCRIPT>"""
  assert check.remote_scripts(page) == [
    "https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js",
    "//cdnjs.cloudflare.com/ajax/libs/mathjax/2.7.7/MathJax.js",
    "http://example.com/x.js",
  ]


def test_install_lines_name_the_package_and_extras_that_exist():
  """``pip install kldiv_jax[x]`` and ``pip install -e '.[x]'`` in the pages: the project's
  name and extras of pyproject.toml (no extra documented before it exists)."""
  import tomllib

  project = tomllib.loads((DOCS.parent / "pyproject.toml").read_text())["project"]
  extras = set(project["optional-dependencies"])
  seen = set()
  for page in [DOCS.parent / "README.md", *DOCS.glob("*.md")]:
    for target in re.findall(
      r"pip install (?:-e )?'?([\w.\-]+(?:\[[\w,]+\])?)'?", page.read_text()
    ):
      name, _, tail = target.partition("[")
      if name not in (".", project["name"], project["name"].replace("_", "-")):
        continue  # another package (torch, jax, ...)
      seen.add(name)
      assert set(filter(None, tail.rstrip("]").split(","))) <= extras, (page.name, target)
  assert {project["name"], "."} <= seen
