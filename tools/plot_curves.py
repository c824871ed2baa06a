"""curves.png for any run, or several overlaid (one colour each):

    python tools/plot_curves.py outputs/ppo/metrics.jsonl -o curves.png
    python tools/plot_curves.py outputs/a/metrics.jsonl outputs/b/metrics.jsonl -o compare.png --keys score/mean kl/mean
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root, for infra/

from infra.metrics import CURVE_KEYS, plot_curves

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Plot one run's metrics.jsonl, or several overlaid.")
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files; several are overlaid, one colour each")
    parser.add_argument("-o", "--output", default="curves.png")
    parser.add_argument("--keys", nargs="+", default=CURVE_KEYS, help="metrics to plot (those logged get a panel)")
    parser.add_argument("--smoothing", type=float, default=0.8, help="EMA weight α of the line over the raw values")
    args = parser.parse_args()
    print(f"{args.output}: " + ", ".join(plot_curves(args.metrics, args.output, args.keys, args.smoothing)))
