"""Our CPU kernels (C++, compiled on first use): see build.py for how and when."""
