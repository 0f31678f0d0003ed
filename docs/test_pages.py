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
