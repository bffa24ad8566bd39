"""Skip marks for tests of a kernel path this CPU may not have, each naming what is missing."""

from __future__ import annotations

import pytest

from inferlab.kernels import build

needs_int8_dot = pytest.mark.skipif(
    not build.kernel_info().int8_dot,
    reason=f"w8a8 needs our kernels' integer dot product (AVX2 vpmaddwd or AVX512_VNNI vpdpbusd); "
           f"this process has none ({build.unavailable_reason() or build.kernel_info().variant})")
