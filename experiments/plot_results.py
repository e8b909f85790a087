#!/usr/bin/env python3
"""Plots of experiments/netns/results.json (written by experiments/netns/run.sh).

    pip install matplotlib
    python3 experiments/plot_results.py [results.json] [outdir]

    python3 experiments/plot_results.py --collectives [collectives.json]

The second form plots experiments/sim/results/collectives.json (written by
`cargo run --release -p metaroce --features sim --example sim_collectives`) as
docs/results/sim_collectives.png: completion time over the ideal per collective, transport
and condition. It uses matplotlib when installed; otherwise it writes the bar chart as an SVG
by hand and converts it with ImageMagick's `convert` (the SVG stays beside the PNG).

Writes docs/results/exp1_paths.png, exp2_loss.png, exp3_stall.png, exp4_ecn.png and, when
experiments/netns/results-exp3x8.json exists (run.sh --reps 8 --only exp3 --tag exp3x8),
exp3_stall_runs.png; when experiments/netns/results-exp1r.json exists (run.sh --reps 10
--only exp1r --tag exp1r), exp1r_rebalance.png (with the two earlier exp1r runs beside it,
results-exp1r-8spares.json and results-exp1r-nodrain.json, when they exist).
"""

import json
import statistics
import sys
from pathlib import Path

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: E402
except ImportError:  # the --collectives plot has a hand-written SVG fallback
    plt = None

ROOT = Path(__file__).resolve().parent.parent
COLLECTIVES = "--collectives" in sys.argv[1:]
if COLLECTIVES:
    sys.argv.remove("--collectives")
RESULTS = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "experiments/netns/results.json"
OUT = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "docs/results"


def runs(doc, exp, field=None):
    return [r for r in doc["runs"] if r.get("exp") == exp and (field is None or field in r)]


def links_used(r):
    lb = [v["tx_bytes"] for k, v in r.get("links", {}).items() if k.startswith("to_b")]
    return sum(1 for v in lb if v > 0.05 * max(1, sum(lb)))


def steps_panel(ax, doc, exp, label):
    st = [r for r in doc["runs"] if r.get("exp") == exp and r.get("phases")]
    if not st:
        ax.set_visible(False)
        return
    levels = st[0]["levels"]
    xs = range(len(levels))
    for r, m in zip(st, "os^vD"):
        ax.plot(xs, [p["goodput_mbps"] for p in r["phases"]], marker=m, lw=1, ms=7 - 1.5 * r["rep"],
                label=f"run {r['rep']} ({r.get('links_used')} links)")
    ax.set_xticks(list(xs), [f"{lv}%" for lv in levels])
    ax.set_xlabel(label + " (phases of one connection, in order)")
    ax.set_ylabel("goodput [Mbit/s]")
    ax.set_ylim(0, doc["meta"]["capacity"]["goodput_ceiling_mbps"] * 1.08)
    ceiling_lines(ax, doc, single=False)
    ax.legend(fontsize=7, loc="lower left")
    return st


def ceiling_lines(ax, doc, single=True):
    cap = doc["meta"]["capacity"]
    ax.axhline(cap["goodput_ceiling_mbps"], color="grey", ls="--", lw=1)
    ax.text(0.01, cap["goodput_ceiling_mbps"], f" {doc['meta']['links']}-link ceiling", va="bottom",
            fontsize=8, color="grey", transform=ax.get_yaxis_transform())
    if single:
        one = cap["goodput_ceiling_mbps"] / doc["meta"]["links"]
        ax.axhline(one, color="grey", ls=":", lw=1)
        ax.text(0.01, one, " 1-link ceiling", va="bottom", fontsize=8, color="grey",
                transform=ax.get_yaxis_transform())


def subtitle(doc):
    m = doc["meta"]
    loads = [r["loadavg"][0] for r in doc["runs"]]
    return (f"{m['testbed']}; {m['reps']} runs each (bar = median, dots = runs); "
            f"loadavg {min(loads):.1f}-{max(loads):.1f} on {m['nproc']} cores")


