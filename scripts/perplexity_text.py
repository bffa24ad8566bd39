"""Write the perplexity benchmark's text: Python's own documentation topics (the stdlib's
`pydoc_data.topics`, the text `help('with')` shows), sorted by topic name, joined, and cut to
the first --chars characters. Reproducible from the interpreter alone (no download); the
text depends on the Python version, so the version and the text's sha256 are printed.

    python scripts/perplexity_text.py [OUT] [--chars 120000]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
from pathlib import Path
from pydoc_data.topics import topics


def build_text(chars: int) -> str:
    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    return text[:chars]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="/tmp/inferlab-ppl/pydoc_topics.txt")
    p.add_argument("--chars", type=int, default=120_000)
    args = p.parse_args()
    text = build_text(args.chars)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    print(f"{out}: {len(text)} characters, Python {platform.python_version()}, sha256 {digest}")


if __name__ == "__main__":
    main()
