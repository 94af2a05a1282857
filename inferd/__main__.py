from __future__ import annotations

from inferd.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
