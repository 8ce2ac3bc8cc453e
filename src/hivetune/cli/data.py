"""`hivetune data`: make, check, measure, split and collect training data."""

from __future__ import annotations


from hivetune.core.errors import UserError


def add_data_parser(sub) -> None:
    data = sub.add_parser("data", help="make, check, measure, split and collect training data",
                          description="Tools for training data files (JSONL, or a JSON array). Each streams "
                                      "the file, so multi-GB files work in bounded memory.")
    dsub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    synth = dsub.add_parser("synth", help="write the synthetic Linux / GPU ops dataset")
    synth.add_argument("--n", type=int, default=1500, help="examples (default 1500)")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--out", required=True, metavar="FILE", help="JSONL file to write")
    synth.add_argument("--force", action="store_true", help="overwrite an existing --out")
    validate = dsub.add_parser("validate", help="report every problem: schema, empty, duplicates, too long",
                               description="Exit 0 when clean, 1 when problems were found, 2 for unusable input.")
    validate.add_argument("file", metavar="FILE")
    validate.add_argument("--model", default="", metavar="PATH",
                          help="check token lengths with this model's tokenizer (default with --max-length: "
                               "the embedded model)")
    validate.add_argument("--max-length", type=int, default=None, help="token limit (default 1024)")
    validate.add_argument("--format", default="auto", help="alpaca | chat | text | auto")
    add_source_flags(validate)
    stats = dsub.add_parser("stats", help="token length percentiles, histogram, padding vs packing")
    stats.add_argument("file", metavar="FILE")
    stats.add_argument("--model", default="", metavar="PATH", help="tokenizer to count with (default: embedded model)")
    stats.add_argument("--max-length", type=int, default=None, help="training max_length (default 1024)")
    stats.add_argument("--png", default=None, metavar="OUT.png", help="also draw the histograms (needs matplotlib)")
    stats.add_argument("--format", default="auto", help="alpaca | chat | text | auto")
    add_source_flags(stats)
    split = dsub.add_parser("split", help="deterministic train / held-out split, stratified by category")
    split.add_argument("file", metavar="FILE")
    split.add_argument("--heldout", type=float, default=0.1, help="fraction in (0, 1), or a count (default 0.1)")
    split.add_argument("--seed", type=int, default=0)
    split.add_argument("--out-train", required=True, metavar="FILE")
    split.add_argument("--out-heldout", required=True, metavar="FILE")
    split.add_argument("--force", action="store_true", help="overwrite existing outputs")
    collect = dsub.add_parser("collect", help="append prompt/response pairs from a JSONL log of interactions")
    collect.add_argument("log", metavar="LOG")
    collect.add_argument("--out", required=True, metavar="FILE",
                         help="JSONL data file to append to (created if missing)")
    collect.add_argument("--format", default="auto", help="chat | alpaca | auto (FILE's format; chat for a new file)")
    add_curate_parser(dsub)
    pairs = dsub.add_parser("pairs", help="preference pairs from interaction logs: corrections of answers rated bad",
                            description="Every exchange rated -1 with a correction becomes a pair {messages, chosen: "
                                        "the correction, rejected: the answer} for train --method dpo / orpo.")
    pairs.add_argument("logs", nargs="+", metavar="LOG", help="interaction logs (JSONL, as `hivetune serve` writes)")
    pairs.add_argument("--out", required=True, metavar="FILE", help="JSONL file of pairs to write")
    pairs.add_argument("--force", action="store_true", help="overwrite an existing --out")


