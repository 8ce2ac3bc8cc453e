"""A stand-in for `hivetune eval --candidate A --against B ... --out DIR` with a set verdict, for
the tests of tests/workflows/test_cycle.py that kill a cycle at every stage and need its end
(promoted) not to hang on how a 3-step training run happens to score:

    python fake_cycle_tools.py HELD_CAND HELD_AGAINST REGR_CAND REGR_AGAINST --candidate A ... --out DIR

writes DIR/compare.json in the layout of workflows/compare.py with these losses (the regression
set only with --regression).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def main(argv: list[str]) -> int:
    losses, argv = [float(x) for x in argv[:4]], argv[4:]
    sets = {}
    for name, (cand, against) in (("heldout", losses[:2]), ("regression", losses[2:])):
        if name == "regression" and "--regression" not in argv:
            continue
        sets[name] = {"examples": 4, "candidate": {"loss": cand}, "against": {"loss": against},
                      "wins": {"candidate": 0, "against": 0, "ties": 4}}
    out = Path(flag(argv, "--out"))
    out.mkdir(parents=True)
    (out / "compare.json").write_text(json.dumps({"candidate": flag(argv, "--candidate"),
                                                  "against": flag(argv, "--against"), "sets": sets}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
