"""Bus bandwidth vs message size from a `msinfer commtest --output FILE.json` run.

    python bench/commtest_plot.py bench/results/commtest_cpu4.json   # writes ...cpu4.png

One line per (group, collective), log-log, as nccl-tests results are usually drawn.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="JSON written by msinfer commtest --output")
    parser.add_argument("-o", "--output", help="PNG path (default: the JSON's, .png)")
    args = parser.parse_args(argv)
    try:
        with open(args.report) as f:
            report = json.load(f)
        rows = report["results"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"commtest_plot: {args.report}: not a commtest report ({e})")
    output = args.output or os.path.splitext(args.report)[0] + ".png"

    fig, ax = plt.subplots(figsize=(8, 5))
    for group in report["groups"]:
        for op in ("AllReduce", "AllGather"):
            line = sorted((r for r in rows if r["group"] == group and r["op"] == op),
                          key=lambda r: r["size_bytes"])
            if line:
                ax.plot([r["size_bytes"] for r in line], [r["busbw_gbps"] for r in line],
                        marker="o", markersize=3,
                        label=f"{op}, {group} (n={line[0]['ranks_per_group']})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes; AllGather: gathered output)")
    ax.set_ylabel("bus bandwidth (GB/s, nccl-tests definition)")
    ax.set_title(f"msinfer commtest: {report['world_size']} ranks, {report['hardware']}, "
                 f"{report['dtype']}, {report['launcher']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    print(output)


if __name__ == "__main__":
    main()
