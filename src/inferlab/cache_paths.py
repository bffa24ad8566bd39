"""Where inferlab keeps what it downloads or builds: $INFERLAB_CACHE, else ~/.cache/inferlab.

One root for all of it (the default model under models/, tokenizers converted from GGUF files
under tokenizers/, the compiled CPU kernels under kernels/), so that one variable moves everything, e.g. to a bigger disk or a throwaway folder.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$INFERLAB_CACHE when set (and not empty), else ~/.cache/inferlab."""
    env = os.environ.get("INFERLAB_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "inferlab"
