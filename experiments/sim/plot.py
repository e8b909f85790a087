#!/usr/bin/env python3
"""Plots of the simulator experiments: reads experiments/sim/results/*.json (written by the
sim_* examples) and writes docs/results/sim_*.png.

    python3 experiments/sim/plot.py

Needs python3 with matplotlib (3.x; tested with 3.11). If it is missing:
    pip install matplotlib
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RES = os.path.join(ROOT, "experiments", "sim", "results")
OUT = os.path.join(ROOT, "docs", "results")


def load(name):
    path = os.path.join(RES, name + ".json")
    if not os.path.exists(path):
        print(f"skip {name}: {path} missing (run the example first)", file=sys.stderr)
        return None
    with open(path) as f:
        return json.load(f)


def save(fig, name):
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, name)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print("wrote", path)


def incast():
    d = load("incast64")
    if not d:
        return
    rtt_us = d["base_rtt_ns"] / 1000
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    colors = {"fair": "tab:blue", "AIMD": "tab:red"}
    for r in d["runs"]:
        c = colors["fair" if r["label"].startswith("fair") else "AIMD"]
        style = "-" if r["wave"] == "warm" else ":"
        name = f'{r["label"].split(" (")[0]}, {r["wave"]}'
        n = min(len(r["jain_window"]), 120)
        x = list(range(1, n + 1))
        axes[0].plot(x, r["jain_window"][:n], style, color=c, label=name)
        m = min(len(r["jain_goodput_sliding"]), 120)
        axes[1].plot(range(1, m + 1), r["jain_goodput_sliding"][:m], style, color=c, label=name)
        q = r["queue_bytes"][:120]
        axes[2].plot(range(1, len(q) + 1), [v / 1e6 for v in q], style, color=c, label=name)
    for ax in axes[:2]:
        ax.axhline(0.95, color="gray", lw=0.8, ls="--")
        ax.set_ylim(0, 1.05)
    axes[0].set_title("Jain of sender windows, per RTT")
    axes[1].set_title(f'Jain of goodput at the sink, last {d["sliding_bins"]} RTTs')
    axes[2].set_title("sink port queue (max per RTT)")
    axes[2].set_ylabel("MB")
    for ax in axes:
        ax.set_xlabel(f"round trips since the post (1 RTT = {rtt_us:.1f} µs)")
        ax.legend(fontsize=7)
    fig.suptitle(f'{d["senders"]}-to-1 incast, {d["bytes_per_sender"] >> 20} MiB per sender')
    save(fig, "sim_incast.png")


def permutation():
    d = load("permutation")
    if not d:
        return
    runs = d["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    axes[0].bar(
        [str(r["paths"]) for r in runs],
        [100 * r["fraction_of_bisection"] for r in runs],
        color=["tab:red"] + ["tab:blue"] * (len(runs) - 1),
    )
    axes[0].axhline(90, color="gray", ls="--", lw=0.8)
    axes[0].set_xlabel("paths per connection")
    axes[0].set_ylabel("% of bisection bandwidth")
    axes[0].set_title("permutation goodput (steady state)")
    for r in runs:
        if r["paths"] in (1, 8, 32):
            s = r["series_gbps"]
            axes[1].plot([i * d["bin_us"] for i in range(len(s))], s, label=f'paths {r["paths"]}')
    axes[1].axhline(d["bisection_gbps"], color="gray", ls="--", lw=0.8)
    axes[1].set_xlabel("µs since the post")
    axes[1].set_ylabel("aggregate goodput, Gbit/s")
    axes[1].legend()
    fig.suptitle(
        f'{d["leaves"]} leaves x {d["hosts_per_leaf"]} hosts, {d["spines"]} spines, '
        f'{d["link_gbps"]} Gbit/s'
    )
    save(fig, "sim_permutation.png")


def multiplane():
    d = load("multiplane")
    if not d:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    grouped = [r for r in d["runs"] if r["grouped_by_plane"]]
    hashed = [r for r in d["runs"] if not r["grouped_by_plane"] or r["planes"] == 1]
    one = grouped[0]["goodput_gbps"]
    xs = [r["planes"] for r in grouped]
    ax.plot(xs, [one * p for p in xs], "--", color="gray", label="linear (P x 1 plane)")
    ax.plot(xs, [0.9 * one * p for p in xs], ":", color="gray", label="90% of linear")
    ax.plot(xs, [r["goodput_gbps"] for r in grouped], "o-", label="paths grouped by plane")
    ax.plot([r["planes"] for r in hashed], [r["goodput_gbps"] for r in hashed], "s-",
            label="plane by 5-tuple hash")
    ax.set_xlabel("planes")
    ax.set_ylabel("aggregate goodput, Gbit/s")
    ax.set_xticks(xs)
    ax.legend()
    ax.set_title(f'{d["hosts"]} hosts, one 100 Gbit/s uplink per plane')
    save(fig, "sim_multiplane.png")


def plane_failure():
    d = load("plane_failure")
    if not d:
        return
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for r in d["runs"]:
        s = r["series_gbps"]
        # 50 µs moving average for readability.
        w = 5
        avg = [sum(s[max(0, i - w + 1): i + 1]) / min(w, i + 1) for i in range(len(s))]
        axes[0].plot([i * d["bin_us"] / 1000 for i in range(len(s))], avg, label=r["label"])
        axes[1].plot([t / 1000 for t in r["paths_on_failed_plane_us"]],
                     r["paths_on_failed_plane"], label=r["label"])
    for ax in axes:
        ax.axvspan(d["fail_at_us"] / 1000, d["up_at_us"] / 1000, color="red", alpha=0.08)
    axes[0].set_ylabel("goodput, Gbit/s (50 µs avg)")
    axes[0].legend()
    axes[1].set_ylabel(f'paths on plane {d["failed_plane"]}')
    axes[1].set_xlabel("ms since the post (shaded: plane down)")
    fig.suptitle(f'{d["planes"]} planes, {d["hosts"]} hosts: plane {d["failed_plane"]} fails and returns')
    save(fig, "sim_plane_failure.png")


if __name__ == "__main__":
    incast()
    permutation()
    multiplane()
    plane_failure()