def exp1(doc):
    rs = runs(doc, "exp1")
    if not rs:
        return
    paths = sorted({r["paths"] for r in rs})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1.2, 1]})
    for i, p in enumerate(paths):
        sel = [r for r in rs if r["paths"] == p and r.get("goodput_mbps") is not None]
        v = [r["goodput_mbps"] for r in sel]
        ax.bar(i, statistics.median(v), color="tab:blue", alpha=0.7)
        ax.scatter([i] * len(v), v, color="k", s=12, zorder=3)
        for r in sel:
            ax.annotate(f"{links_used(r)}L", (i, r["goodput_mbps"]), xytext=(5, -3),
                        textcoords="offset points", fontsize=7)
        ax.text(i, statistics.median(v) + 10, f"{statistics.median(v):.0f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(paths)), [str(p) for p in paths])
    ax.set_xlabel("paths (UDP source ports) of the one connection;  nL = R->B links the run used")
    ax.set_ylabel("write_bw goodput [Mbit/s]")
    ax.set_title("[1] goodput vs paths")
    ceiling_lines(ax, doc)
    # per-link share of the R->B bytes, every run of paths 1 and 8
    sel = [r for r in rs if r["paths"] in (1, 8)]
    sel.sort(key=lambda r: (r["paths"], r["rep"]))
    links = sorted(k for k in sel[0]["links"] if k.startswith("to_b"))
    bottom = [0.0] * len(sel)
    for li, l in enumerate(links):
        vals = [r["links"][l]["tx_bytes"] / 2**20 for r in sel]
        bx.bar(range(len(sel)), vals, bottom=bottom, label=f"link {li}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    bx.set_xticks(range(len(sel)), [f"p{r['paths']}\nrun {r['rep']}" for r in sel], fontsize=8)
    bx.set_ylabel("MiB forwarded R->B during the run")
    bx.set_title("per-link byte counters (ip -s link in R)")
    bx.legend(fontsize=8)
    fig.suptitle(subtitle(doc), fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "exp1_paths.png", dpi=120)


def exp2(doc):
    rs = runs(doc, "exp2", "loss_pct")
    if not rs:
        return
    names = {"metaroce": "MetaRoCE, 8 paths", "rocev2": "RoCEv2 mode (1 QP, go-back-N)",
             "tcp1": "TCP bbr (default), 1 flow", "tcp8": "TCP bbr (default), 8 flows",
             "tcp1cubic": "TCP cubic, 1 flow", "tcp8cubic": "TCP cubic, 8 flows"}
    tools = [t for t in names if any(r["variant"] == t for r in rs)]
    losses = sorted({r["loss_pct"] for r in rs})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(16, 5), gridspec_kw={"width_ratios": [2, 1]})
    w = 0.85 / len(tools)
    for ti, t in enumerate(tools):
        for li, loss in enumerate(losses):
            sel = [r for r in rs if r["variant"] == t and r["loss_pct"] == loss and r.get("goodput_mbps") is not None]
            v = [r["goodput_mbps"] for r in sel]
            if not v:
                continue
            x = li + (ti - (len(tools) - 1) / 2) * w
            ax.bar(x, statistics.median(v), w * 0.95, color=f"C{ti}", alpha=0.75,
                   label=names[t] if li == 0 else None)
            ax.scatter([x] * len(v), v, color="k", s=10, zorder=3)
            ax.text(x, statistics.median(v) + 8, f"{statistics.median(v):.0f}", ha="center", fontsize=7)
            if t in ("metaroce", "tcp8", "tcp8cubic"):
                for r in sel:
                    ax.annotate(f"{links_used(r)}L", (x, r["goodput_mbps"]), xytext=(3, -3),
                                textcoords="offset points", fontsize=6)
    ax.set_xticks(range(len(losses)), [f"{l}% random drop\n(every R->B link)" for l in losses])
    ax.set_ylabel("goodput [Mbit/s]")
    ax.set_title("[2] independent runs: MetaRoCE beside RoCEv2 mode and kernel TCP (nL = links used)")
    ceiling_lines(ax, doc)
    ax.set_ylim(0, 1000)
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    steps_panel(bx, doc, "exp2", "random drop")
    bx.set_title("[2b] MetaRoCE: loss steps within one connection")
    fig.suptitle(subtitle(doc), fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "exp2_loss.png", dpi=120)


def pick_median_run(rs, key):
    rs = sorted((r for r in rs if r.get(key) is not None), key=lambda r: r[key])
    return rs[len(rs) // 2] if rs else None


def exp3(doc):
    rs = runs(doc, "exp3")
    if not rs:
        return
    variants = list(dict.fromkeys(r["variant"] for r in rs))
    fig, axes = plt.subplots(len(variants), 2, figsize=(13, 2.3 * len(variants)), squeeze=False)
    for vi, v in enumerate(variants):
        r = pick_median_run([x for x in rs if x["variant"] == v], "stall_ms")
        ax, bx = axes[vi]
        if r is None or not r.get("raw"):
            continue
        d = json.loads((ROOT / r["raw"]).read_text())
        tf, tr = r["fail_at_s"], r["restore_at_s"]
        binw = d["bin_ms"] / 1e3
        tl = d["timeline_bytes"]
        xs = [i * binw - tf for i in range(len(tl))]
        ax.plot(xs, [b * 8 / binw / 1e6 for b in tl], lw=0.7)
        ax.axvline(0, color="r", lw=1)
        ax.axvline(tr - tf, color="g", lw=1)
        ax.set_ylabel("Mbit/s\n(10 ms bins)", fontsize=8)
        ax.set_title(f"{v} (run {r['rep']}): goodput; red = failure, green = restore", fontsize=9)
        ax.set_xlim(-1.5, tr - tf + 1.5)
        c = d["completion_s"]
        gx = [c[i] - tf for i in range(1, len(c))]
        gy = [(c[i] - c[i - 1]) * 1e3 for i in range(1, len(c))]
        bx.scatter(gx, gy, s=3)
        for st, late in d.get("sched", {}).get("late_wakeups", []):
            if late >= 5:
                bx.axvspan(st + 0.001 - tf, st + 0.001 + late / 1e3 - tf, color="orange", alpha=0.4, lw=0)
        bx.axvline(0, color="r", lw=1)
        bx.axvline(tr - tf, color="g", lw=1)
        bx.axhline(50, color="grey", ls="--", lw=0.8)
        bx.set_xlim(-0.3, 0.7)
        bx.set_ylabel("gap to previous\ncompletion [ms]", fontsize=8)
        bx.set_title(f"stall {r['stall_ms']} ms, rerolls {r['sum_rerolls']}, timeouts {r['sum_timeouts']}, "
                     f"errors {r['app_errors']}; orange = client not scheduled", fontsize=9)
    axes[-1][0].set_xlabel("seconds since the failure")
    axes[-1][1].set_xlabel("seconds since the failure (zoom)")
    fig.suptitle("[3] " + subtitle(doc), fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "exp3_stall.png", dpi=110)


def exp4(doc):
    rs = runs(doc, "exp4", "ce_pct")
    if not rs:
        return
    pcts = sorted({r["ce_pct"] for r in rs})
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(16, 4.3))
    for t, name, col in (("metaroce", "MetaRoCE, 8 paths", "C0"), ("tcp8ecn", "TCP bbr 8 flows, tcp_ecn=1", "C3"),
                         ("tcp8cubicecn", "TCP cubic 8 flows, tcp_ecn=1", "C2")):
        if not any(r["variant"] == t for r in rs):
            continue
        med, allx, ally = [], [], []
        for p in pcts:
            sel = [r for r in rs if r["variant"] == t and r["ce_pct"] == p and r.get("goodput_mbps") is not None]
            v = [r["goodput_mbps"] for r in sel]
            med.append(statistics.median(v) if v else None)
            allx += [p] * len(v)
            ally += v
            for r in sel:
                ax.annotate(f"{links_used(r)}L", (p, r["goodput_mbps"]), xytext=(3, -3),
                            textcoords="offset points", fontsize=6, color=col)
        ax.plot(pcts, med, "o-", color=col, label=name + " (median)")
        ax.scatter(allx, ally, color=col, s=10, alpha=0.5)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(pcts, [str(p) for p in pcts])
    ax.set_xlabel("CE-marked share of R->B packets [%] (random, nft)")
    ax.set_ylabel("goodput [Mbit/s]")
    ax.set_title("[4] independent runs (nL = links used)")
    ax.set_ylim(0, doc["meta"]["capacity"]["goodput_ceiling_mbps"] * 1.08)
    ceiling_lines(ax, doc, single=False)
    ax.legend(fontsize=7, loc="lower left")
    st = steps_panel(bx, doc, "exp4", "CE marks")
    bx.set_title("[4b] MetaRoCE: CE steps within one connection")
    if st:
        levels = st[0]["levels"]
        for r in st:
            cx.plot(range(len(levels)), [p.get("mean_path_window") for p in r["phases"]], "o-", lw=1,
                    label=f"window, run {r['rep']}")
        cx2 = cx.twinx()
        for r in st:
            cx2.plot(range(len(levels)), [p.get("mean_srtt_us", 0) / 1e3 for p in r["phases"]], "x--", lw=0.8,
                     color="grey")
        cx2.set_ylabel("mean SRTT [ms] (grey, dashed)")
        cx2.set_ylim(0, None)
        cx.set_xticks(range(len(levels)), [f"{lv}%" for lv in levels])
        cx.set_ylabel("mean per-path window [packets]")
        cx.set_ylim(0, None)
        cx.set_xlabel("CE marks (phases of one connection)")
        cx.set_title("[4b] per-path window and SRTT per phase")
        cx.legend(fontsize=7, loc="lower left")
    fig.suptitle(subtitle(doc), fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "exp4_ecn.png", dpi=120)


def exp3_dist(path):
    """Stall of every run of the extended failure experiment, per variant."""
    if not path.exists():
        return
    doc = json.loads(path.read_text())
    rs = runs(doc, "exp3")
    variants = list(dict.fromkeys(r["variant"] for r in rs))
    fig, ax = plt.subplots(figsize=(11, 4.2))
    for i, v in enumerate(variants):
        sel = [r for r in rs if r["variant"] == v]
        for key, dx, col, lab in (("stall_ms", -0.15, "C3", "failure: longest completion gap"),
                                  ("restore_stall_ms", 0.15, "C2", "restore: longest completion gap")):
            ys = [r.get(key) for r in sel if r.get(key) is not None]
            ax.scatter([i + dx] * len(ys), ys, color=col, s=14, label=lab if i == 0 else None)
            if ys:
                ax.hlines(statistics.median(ys), i + dx - 0.1, i + dx + 0.1, color=col)
        ys = [r.get("noise_max_gap_ms") for r in sel if r.get("noise_max_gap_ms") is not None]
        ax.scatter([i] * len(ys), ys, color="grey", marker="_", s=60,
                   label="largest gap elsewhere in the run (noise)" if i == 0 else None)
    ax.set_yscale("log")
    ax.axhline(50, color="k", ls="--", lw=0.8)
    ax.text(len(variants) - 0.5, 52, "50 ms target", fontsize=8, ha="right")
    ax.set_xticks(range(len(variants)), [v.replace("_", "\n") for v in variants], fontsize=8)
    ax.set_ylabel("ms (log)")
    ax.set_title(f"[3] link failure: stall of every run ({doc['meta']['reps']} runs per variant; bar = median)")
    ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(subtitle(doc), fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "exp3_stall_runs.png", dpi=120)


def exp1r(path, extra=()):
    """paths-8 / paths-1 ratio of every run, ECMP collision handling off and on."""
    sets = []
    for label, p in ((None, path), *extra):
        if p.exists():
            sets.append((label, json.loads(p.read_text())))
    if not sets or not runs(sets[0][1], "exp1r"):
        return
    fig, ax = plt.subplots(figsize=(11, 4.8))
    cols = []
    for label, doc in sets:
        rs = runs(doc, "exp1r")
        p1 = statistics.median(r["goodput_mbps"] for r in rs if r["variant"] == "paths1")
        for v, name in (("paths8_off", "8 paths, off\n(--no-rebalance)"), ("paths8_on", "8 paths, on")):
            name += f"\n({len([r for r in rs if r['variant'] == v])} runs)"
            sel = [r for r in rs if r["variant"] == v and r.get("goodput_mbps") is not None]
            cols.append((name + f"\n{label or 'final'}", sel, p1))
    for i, (name, sel, p1) in enumerate(cols):
        x = [r["goodput_mbps"] / p1 for r in sel]
        colors = ["tab:red" if links_used(r) < 4 else "tab:blue" for r in sel]
        ax.bar(i, statistics.median(x), color="lightgrey")
        ax.scatter([i + 0.12 * ((k % 5) - 2) for k in range(len(x))], x, c=colors, s=18, zorder=3)
        ax.text(i, statistics.median(x) + 0.05, f"{statistics.median(x):.2f}x", ha="center", fontsize=8)
        ax.text(i, 0.2, f">= 3.4x: {sum(1 for v in x if v >= 3.4)}/{len(x)}", ha="center", fontsize=8)
    ax.axhline(3.4, color="k", ls="--", lw=1)
    ax.text(len(cols) - 0.5, 3.4, "target 3.4x", va="bottom", ha="right", fontsize=8)
    ax.set_xticks(range(len(cols)), [c[0] for c in cols], fontsize=8)
    ax.set_ylabel("goodput / median goodput of paths 1")
    ax.set_ylim(0, 4.6)
    ax.set_title("[1r] ECMP collision handling: each dot one connection with fresh ports "
                 "(red: used 3 links, blue: 4)", fontsize=9)
    fig.suptitle(subtitle(sets[0][1]), fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "exp1r_rebalance.png", dpi=120)


COND_COLORS = {
    "clean": "#4c72b0",
    "1% loss": "#dd8452",
    "failed spine link": "#c44e52",
    "failed, short timeout": "#8172b3",
}


def collectives(path):
    """Completion time / ideal, grouped by (collective, transport), one bar per condition,
    log scale."""
    import math
    import subprocess

    doc = json.loads(path.read_text())
    runs = doc["runs"]
    groups = []
    for r in runs:
        g = (r["collective"], r["transport"])
        if g not in groups:
            groups.append(g)
    conds = []
    for r in runs:
        if r["condition"] not in conds:
            conds.append(r["condition"])
    val = {(r["collective"], r["transport"], r["condition"]): r["ratio_to_ideal"] for r in runs}
    ok = {(r["collective"], r["transport"], r["condition"]): r["data_ok"] for r in runs}
    # A failed run (an RC QP in the error state): its bar is the time it failed.
    failed = {(r["collective"], r["transport"], r["condition"]) for r in runs if r.get("failed")}
    title = (f"{doc['hosts']} hosts, {doc['planes']} planes, "
             f"{doc['host_gbps_per_plane']} Gbit/s per host per plane: completion time / ideal")
    png = OUT / "sim_collectives.png"
    OUT.mkdir(parents=True, exist_ok=True)
    if plt is not None:
        fig, ax = plt.subplots(figsize=(12, 5))
        w = 0.8 / len(conds)
        for ci, c in enumerate(conds):
            xs = [gi + ci * w for gi in range(len(groups))]
            ys = [val.get((g[0], g[1], c), float("nan")) for g in groups]
            bars = ax.bar(xs, ys, w, label=c, color=COND_COLORS.get(c))
            for g, b, yv in zip(groups, bars, ys):
                if (g[0], g[1], c) in failed:
                    b.set_hatch("//")
                    ax.text(b.get_x() + b.get_width() / 2, yv * 1.1, "QP\nerror",
                            ha="center", va="bottom", fontsize=6)
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([gi + 0.4 - w / 2 for gi in range(len(groups))])
        ax.set_xticklabels([f"{a}\n{b}" for a, b in groups])
        ax.set_ylabel("time / ideal (log); hatched: failed (time of the QP error)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        print("wrote", png)
        return
    # Hand-written SVG: log-scale bars from 1x to the next power of ten above the maximum.
    W, H, L, R, T, B = 1000, 460, 70, 20, 40, 80
    top = 10 ** math.ceil(math.log10(max(max(val.values()), 1.0001)))
    def y(v):
        v = max(v, 1.0)
        return T + (H - T - B) * (1 - math.log10(v) / math.log10(top))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>']
    d = 1
    while d <= top:
        yy = y(d)
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#ccc"/>')
        out.append(f'<text x="{L - 6}" y="{yy + 4:.1f}" text-anchor="end">{d}x</text>')
        d *= 10
    out.append(f'<text x="16" y="{(H - B + T) / 2}" transform="rotate(-90 16 {(H - B + T) / 2})" '
               f'text-anchor="middle">time / ideal (log)</text>')
    gw = (W - L - R) / len(groups)
    bw = gw * 0.8 / len(conds)
    for gi, g in enumerate(groups):
        x0 = L + gi * gw + gw * 0.1
        for ci, c in enumerate(conds):
            v = val.get((g[0], g[1], c))
            if v is None:
                continue
            x = x0 + ci * bw
            yy = y(v)
            out.append(f'<rect x="{x:.1f}" y="{yy:.1f}" width="{bw - 2:.1f}" '
                       f'height="{H - B - yy:.1f}" fill="{COND_COLORS.get(c, "#777")}"/>')
            label = f"{v:.1f}" + ("" if ok.get((g[0], g[1], c)) else
                                  " QP error" if (g[0], g[1], c) in failed else " BAD")
            out.append(f'<text x="{x + bw / 2 - 1:.1f}" y="{yy - 4:.1f}" text-anchor="middle" '
                       f'font-size="10">{label}</text>')
        cx = L + gi * gw + gw / 2
        out.append(f'<text x="{cx:.1f}" y="{H - B + 18}" text-anchor="middle">{g[0]}</text>')
        out.append(f'<text x="{cx:.1f}" y="{H - B + 34}" text-anchor="middle">{g[1]}</text>')
    lx = L
    for c in conds:
        out.append(f'<rect x="{lx}" y="{H - 24}" width="12" height="12" '
                   f'fill="{COND_COLORS.get(c, "#777")}"/>')
        out.append(f'<text x="{lx + 16}" y="{H - 14}">{c}</text>')
        lx += 40 + 8 * len(c)
    out.append("</svg>")
    svg = OUT / "sim_collectives.svg"
    svg.write_text("\n".join(out) + "\n")
    print("wrote", svg)
    try:
        subprocess.run(["convert", str(svg), str(png)], check=True)
        print("wrote", png)
    except (OSError, subprocess.CalledProcessError) as e:
        print("no PNG (install matplotlib or ImageMagick):", e)


def main():
    if COLLECTIVES:
        default = ROOT / "experiments/sim/results/collectives.json"
        collectives(RESULTS if len(sys.argv) > 1 else default)
        return
    doc = json.loads(RESULTS.read_text())
    OUT.mkdir(parents=True, exist_ok=True)
    exp1(doc)
    exp2(doc)
    exp3(doc)
    exp4(doc)
    exp3_dist(RESULTS.parent / "results-exp3x8.json")
    exp1r(RESULTS.parent / "results-exp1r.json",
          (("8 spare ports", RESULTS.parent / "results-exp1r-8spares.json"),
           ("no drain, 8 spares", RESULTS.parent / "results-exp1r-nodrain.json")))
    print("plots in", OUT)


if __name__ == "__main__":
    main()
