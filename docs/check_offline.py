"""Fails (exit 1) if a built page loads a script from the network (``make docs`` runs it).

Every ``<script src=...>`` of every ``.html`` file under the folder given (default
``docs/_build/html``) must be a relative path into the site: an ``http:``/``https:`` URL
or a protocol-relative ``//host/...`` one (a CDN) fails, as would the formulas of a
reader without the network.
"""

import re
import sys
from pathlib import Path

_SCRIPT_SRC = re.compile(r"<script\b[^>]*?\bsrc\s*=\s*[\"']?([^\"'\s>]+)", re.I)
_REMOTE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.I)


def remote_scripts(html: str) -> list[str]:
  """The ``src`` of each ``<script>`` in ``html`` that is fetched from the network."""
  return [src for src in _SCRIPT_SRC.findall(html) if _REMOTE.match(src)]


def main(argv: list[str]) -> int:
  site = Path(argv[0] if argv else "docs/_build/html")
  pages = sorted(site.rglob("*.html"))
  if not pages:
    print(f"check_offline: no .html pages under {site}", file=sys.stderr)
    return 1
  bad = [(page, src) for page in pages for src in remote_scripts(page.read_text(errors="replace"))]
  for page, src in bad:
    print(f"check_offline: {page} loads a script from the network: {src}", file=sys.stderr)
  if not bad:
    print(f"check_offline: {len(pages)} pages, every script local")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
