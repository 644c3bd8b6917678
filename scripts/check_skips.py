"""Fail CI when a test was skipped for a reason that is not one of the expected ones, and print every skip.

``python scripts/check_skips.py REPORT``: REPORT has one JSON object per line, ``{"test": ..., "reason": ...}``,
written by ``tests/conftest.py`` when ``TORCHELASTIC_SKIP_REPORT`` names it. A skip is expected only when the
machine truly cannot run the test, never because a tier was switched off.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Final

#: The skips CI accepts, and why each is not a gap.
EXPECTED: Final = {
    # The CRD derivative is compared with the upstream file, which lies beside the repository (../shared/crds) and
    # is never committed; a clone without it cannot compare.
    r"^upstream CRD not at ": "the upstream CRDs are not beside this clone",
    # This machine has no GPU; the GPU path is checked on a lent device.
    r"^needs a CUDA device": "no CUDA device here",
}


def unexpected(skips: list[dict[str, str]]) -> list[dict[str, str]]:
    return [s for s in skips if not any(re.search(pattern, s["reason"]) for pattern in EXPECTED)]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python scripts/check_skips.py REPORT", file=sys.stderr)
        return 2
    path = Path(argv[1])
    if not path.is_file():
        print(f"check_skips: no skip report at {path}: did pytest run?", file=sys.stderr)
        return 1
    skips = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print(f"==> skipped tests: {len(skips)}")
    for skip in skips:
        print(f"    {skip['test']}: {skip['reason']}")
    bad = unexpected(skips)
    if bad:
        print(
            f"check_skips: {len(bad)} test(s) skipped for a reason CI does not accept (expected only: "
            + "; ".join(EXPECTED.values())
            + "); make the test run here, or add its reason to scripts/check_skips.py with why",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