def add_curate_parser(dsub) -> None:
    curate = dsub.add_parser("curate", help="training data from serve's interaction logs: rated, scrubbed, deduped",
                             description="Keep exchanges rated good and those with a correction (the correction "
                                         "becomes the answer); scrub secrets and personal data; drop too long ones "
                                         "and duplicates (also of --train-data); mix in a replay share of "
                                         "--train-data. Writes chat JSONL and prints the counts.")
    curate.add_argument("logs", nargs="+", metavar="LOG", help="interaction log(s) of hivetune serve (JSONL)")
    curate.add_argument("--out", required=True, metavar="FILE", help="chat JSONL file to write")
    curate.add_argument("--train-data", default="", metavar="FILE",
                        help="earlier training data: deduplicate against it and replay from it")
    curate.add_argument("--replay", type=float, default=0.0, metavar="FRACTION",
                        help="share of the output taken from --train-data, in [0, 1) (default 0)")
    curate.add_argument("--max-length", type=int, default=None, metavar="N",
                        help="most tokens with --model (default 1024), else characters (default: no limit)")
    curate.add_argument("--model", default="", metavar="PATH", help="count --max-length in this model's tokens")
    curate.add_argument("--keep-unrated", action="store_true", help="keep unrated exchanges with their answer")
    curate.add_argument("--seed", type=int, default=0, help="replay sample and output order")
    curate.add_argument("--force", action="store_true", help="overwrite an existing --out")


def add_source_flags(parser) -> None:
    """FILE as any data source: --data-split / --data-config of a Hub dataset, --columns."""
    parser.add_argument("--data-split", default="", metavar="SPLIT", help="a Hub dataset's split (default: train)")
    parser.add_argument("--data-config", default="", metavar="NAME", help="a Hub dataset's configuration")
    parser.add_argument("--columns", default="", metavar="FIELD=COLUMN,...",
                        help="the data's column for each field read, e.g. output=answer")


def data_source(ns):
    """The DataSource of `data validate` / `data stats`' FILE and source flags."""
    from hivetune.core.config_schema import COLUMN_FIELDS
    from hivetune.data.sources import DataSource

    columns = {}
    for pair in filter(None, (p.strip() for p in ns.columns.split(","))):
        field_name, _, column = pair.partition("=")
        if not column or field_name not in COLUMN_FIELDS:
            raise UserError(f"--columns: expected FIELD=COLUMN with FIELD one of {', '.join(COLUMN_FIELDS)}, "
                            f"got {pair!r}")
        columns[field_name] = column
    return DataSource(ns.file, columns, ns.data_split, ns.data_config)


def run_data(ns) -> int:
    command = ns.data_command
    if command is None:
        raise UserError("data: name a subcommand: synth, validate, stats, split, collect or pairs (see hivetune data --help)")
    if command == "synth":
        from hivetune.data.synth_file import format_synth, write_synthetic

        print(format_synth(write_synthetic(ns.n, ns.seed, ns.out, ns.force)))
        return 0
    if command == "validate":
        from hivetune.data.validate import format_report, validate_file

        report = validate_file(data_source(ns), ns.model, ns.max_length, ns.format)
        print(format_report(report))
        return report.exit_code
    if command == "stats":
        from hivetune.data.stats import data_stats, format_stats

        print(format_stats(data_stats(data_source(ns), ns.model, ns.max_length, ns.png, ns.format)))
        return 0
    if command == "split":
        from hivetune.data.split import format_split, split_file

        print(format_split(split_file(ns.file, ns.heldout, ns.seed, ns.out_train, ns.out_heldout, ns.force)))
        return 0
    if command == "curate":
        from hivetune.data.curate import curate, format_curate

        print(format_curate(curate(ns.logs, ns.out, ns.train_data or None, ns.replay, ns.max_length, ns.model,
                                   ns.seed, ns.force, ns.keep_unrated)))
        return 0
    if command == "pairs":
        from hivetune.data.pairs import format_pairs, pairs_from_logs

        print(format_pairs(pairs_from_logs(ns.logs, ns.out, ns.force)))
        return 0
    from hivetune.data.collect import collect_log, format_collect

    print(format_collect(collect_log(ns.log, ns.out, ns.format)))
    return 0


COMMANDS = {"data": (add_data_parser, run_data)}
