"""python -m kvquant.native build: compile the native CPU ops once (setup.sh runs it)."""

import sys
import time

from . import build


def main(argv: list[str]) -> int:
    if argv != ["build"]:
        print("usage: python -m kvquant.native build", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        path = build()
    except Exception as e:  # no compiler, no ninja: the PyTorch path serves; say so and how to fix it
        print(f"[native] build failed ({type(e).__name__}: {e}); the PyTorch reference path will serve. "
              "Install a C++ compiler (g++) and ninja, then rerun: python -m kvquant.native build",
              file=sys.stderr)
        return 1
    print(f"[native] {path} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
