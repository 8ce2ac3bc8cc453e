"""`hivetune registry` and `hivetune cycle`: the learning loop's versions and its daily cycle."""

from __future__ import annotations

import json

from hivetune.core.errors import UserError

ACTIONS = ("init", "list", "add", "promote", "rollback")


def add_registry_parser(sub) -> None:
    reg = sub.add_parser(
        "registry", help="versions of the adapter in service: list, init, add, promote, rollback",
        usage="hivetune registry [init|add|promote|rollback] DIR [RUN|VERSION] [options]",
        description="hivetune registry DIR: list the versions (* in service). init DIR --base MODEL: a new "
                    "registry. add DIR RUN [--compare compare.json]: register a finished run as a new version. "
                    "promote DIR VERSION: put it in service (atomically). rollback DIR [VERSION]: put VERSION, "
                    "by default the parent of the version in service, back in service.")
    reg.add_argument("words", nargs="+", metavar="ARG", help="[ACTION] DIR [RUN|VERSION]")
    reg.add_argument("--base", default="", metavar="MODEL",
                     help="init: the base model (HF folder, .gguf or Hub id; default: the embedded model)")
    reg.add_argument("--compare", default="", metavar="FILE", help="add: compare.json whose figures the version keeps")
    reg.add_argument("--parent", default=None, metavar="VERSION",
                     help="add: the version the run started from ('none': the base; default: the one in service)")
    reg.add_argument("--promote", action="store_true", help="add: also put the new version in service")
    reg.add_argument("--json", action="store_true", help="list: print JSON")


def registry_words(words: list[str]) -> tuple[str, str, str | None]:
    """(action, DIR, RUN or VERSION) of `hivetune registry`'s positional words."""
    action = words[0] if words[0] in ACTIONS and len(words) > 1 else "list"
    rest = words[1:] if action != "list" or words[0] == "list" else words
    need = {"init": (1, 1), "list": (1, 1), "add": (2, 2), "promote": (2, 2), "rollback": (1, 2)}[action]
    if not need[0] <= len(rest) <= need[1]:
        usage = {"init": "init DIR --base MODEL", "list": "DIR", "add": "add DIR RUN", "promote": "promote DIR VERSION",
                 "rollback": "rollback DIR [VERSION]"}[action]
        raise UserError(f"registry: expected `hivetune registry {usage}`, got {' '.join(words)!r}")
    return action, rest[0], rest[1] if len(rest) > 1 else None


def run_registry(ns) -> int:
    from hivetune.workflows import registry as reg

    action, root, arg = registry_words(ns.words)
    for flag, value, allowed in (("--base", ns.base, "init"), ("--compare", ns.compare, "add"),
                                 ("--parent", ns.parent, "add"), ("--promote", ns.promote, "add"),
                                 ("--json", ns.json, "list")):
        if value and action != allowed:
            raise UserError(f"registry: {flag} goes with `registry {allowed}`, not `registry {action}`")
    if action == "init":
        info = reg.init_registry(root, ns.base)
        print(f"registry {root}: base {info['base']}, nothing in service yet")
    elif action == "list":
        data = reg.listing(root)
        print(json.dumps(data, indent=2) if ns.json else reg.format_listing(data))
    elif action == "add":
        parent = reg.CURRENT if ns.parent is None else (None if ns.parent == "none" else ns.parent)
        vid = reg.add_version(root, arg, compare=ns.compare or None, parent=parent)
        print(f"added {arg} as {vid} (parent {reg.read_version(root, vid)['parent'] or 'the base'})")
        if ns.promote:
            print_change(reg.promote(root, vid), root)
    elif action == "promote":
        print_change(reg.promote(root, arg), root)
    else:
        print_change(reg.rollback(root, reg.PARENT if arg is None else None if arg in ("base", "none") else arg), root)
    return 0


def print_change(line: dict | None, root: str) -> None:
    from hivetune.workflows.registry import current_version

    if line is None:
        print(f"{current_version(root) or 'the base model'} is in service already: nothing changed")
    else:
        print(f"{line['action']}: {line['from'] or 'base'} -> {line['to'] or 'base'} in service")


def add_cycle_parser(sub) -> None:
    cyc = sub.add_parser(
        "cycle", help="one learning-loop cycle: collect, curate, train, compare, promote or reject",
        description="Learn from the registry's new serve logs: snapshot them, curate them into training data, "
                    "split off held-out data, train from the version in service, compare it with that version, "
                    "and promote the new one only when it is better on the new held-out data and not worse "
                    "than --margin on REG/regression.jsonl. An unfinished cycle (killed) is finished first.")
    cyc.add_argument("--registry", required=True, metavar="DIR")
    cyc.add_argument("--data-since", default="", metavar="DATE",
                     help="learn from the logs of DATE (YYYY-MM-DD) on, used before or not "
                          "(default: the log lines no earlier cycle used)")
    cyc.add_argument("--replay", type=float, default=0.3, metavar="FRACTION",
                     help="share of the training data drawn from the data of the version in service (default 0.3)")
    cyc.add_argument("--margin", type=float, default=0.02, metavar="FRACTION",
                     help="regression loss may rise at most this relative amount (default 0.02)")
    cyc.add_argument("--heldout", type=float, default=0.2, metavar="FRACTION",
                     help="share of the new data held out for the comparison (default 0.2)")
    cyc.add_argument("--min-examples", type=int, default=20, metavar="N",
                     help="fewer new exchanges or curated examples than this: nothing to do (default 20)")
    cyc.add_argument("--keep-unrated", action="store_true",
                     help="also learn from unrated exchanges, with their answer (default: rated good or corrected)")
    cyc.add_argument("--train-set", dest="train_set", action="append", default=[], metavar="KEY=VALUE",
                     help="a training config key for this cycle's training (repeatable), e.g. max_steps=50")
    cyc.add_argument("--eval-engine", default="auto", choices=["auto", "hivetune", "llama.cpp"],
                     help="who scores the gate's comparison (default auto: llama.cpp, the model as served, for a "
                          ".gguf base where llama-cpp-python is installed; else hivetune's decoder)")
    cyc.add_argument("--json", action="store_true", help="print the reports (a finished cycle's, the new one's) as a JSON list")


def run_cycle_command(ns) -> int:
    from hivetune.workflows.cycle import CycleOptions, format_report, run_cycles

    opts = CycleOptions(data_since=ns.data_since, replay=ns.replay, margin=ns.margin, heldout=ns.heldout,
                        min_examples=ns.min_examples, keep_unrated=ns.keep_unrated, train_set=ns.train_set,
                        eval_engine=ns.eval_engine)
    reports = run_cycles(ns.registry, opts)
    print(json.dumps(reports, indent=2) if ns.json else "\n\n".join(format_report(r) for r in reports))
    return 0


COMMANDS = {"registry": (add_registry_parser, run_registry), "cycle": (add_cycle_parser, run_cycle_command)}
