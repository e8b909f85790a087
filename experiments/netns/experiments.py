#!/usr/bin/env python3
"""MetaRoCE on a kernel ECMP network: the measurement matrix behind `run.sh`.

`run.sh` builds the binaries, brings the testbed (netns-ecmp.sh) up and tears it down; this
script runs every measurement inside the namespaces, keeps the raw outputs under
`experiments/netns/raw/`, writes `experiments/netns/results.json` and prints the tables.

    experiments.py [--reps 3] [--only exp1,exp2,exp3,exp4] [--tag NAME]
    experiments.py --summarize        # re-print the tables from results.json

Nothing is sent outside the three namespaces: every program runs under `ip netns exec`.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TB = os.environ.get("TESTBED", "/work/shared/testbed/netns-ecmp.sh")
PFX = os.environ.get("PFX", "xp-")
LINKS = int(os.environ.get("LINKS", "4"))
RATE = os.environ.get("RATE", "200mbit")
MTU = int(os.environ.get("MTU", "9000"))
# MetaRoCE path MTU (payload per packet): 4096 needs jumbo veths; 1024 fits MTU 1500.
PMTU = int(os.environ.get("PMTU", "4096" if MTU >= 4200 else "1024"))
NA, NR, NB = PFX + "a", PFX + "r", PFX + "b"
A_IP, B_IP = "10.77.0.1", "10.77.0.2"
PERF = Path(os.environ.get("PERF", ROOT / "target/release/metaroce-perf"))
STALL = Path(os.environ.get("STALL", ROOT / "target/release/examples/exp_stall"))
RAW = HERE / "raw"  # set by --tag
RESULTS = HERE / "results.json"

PERF_SECS = 4  # metaroce-perf -D
TCP_SECS = 4  # iperf3 -t
STALL_SECS = 6.0  # exp_stall --duration
FAIL_AT = 2.0  # seconds after launching the stall client
RESTORE_AFTER = 2.0  # seconds after the failure
WRITE_SIZE = 65536

LIVE = []  # processes started by this script, killed (by pid) on an abnormal exit


def log(*a):
    print(*a, file=sys.stderr, flush=True)


NICE = int(os.environ.get("NICE", "0"))  # nice value of the measured programs (0 = as is)


def nsx(ns, args):
    return ["ip", "netns", "exec", ns, *map(str, args)]


def nsx_prog(ns, args):
    """A measured program: under `nice -n NICE` when NICE is set (nice execs: same pid)."""
    pre = ["nice", "-n", str(NICE)] if NICE else []
    return nsx(ns, [*pre, *args])


def sh(args, check=True, env=None):
    r = subprocess.run(list(map(str, args)), capture_output=True, text=True, env=env)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))}: rc {r.returncode}: {r.stderr.strip()}")
    return r


def tb(*args):
    env = dict(os.environ, PFX=PFX, LINKS=str(LINKS))
    return sh([TB, *args], env=env).stdout.strip()


def rate_bps(rate):
    r = rate.lower()
    for suf, mul in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if r.endswith(suf):
            return float(r[: -len(suf)]) * mul
    return float(r)


# ---------------------------------------------------------------- processes and counters


class Proc:
    """A program in a namespace; `reap` returns its exit code and CPU seconds (wait4)."""

    def __init__(self, ns, args, tag):
        self.out_path = RAW / f"{tag}.out"
        self.err_path = RAW / f"{tag}.err"
        self.out = open(self.out_path, "wb")
        self.err = open(self.err_path, "wb")
        self.p = subprocess.Popen(nsx_prog(ns, args), stdout=self.out, stderr=self.err)
        self.t0 = time.monotonic()
        LIVE.append(self)

    def reap(self, timeout):
        deadline = time.monotonic() + timeout
        killed = False
        while True:
            pid, status, ru = os.wait4(self.p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                os.kill(self.p.pid, signal.SIGKILL)
                pid, status, ru = os.wait4(self.p.pid, 0)
                killed = True
                break
            time.sleep(0.02)
        self.p.returncode = os.waitstatus_to_exitcode(status)
        self.out.close()
        self.err.close()
        LIVE.remove(self)
        return {
            "rc": self.p.returncode,
            "killed": killed,
            "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
            "wall_s": round(time.monotonic() - self.t0, 3),
        }

    def stdout(self):
        return self.out_path.read_text(errors="replace")

    def stderr(self):
        return self.err_path.read_text(errors="replace")


def kill_live():
    for p in list(LIVE):
        try:
            os.kill(p.p.pid, signal.SIGKILL)
            os.wait4(p.p.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        LIVE.remove(p)


def link_stats():
    """R's per-link tx counters (to_b* = A->B data direction, to_a* = B->A) and tbf drops."""
    links = json.loads(sh(nsx(NR, ["ip", "-j", "-s", "link", "show"])).stdout)
    d = {}
    for l in links:
        name = l["ifname"]
        if name.startswith("to_"):
            tx = l["stats64"]["tx"]
            d[name] = {"tx_bytes": tx["bytes"], "tx_packets": tx["packets"], "qdisc_drops": 0}
    for q in json.loads(sh(nsx(NR, ["tc", "-j", "-s", "qdisc", "show"])).stdout):
        if q.get("kind") == "tbf" and q.get("dev") in d:
            d[q["dev"]]["qdisc_drops"] = q.get("drops", 0)
    return d


def nft_packets(table):
    """Packets counted by every rule of `inet table` in R (0 if the table does not exist)."""
    r = sh(nsx(NR, ["nft", "-j", "list", "table", "inet", table]), check=False)
    if r.returncode != 0:
        return 0
    n = 0
    for obj in json.loads(r.stdout)["nftables"]:
        for e in obj.get("rule", {}).get("expr", []):
            if "counter" in e:
                n += e["counter"]["packets"]
    return n


def arp_unresolved_discards():
    """Packets the kernel dropped while waiting for ARP resolution (unres_qlen exceeded),
    summed over CPUs. The neighbour table statistics are kernel-global, not per namespace;
    nothing else on this machine forwards traffic, so the deltas are ours."""
    with open("/proc/net/stat/arp_cache") as f:
        head = f.readline().split()
        col = head.index("unresolved_discards")
        return sum(int(line.split()[col], 16) for line in f if line.strip())


def cpu_snapshot():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return idle, sum(v[:8])


def loadavg():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


class Window:
    """Machine CPU, load and link counters over one measurement."""

    def __init__(self):
        self.load = loadavg()
        self.cpu = cpu_snapshot()
        self.links = link_stats()
        self.nft = {t: nft_packets(t) for t in ("tbloss", "tbecn", "xptcploss")}
        self.t = time.monotonic()

    def close(self):
        idle, total = cpu_snapshot()
        links = link_stats()
        di, dt = idle - self.cpu[0], total - self.cpu[1]
        delta = {
            k: {f: links[k][f] - self.links[k].get(f, 0) for f in links[k]}
            for k in sorted(links)
            if k in self.links
        }
        return {
            "loadavg": self.load,
            "machine_cpu_busy_pct": round(100.0 * (1 - di / dt), 1) if dt else None,
            "wall_s": round(time.monotonic() - self.t, 3),
            "links": delta,
            "nft_packets": {t: nft_packets(t) - n for t, n in self.nft.items()},
        }


# ---------------------------------------------------------------- impairments


def set_loss(pct):
    """`netns-ecmp.sh loss` drops UDP only; the same rule for TCP goes in a table of ours."""
    tb("loss", str(pct))
    sh(nsx(NR, ["nft", "delete", "table", "inet", "xptcploss"]), check=False)
    ppm = int(pct * 10000 + 0.5)
    if ppm <= 0:
        return
    sh(nsx(NR, ["nft", "add", "table", "inet", "xptcploss"]))
    sh(nsx(NR, ["nft", "add", "chain", "inet", "xptcploss", "lossy",
                "{ type filter hook forward priority 0; policy accept; }"]))
    for i in range(LINKS):
        sh(nsx(NR, ["nft", "add", "rule", "inet", "xptcploss", "lossy", "oifname", f"to_b{i}",
                    "meta", "l4proto", "tcp", "numgen", "random", "mod", "1000000", "lt",
                    str(ppm), "counter", "drop"]))


def resolve_neighbours():
    """Re-resolve ARP on every link (as netns-ecmp.sh up does): a link that was down lost its
    neighbour entries, and the first burst on it would wait in the unresolved queue."""
    for i in range(LINKS):
        sh(nsx(NA, ["ping", "-c1", "-W1", f"10.77.{100 + i}.2"]), check=False)
        sh(nsx(NB, ["ping", "-c1", "-W1", f"10.77.{200 + i}.1"]), check=False)
        sh(nsx(NR, ["ping", "-c1", "-W1", f"10.77.{100 + i}.1"]), check=False)
        sh(nsx(NR, ["ping", "-c1", "-W1", f"10.77.{200 + i}.2"]), check=False)


def set_tcp_ecn(v):
    for ns in (NA, NB):
        sh(nsx(ns, ["sysctl", "-qw", f"net.ipv4.tcp_ecn={v}"]))


# ---------------------------------------------------------------- one measurement each


def mbps_of_mib(mb_per_sec):
    return mb_per_sec * 1048576 * 8 / 1e6


def run_perf(tag, paths, extra=(), mode=None, mid_at=None):
    """metaroce-perf write_bw, 64 KiB WRITEs for PERF_SECS, server in B, client in A.
    With `mid_at` (seconds after the client starts), R's link counters are also read then,
    and `links_late` holds what each link carried from then to the end."""
    out_json = RAW / f"{tag}.json"
    common = ["--mtu", PMTU] + (["--paths", paths] if paths else []) + (["--mode", mode] if mode else [])
    srv = Proc(NB, [PERF, "--server", "--bind", B_IP, "-p", 4791, *common], tag + ".server")
    time.sleep(0.4)
    w = Window()
    target = B_IP if mode == "rocev2" else f"{B_IP}:4791"  # rocev2: host only (OOB over TCP)
    cli = Proc(NA, [PERF, target, "-D", PERF_SECS, "-s", WRITE_SIZE, "--out_json", out_json,
                    *common, *extra], tag + ".client")
    mid = None
    if mid_at is not None:
        time.sleep(mid_at)
        mid = link_stats()
    c = cli.reap(PERF_SECS + 60)
    win = w.close()
    if mid is not None:
        end = link_stats()
        win["links_late"] = {k: {"tx_bytes": end[k]["tx_bytes"] - mid[k]["tx_bytes"]}
                             for k in sorted(end) if k in mid}
    s = srv.reap(15)
    rec = {"tool": "metaroce-perf" + (f" --mode {mode}" if mode else ""), "paths": paths,
           "client": c, "server": s, **win}
    try:
        doc = json.loads(out_json.read_text())
        r = doc["results"][0]
        rec.update(
            goodput_mbps=round(mbps_of_mib(r["bw_avg_mb_per_sec"]), 1),
            peak_mbps=round(mbps_of_mib(r["bw_peak_mb_per_sec"]), 1),
            elapsed_s=r["elapsed_sec"],
            verified=doc.get("verified"),
            retransmits=doc.get("retransmits"),
            probes=doc.get("tail_loss_probes"),
            path_stats=[p for p in doc.get("path_stats", []) if p.get("direction") == "client_to_server"],
        )
    except (OSError, ValueError, KeyError, IndexError) as e:
        rec.update(goodput_mbps=None, error=f"{e}; stderr: {cli.stderr()[-400:]}")
    if c["rc"] != 0 and "error" not in rec:
        rec["error"] = f"client rc {c['rc']}: {cli.stderr()[-400:]}"
    return rec


def run_tcp(tag, streams, cc=None):
    """iperf3 TCP from A to B, `streams` parallel flows; congestion control `cc` (iperf3 -C)
    or the namespaces' default (this kernel's: bbr)."""
    srv = Proc(NB, ["iperf3", "-s", "-1", "-B", B_IP, "-p", 5201], tag + ".server")
    time.sleep(0.3)
    w = Window()
    cli = Proc(NA, ["iperf3", "-c", B_IP, "-B", A_IP, "-p", 5201, "-t", TCP_SECS, "-P", streams,
                    "-J", *(["-C", cc] if cc else [])], tag + ".client")
    c = cli.reap(TCP_SECS + 30)
    win = w.close()
    s = srv.reap(10)
    rec = {"tool": f"iperf3 TCP -P {streams}" + (f" -C {cc}" if cc else ""), "streams": streams,
           "client": c, "server": s, **win}
    try:
        doc = json.loads(cli.stdout())
        e = doc["end"]
        rec.update(
            goodput_mbps=round(e["sum_received"]["bits_per_second"] / 1e6, 1),
            retransmits=e["sum_sent"].get("retransmits"),
            congestion=e.get("sender_tcp_congestion"),
        )
    except (ValueError, KeyError) as ex:
        rec.update(goodput_mbps=None, error=f"{ex}: {cli.stdout()[-300:]} {cli.stderr()[-300:]}")
    return rec


def stall_knob_args(knobs):
    a = []
    for k, v in knobs.items():
        a += [f"--{k.replace('_', '-')}", v]
    return a


def cpu_overlap_ms(events, t0, t1):
    """How long the scheduling probe's late wake-ups (start, late_ms) overlap (t0, t1):
    a wake-up due at start+1 ms that came late_ms late means no CPU for that span."""
    tot = 0.0
    for st, late in events:
        a, b = st + 0.001, st + 0.001 + late / 1e3
        tot += max(0.0, min(b, t1) - max(a, t0))
    return round(tot * 1e3, 2)


def gap_analysis(c, t_fail, t_restore, size, sched_cli=(), sched_srv=()):
    """Gaps between consecutive completions; windows of 1 s after failure and restore.
    sched_*: late wake-ups of the client's / server's scheduling probe (relative times)."""
    gaps = [(c[i] - c[i - 1], c[i - 1], c[i]) for i in range(1, len(c))]

    def overlapping(t0, t1):
        return [g for g in gaps if g[2] > t0 and g[1] < t1]

    def rate(t0, t1):
        n = sum(1 for t in c if t0 <= t < t1)
        return round(n * size * 8 / (t1 - t0) / 1e6, 1) if t1 > t0 else None

    out = {}
    fw = overlapping(t_fail, t_fail + 1.0)
    rw = overlapping(t_restore, t_restore + 1.0)
    f = max(fw, default=None)
    r = max(rw, default=None)
    out["stall_ms"] = round(f[0] * 1e3, 2) if f else None
    out["stall_at_s"] = round(f[1], 4) if f else None
    out["stall_after_fail_ms"] = round((f[1] - t_fail) * 1e3, 2) if f else None
    out["restore_stall_ms"] = round(r[0] * 1e3, 2) if r else None
    excl = set(fw) | set(rw)
    steady = [g for g in gaps if g[1] >= 0.5 and g not in excl]
    out["noise_max_gap_ms"] = round(max(steady)[0] * 1e3, 2) if steady else None
    sg = sorted(g[0] for g in steady)
    out["noise_p99_gap_ms"] = round(sg[int(0.99 * (len(sg) - 1))] * 1e3, 2) if sg else None
    out["goodput_before_mbps"] = rate(t_fail - 1.0, t_fail)
    out["goodput_after_mbps"] = rate(t_fail, t_fail + 1.0)
    out["goodput_restored_mbps"] = rate(t_restore + 0.2, t_restore + 1.2)
    out["gaps_over_10ms_in_fail_window"] = sum(1 for g in fw if g[0] > 0.010)
    # CPU starvation during the gaps: how long the client's / server's probe thread could
    # not run inside the gap.
    for name, g in (("stall", f), ("restore_stall", r), ("noise_max_gap", max(steady) if steady else None)):
        if g:
            out[f"{name}_cpu_starved_ms"] = max(cpu_overlap_ms(sched_cli, g[1], g[2]),
                                                cpu_overlap_ms(sched_srv, g[1], g[2]))
    # The longest gap in the failure window that the probes do not explain (gap minus the
    # longer of the two starvation overlaps).
    net = [(g[0] * 1e3 - max(cpu_overlap_ms(sched_cli, g[1], g[2]), cpu_overlap_ms(sched_srv, g[1], g[2])), g[1])
           for g in fw]
    out["stall_net_of_cpu_ms"] = round(max(net)[0], 2) if net else None
    ns = [g[0] * 1e3 - max(cpu_overlap_ms(sched_cli, g[1], g[2]), cpu_overlap_ms(sched_srv, g[1], g[2]))
          for g in steady]
    out["noise_net_of_cpu_max_ms"] = round(max(ns), 2) if ns else None
    return out


def run_stall(tag, variant, knobs):
    """exp_stall with a failure of the busiest R->B link FAIL_AT s into the transfer.

    variant: control (nothing happens), fail (netns-ecmp.sh fail L: R's link down, ECMP
    re-hashes at once), blackhole (netns-ecmp.sh loss 100 L: the link silently drops every
    UDP packet, routes unchanged: only the transport's path re-roll gets around it)."""
    out_json = RAW / f"{tag}.json"
    kargs = stall_knob_args(knobs) + ["--mtu", PMTU]
    srv = Proc(NB, [STALL, "--listen", f"{B_IP}:4791", *kargs], tag + ".server")
    time.sleep(0.4)
    w = Window()
    cli = Proc(NA, [STALL, "--connect", f"{B_IP}:4791", "--duration", STALL_SECS, "--size",
                    WRITE_SIZE, "--out", out_json, *kargs], tag + ".client")
    time.sleep(FAIL_AT - 0.8)
    c0 = link_stats()
    time.sleep(0.8)
    c1 = link_stats()
    busiest = max(range(LINKS), key=lambda i: c1[f"to_b{i}"]["tx_packets"] - c0[f"to_b{i}"]["tx_packets"])
    share = {f"to_b{i}": c1[f"to_b{i}"]["tx_packets"] - c0[f"to_b{i}"]["tx_packets"] for i in range(LINKS)}
    arp0 = arp_unresolved_discards()
    t_fail0 = time.time()
    if variant == "fail":
        tb("fail", str(busiest))
    elif variant == "blackhole":
        tb("loss", "99.9999", str(busiest))  # nft numgen needs < 1000000 ppm
    t_fail1 = time.time()
    time.sleep(RESTORE_AFTER)
    arp1, c2 = arp_unresolved_discards(), link_stats()
    t_rest0 = time.time()
    if variant == "fail":
        tb("restore", str(busiest))
    elif variant == "blackhole":
        tb("loss", "0")
    t_rest1 = time.time()
    time.sleep(0.5)
    arp2, c3 = arp_unresolved_discards(), link_stats()
    c = cli.reap(STALL_SECS + 60)
    win = w.close()
    s = srv.reap(15)
    rec = {"tool": "exp_stall", "variant": variant, "knobs": knobs, "failed_link": busiest,
           "link_packets_before_fail": share, "client": c, "server": s,
           "arp_unresolved_discards_fail_window": arp1 - arp0,
           "arp_unresolved_discards_restore_0.5s": arp2 - arp1,
           "qdisc_drops_fail_window": sum(c2[k]["qdisc_drops"] - c1[k]["qdisc_drops"] for k in c1),
           "qdisc_drops_restore_0.5s": sum(c3[k]["qdisc_drops"] - c2[k]["qdisc_drops"] for k in c2),
           **win}
    try:
        doc = json.loads(out_json.read_text())
    except (OSError, ValueError) as e:
        rec.update(error=f"{e}; rc {c['rc']}; stderr {cli.stderr()[-400:]}")
        return rec
    st = doc["start_unix"]
    t_fail, t_rest = t_fail0 - st, t_rest0 - st
    sched_cli = [tuple(x) for x in doc.get("sched", {}).get("late_wakeups", [])]
    sched_srv = []
    try:
        sdoc = json.loads(srv.stdout().strip().splitlines()[-1])
        sched_srv = [(u - st, l) for u, l in sdoc.get("sched", {}).get("late_wakeups", [])]
        rec["server_sched_max_late_ms"] = sdoc.get("sched", {}).get("max_late_ms")
    except (ValueError, IndexError):
        pass
    rec["client_sched_max_late_ms"] = doc.get("sched", {}).get("max_late_ms")
    rec.update(
        fail_at_s=round(t_fail, 4),
        fail_cmd_ms=round((t_fail1 - t_fail0) * 1e3, 1),
        restore_at_s=round(t_rest, 4),
        restore_cmd_ms=round((t_rest1 - t_rest0) * 1e3, 1),
        goodput_mbps=round(doc["goodput_mbps"], 1),
        completions=doc["completions"],
        app_errors=doc["app_errors"],
        first_error=doc["first_error"],
        verified=doc["verified"],
        max_gap_ms=round(doc["max_gap_ms"], 2),
        max_gap_at_s=round(doc["max_gap_at_s"], 4),
        first_completion_ms=doc["first_completion_ms"],
        **gap_analysis(doc["completion_s"], t_fail, t_rest, doc["size"], sched_cli, sched_srv),
    )
    paths = doc["stats"]["paths"] if doc.get("stats") else []
    rec["paths"] = [{k: p[k] for k in ("id", "src_port", "state", "window", "srtt_us", "timeouts",
                                        "timeout_losses", "sack_losses", "probes", "rerolls",
                                        "retransmits", "packets_sent", "generation")} for p in paths]
    for k in ("timeouts", "rerolls", "timeout_losses", "sack_losses", "probes", "retransmits"):
        rec[f"sum_{k}"] = sum(p[k] for p in paths)
    rec["raw"] = str(out_json.relative_to(ROOT))
    return rec


def run_steps(tag, kind, levels, phase_s):
    """One exp_stall connection (the same source ports, hence the same ECMP links, for the
    whole run) while the impairment (kind "loss": netns-ecmp.sh loss on every R->B link;
    "ecn": netns-ecmp.sh ecn) steps through `levels`, `phase_s` seconds each. Removes the
    link-coverage luck of independent runs from the comparison."""
    table = "tbloss" if kind == "loss" else "tbecn"

    def set_level(v):
        tb(kind, str(v))

    set_level(levels[0])
    out_json = RAW / f"{tag}.json"
    srv = Proc(NB, [STALL, "--listen", f"{B_IP}:4791", "--mtu", PMTU], tag + ".server")
    time.sleep(0.4)
    w = Window()
    cli = Proc(NA, [STALL, "--connect", f"{B_IP}:4791", "--duration", phase_s * len(levels),
                    "--size", WRITE_SIZE, "--mtu", PMTU, "--sample-ms", 50, "--out", out_json],
               tag + ".client")
    launch = time.time() + 0.15  # about when the client's measurement starts (after connect)
    bounds, counts = [], []
    ls_prev = link_stats()
    for k, lv in enumerate(levels[1:], start=1):
        time.sleep(max(0.0, launch + k * phase_s - time.time()))
        n, ls = nft_packets(table), link_stats()
        counts.append((n, sum(ls[x]["tx_packets"] - ls_prev[x]["tx_packets"] for x in ls if x.startswith("to_b"))))
        set_level(lv)
        bounds.append(time.time())
        ls_prev = link_stats()
    c = cli.reap(phase_s * len(levels) + 60)
    n, ls = nft_packets(table), link_stats()
    counts.append((n, sum(ls[x]["tx_packets"] - ls_prev[x]["tx_packets"] for x in ls if x.startswith("to_b"))))
    set_level(0)
    win = w.close()
    s = srv.reap(15)
    rec = {"tool": "exp_stall (steps)", "kind": kind, "levels": list(levels), "phase_s": phase_s,
           "client": c, "server": s, **win}
    try:
        doc = json.loads(out_json.read_text())
    except (OSError, ValueError) as e:
        rec.update(error=f"{e}; rc {c['rc']}; stderr {cli.stderr()[-400:]}")
        return rec
    st = doc["start_unix"]
    edges = [0.0] + [b - st for b in bounds] + [doc["elapsed_s"]]
    comp = doc["completion_s"]
    samples = doc["samples"]
    F = {f: i for i, f in enumerate(doc["sample_fields"])}
    phases = []
    for i, lv in enumerate(levels):
        t0, t1 = edges[i] + 0.3, edges[i + 1]  # 0.3 s to settle after each change
        n = sum(1 for t in comp if t0 <= t < t1)
        inside = [x for x in samples if t0 <= x["t"] < t1]
        ph = {"level": lv, "t0": round(t0, 3), "t1": round(t1, 3),
              "goodput_mbps": round(n * doc["size"] * 8 / (t1 - t0) / 1e6, 1) if t1 > t0 else None}
        if inside:
            ph["mean_conn_window"] = round(statistics.mean(sum(p[F["window"]] for p in x["paths"]) for x in inside), 1)
            ph["mean_path_window"] = round(ph["mean_conn_window"] / len(inside[0]["paths"]), 2)
            ph["mean_srtt_us"] = round(statistics.mean(p[F["srtt_us"]] for x in inside for p in x["paths"]), 0)
            a, b = inside[0]["paths"], inside[-1]["paths"]
            for f in ("ecn_marks", "retransmits", "sack_losses", "timeouts", "rerolls", "packets_sent"):
                ph[f] = sum(q[F[f]] - p[F[f]] for p, q in zip(a, b))
            ph["ecn_marks_per_path"] = [q[F["ecn_marks"]] - p[F["ecn_marks"]] for p, q in zip(a, b)]
            ph["windows_per_path_mean"] = [round(statistics.mean(x["paths"][j][F["window"]] for x in inside), 1)
                                           for j in range(len(a))]
        hit, fwd = counts[i]
        ph["measured_pct"] = round(100.0 * hit / (fwd + (hit if kind == "loss" else 0)), 3) if fwd else None
        phases.append(ph)
    base = phases[0]["goodput_mbps"]
    for ph in phases:
        ph["pct_of_first"] = round(100.0 * ph["goodput_mbps"] / base, 1) if base and ph["goodput_mbps"] is not None else None
    lb = {k: v["tx_bytes"] for k, v in rec["links"].items() if k.startswith("to_b")}
    rec.update(phases=phases, app_errors=doc["app_errors"], verified=doc["verified"],
               links_used=sum(1 for v in lb.values() if v > 0.05 * max(1, sum(lb.values()))),
               raw=str(out_json.relative_to(ROOT)))
    return rec


# ---------------------------------------------------------------- experiments


def rocev2_available():
    """Whether this build's metaroce-perf runs `--mode rocev2` (a short loopback run)."""
    help_text = sh([PERF, "--help"], check=False).stdout
    line = [l.strip() for l in help_text.splitlines() if "rocev2" in l.lower()]
    # A short loopback run inside namespace A (its own 127.0.0.1).
    try:
        r = subprocess.run(nsx(NA, [PERF, "--mode", "rocev2", "-n", "50", "-s", "4096"]),
                           capture_output=True, text=True, timeout=60)
        rc, err = r.returncode, r.stderr.strip()[-300:]
    except subprocess.TimeoutExpired:
        rc, err = None, "timed out after 60 s"
    return {"available": rc == 0, "help": line, "probe_rc": rc, "probe_stderr": err}


def exp1(reps, runs):
    for rep in range(reps):
        for paths in (1, 2, 4, 8, 16):
            tag = f"exp1_p{paths}_r{rep}"
            log(f"[exp1] rep {rep} paths {paths}")
            rec = run_perf(tag, paths)
            rec.update(exp="exp1", variant=f"paths{paths}", rep=rep)
            runs.append(rec)
            log(f"    {rec.get('goodput_mbps')} Mbit/s  load {rec['loadavg'][0]}  "
                f"links {[v['tx_bytes'] >> 20 for k, v in rec['links'].items() if k.startswith('to_b')]} MiB")


# exp1r: ECMP collision handling. Paths 1, paths 8 with it off (--no-rebalance) and paths 8
# with it on (the default), interleaved; every run has fresh ephemeral source ports, so each
# 8-path run is a new draw of the ECMP hash.
EXP1R_VARIANTS = (("paths1", 1, ()), ("paths8_off", 8, ("--no-rebalance",)), ("paths8_on", 8, ()))
EXP1R_MID = 2.0  # seconds into the client run: links_late covers the second half


def exp1r(reps, runs):
    for rep in range(reps):
        for variant, paths, extra in EXP1R_VARIANTS:
            tag = f"exp1r_{variant}_r{rep}"
            log(f"[exp1r] rep {rep} {variant}")
            rec = run_perf(tag, paths, extra, mid_at=EXP1R_MID)
            rec.update(exp="exp1r", variant=variant, rep=rep)
            rec["links_used"] = links_used(rec)
            rec["links_used_late"] = links_used(rec, "links_late")
            rec["rebalance_rerolls"] = sum(p.get("rebalance_rerolls", 0) for p in rec.get("path_stats", []))
            runs.append(rec)
            log(f"    {rec.get('goodput_mbps')} Mbit/s  links {rec['links_used']} "
                f"(2nd half {rec['links_used_late']})  rerolls {rec['rebalance_rerolls']}  "
                f"load {rec['loadavg'][0]} {rec.get('error', '')}")


def exp2(reps, runs, rocev2):
    losses = (0, 1, 10)
    try:
        for rep in range(reps):
            for loss in losses:
                set_loss(loss)
                tools = [("metaroce", lambda t: run_perf(t, 8)),
                         ("tcp1", lambda t: run_tcp(t, 1)),
                         ("tcp8", lambda t: run_tcp(t, 8)),
                         ("tcp1cubic", lambda t: run_tcp(t, 1, "cubic")),
                         ("tcp8cubic", lambda t: run_tcp(t, 8, "cubic"))]
                if rocev2["available"]:
                    tools.append(("rocev2", lambda t: run_perf(t, None, mode="rocev2")))
                for name, fn in tools:
                    tag = f"exp2_{name}_l{loss}_r{rep}"
                    log(f"[exp2] rep {rep} loss {loss}% {name}")
                    rec = fn(tag)
                    rec.update(exp="exp2", variant=name, loss_pct=loss, rep=rep)
                    drop_stats(rec)
                    rec["links_used"] = links_used(rec)
                    runs.append(rec)
                    log(f"    {rec.get('goodput_mbps')} Mbit/s  drop {rec['measured_drop_pct']}%  "
                        f"links {rec['links_used']} load {rec['loadavg'][0]} {rec.get('error', '')}")
    finally:
        set_loss(0)


def exp_steps(reps, runs, exp, kind, levels, phase_s):
    try:
        for rep in range(reps):
            tag = f"{exp}_{kind}steps_r{rep}"
            log(f"[{exp}] rep {rep} {kind} steps {levels} within one connection")
            rec = run_steps(tag, kind, levels, phase_s)
            rec.update(exp=exp, variant=f"{kind}_steps", rep=rep)
            runs.append(rec)
            log("    " + "  ".join(f"{p['level']}%: {p['goodput_mbps']} ({p['pct_of_first']}%, "
                                    f"w {p.get('mean_path_window')})" for p in rec.get("phases", []))
                + f"  links {rec.get('links_used')} {rec.get('error', '')}")
    finally:
        tb(kind, "0")


def exp3(reps, runs, variants):
    for rep in range(reps):
        for name, variant, knobs in variants:
            tag = f"exp3_{name}_r{rep}"
            log(f"[exp3] rep {rep} {name}")
            try:
                rec = run_stall(tag, variant, knobs)
            finally:
                tb("loss", "0")
                for i in range(LINKS):
                    tb("restore", str(i))
                resolve_neighbours()
            rec.update(exp="exp3", variant=name, rep=rep)
            runs.append(rec)
            log(f"    stall {rec.get('stall_ms')} ms (noise max {rec.get('noise_max_gap_ms')}) "
                f"restore {rec.get('restore_stall_ms')} ms goodput {rec.get('goodput_mbps')} "
                f"errors {rec.get('app_errors')} rerolls {rec.get('sum_rerolls')} "
                f"timeouts {rec.get('sum_timeouts')} {rec.get('error', '')}")


def exp4(reps, runs):
    marks = (0, 1, 5, 20, 50)
    try:
        for rep in range(reps):
            for pct in marks:
                tb("ecn", str(pct))
                for name in ("metaroce", "tcp8ecn", "tcp8cubicecn"):
                    tag = f"exp4_{name}_e{pct}_r{rep}"
                    log(f"[exp4] rep {rep} CE {pct}% {name}")
                    if name == "metaroce":
                        rec = run_perf(tag, 8)
                    else:
                        set_tcp_ecn(1)
                        try:
                            rec = run_tcp(tag, 8, "cubic" if "cubic" in name else None)
                        finally:
                            set_tcp_ecn(2)
                    rec.update(exp="exp4", variant=name, ce_pct=pct, rep=rep)
                    to_b = sum(v["tx_packets"] for k, v in rec["links"].items() if k.startswith("to_b"))
                    rec["measured_ce_pct"] = round(100.0 * rec["nft_packets"]["tbecn"] / to_b, 3) if to_b else None
                    rec["links_used"] = links_used(rec)
                    ps = rec.get("path_stats") or []
                    if ps:
                        rec["sum_ecn_marks"] = sum(p["ecn_marks"] for p in ps)
                        rec["mean_window"] = round(statistics.mean(p["window"] for p in ps), 1)
                        rec["windows"] = [p["window"] for p in ps]
                        rec["ecn_marks"] = [p["ecn_marks"] for p in ps]
                    runs.append(rec)
                    log(f"    {rec.get('goodput_mbps')} Mbit/s  CE {rec['measured_ce_pct']}%  "
                        f"windows {rec.get('windows')} load {rec['loadavg'][0]}")
    finally:
        tb("ecn", "0")


# ---------------------------------------------------------------- summary


def drop_stats(rec):
    """Random drops (nft, forward hook) as a share of the R->B packets that reached it, and
    the tbf queue-overflow drops behind it."""
    to_b = sum(v["tx_packets"] for k, v in rec["links"].items() if k.startswith("to_b"))
    tbf = sum(v["qdisc_drops"] for k, v in rec["links"].items() if k.startswith("to_b"))
    dropped = rec["nft_packets"]["tbloss"] + rec["nft_packets"]["xptcploss"]
    seen = dropped + to_b + tbf
    rec["random_drops"] = dropped
    rec["tbf_drops"] = tbf
    rec["measured_drop_pct"] = round(100.0 * dropped / seen, 3) if seen else None
    rec["tbf_drop_pct"] = round(100.0 * tbf / seen, 3) if seen else None


def links_used(rec, key="links"):
    """R->B links that carried more than 5% of the run's bytes (ECMP coverage of the run)."""
    lb = [v["tx_bytes"] for k, v in rec.get(key, {}).items() if k.startswith("to_b")]
    return sum(1 for v in lb if v > 0.05 * max(1, sum(lb)))


def med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None


def group(runs, exp, key):
    out = {}
    for r in runs:
        if r.get("exp") == exp:
            out.setdefault(key(r), []).append(r)
    return out


def steps_summary(runs, exp):
    """Per level: medians over the reps of the phase goodput and of its % of phase 0."""
    rs = [r for r in runs if r.get("exp") == exp and r.get("phases")]
    if not rs:
        return {}
    out = {"levels": rs[0]["levels"], "runs_links_used": [r.get("links_used") for r in rs],
           "app_errors": sum(r.get("app_errors") or 0 for r in rs),
           "verified": all(r.get("verified") for r in rs), "phases": []}
    for i, lv in enumerate(rs[0]["levels"]):
        ph = [r["phases"][i] for r in rs if len(r["phases"]) > i]
        out["phases"].append({
            "level": lv,
            "goodput_mbps": med(p.get("goodput_mbps") for p in ph),
            "runs_mbps": [p.get("goodput_mbps") for p in ph],
            "pct_of_first": med(p.get("pct_of_first") for p in ph),
            "runs_pct_of_first": [p.get("pct_of_first") for p in ph],
            "measured_pct": med(p.get("measured_pct") for p in ph),
            "mean_path_window": med(p.get("mean_path_window") for p in ph),
            "mean_srtt_us": med(p.get("mean_srtt_us") for p in ph),
            "ecn_marks": med(p.get("ecn_marks") for p in ph),
            "retransmits": med(p.get("retransmits") for p in ph),
            "timeouts": med(p.get("timeouts") for p in ph),
        })
    return out


def summarize(doc):
    runs = doc["runs"]
    cap = doc["meta"]["capacity"]
    S = {}
    # exp1
    g = group(runs, "exp1", lambda r: r["paths"])
    e1 = {}
    for paths, rs in sorted(g.items()):
        per_link = {}
        for r in rs:
            tot = sum(v["tx_bytes"] for k, v in r["links"].items() if k.startswith("to_b")) or 1
            for k, v in r["links"].items():
                if k.startswith("to_b"):
                    per_link.setdefault(k, []).append(100.0 * v["tx_bytes"] / tot)
        e1[paths] = {
            "goodput_mbps": med(r.get("goodput_mbps") for r in rs),
            "runs_mbps": [r.get("goodput_mbps") for r in rs],
            "links_used": [sum(1 for k, v in r["links"].items() if k.startswith("to_b")
                               and v["tx_bytes"] > 0.05 * max(1, sum(x["tx_bytes"] for kk, x in r["links"].items() if kk.startswith("to_b")))) for r in rs],
            "link_share_pct_median": {k: med(v) for k, v in sorted(per_link.items())},
            "retransmits": [r.get("retransmits") for r in rs],
            "loadavg": [r["loadavg"][0] for r in rs],
            "machine_cpu_busy_pct": [r["machine_cpu_busy_pct"] for r in rs],
            "client_cpu_s": [r["client"]["cpu_s"] for r in rs],
            "server_cpu_s": [r["server"]["cpu_s"] for r in rs],
            "verified": all(r.get("verified") for r in rs),
        }
    if 1 in e1 and 8 in e1 and e1[1]["goodput_mbps"]:
        S["exp1_ratio_8_to_1"] = round(e1[8]["goodput_mbps"] / e1[1]["goodput_mbps"], 2)
    S["exp1"] = e1
    # exp1r
    g = group(runs, "exp1r", lambda r: r["variant"])
    if g:
        p1 = med(r.get("goodput_mbps") for r in g.get("paths1", []))
        e1r = {}
        for variant, rs in sorted(g.items()):
            ratios = [round(r["goodput_mbps"] / p1, 2) if p1 and r.get("goodput_mbps") else None
                      for r in rs]
            e1r[variant] = {
                "goodput_mbps": med(r.get("goodput_mbps") for r in rs),
                "runs_mbps": [r.get("goodput_mbps") for r in rs],
                "ratio_to_paths1_median": ratios,
                "ratio_median": med(ratios),
                "ratio_min": min((x for x in ratios if x is not None), default=None),
                "runs_ratio_ge_3_4": sum(1 for x in ratios if x is not None and x >= 3.4),
                "links_used": [r.get("links_used") for r in rs],
                "links_used_second_half": [r.get("links_used_late") for r in rs],
                "rebalance_rerolls": [r.get("rebalance_rerolls") for r in rs],
                "retransmits": [r.get("retransmits") for r in rs],
                "loadavg": [r["loadavg"][0] for r in rs],
                "verified": all(r.get("verified") for r in rs),
            }
        S["exp1r"] = e1r
    # exp2
    one_link = cap["goodput_ceiling_mbps"] / doc["meta"]["links"]
    for r in runs:
        if r.get("exp") == "exp2" and "loss_pct" in r:
            drop_stats(r)
    g = group([r for r in runs if "loss_pct" in r], "exp2", lambda r: (r["variant"], r["loss_pct"]))
    e2 = {}
    for (tool, loss), rs in sorted(g.items()):
        e2.setdefault(tool, {})[loss] = {
            "goodput_mbps": med(r.get("goodput_mbps") for r in rs),
            "runs_mbps": [r.get("goodput_mbps") for r in rs],
            "runs_links_used": [links_used(r) for r in rs],
            "pct_of_covered_links_ceiling": med(100.0 * r["goodput_mbps"] / (links_used(r) * one_link)
                                                for r in rs if r.get("goodput_mbps") and links_used(r)),
            "measured_drop_pct": med(r.get("measured_drop_pct") for r in rs),
            "tbf_drop_pct": med(r.get("tbf_drop_pct") for r in rs),
            "retransmits": [r.get("retransmits") for r in rs],
            "loadavg": [r["loadavg"][0] for r in rs],
            "machine_cpu_busy_pct": [r["machine_cpu_busy_pct"] for r in rs],
            "errors": [r["error"] for r in rs if r.get("error")],
        }
    for tool, d in e2.items():
        base = d.get(0, {}).get("goodput_mbps")
        for loss, v in d.items():
            v["pct_of_lossless"] = round(100.0 * v["goodput_mbps"] / base, 1) if base and v["goodput_mbps"] is not None else None
    S["exp2"] = e2
    S["exp2_steps"] = steps_summary(runs, "exp2")
    # exp3
    g = group(runs, "exp3", lambda r: r["variant"])
    e3 = {}
    for name, rs in g.items():
        e3[name] = {k: med(r.get(k) for r in rs) for k in (
            "stall_ms", "restore_stall_ms", "noise_max_gap_ms", "noise_p99_gap_ms", "goodput_mbps",
            "goodput_before_mbps", "goodput_after_mbps", "goodput_restored_mbps", "sum_timeouts",
            "sum_rerolls", "sum_timeout_losses", "sum_probes", "stall_cpu_starved_ms",
            "stall_net_of_cpu_ms", "noise_max_gap_cpu_starved_ms", "noise_net_of_cpu_max_ms",
            "restore_stall_cpu_starved_ms", "client_sched_max_late_ms", "server_sched_max_late_ms")}
        e3[name]["runs_stall_ms"] = [r.get("stall_ms") for r in rs]
        e3[name]["runs_rerolls"] = [r.get("sum_rerolls") for r in rs]
        e3[name]["runs_restore_stall_ms"] = [r.get("restore_stall_ms") for r in rs]
        e3[name]["runs_arp_unresolved_discards_restore"] = [r.get("arp_unresolved_discards_restore_0.5s") for r in rs]
        e3[name]["runs_links_used_before"] = [sum(1 for v in r.get("link_packets_before_fail", {}).values()
                                                  if v > 0.05 * max(1, sum(r.get("link_packets_before_fail", {}).values())))
                                              for r in rs]
        e3[name]["app_errors"] = sum(r.get("app_errors") or 0 for r in rs)
        e3[name]["verified"] = all(r.get("verified") for r in rs)
        e3[name]["knobs"] = rs[0].get("knobs")
        e3[name]["loadavg"] = [r["loadavg"][0] for r in rs]
        e3[name]["errors"] = [r["error"] for r in rs if r.get("error")]
    S["exp3"] = e3
    # exp4
    g = group([r for r in runs if "ce_pct" in r], "exp4", lambda r: (r["variant"], r["ce_pct"]))
    e4 = {}
    for (tool, pct), rs in sorted(g.items()):
        e4.setdefault(tool, {})[pct] = {
            "goodput_mbps": med(r.get("goodput_mbps") for r in rs),
            "runs_mbps": [r.get("goodput_mbps") for r in rs],
            "runs_links_used": [links_used(r) for r in rs],
            "pct_of_covered_links_ceiling": med(100.0 * r["goodput_mbps"] / (links_used(r) * one_link)
                                                for r in rs if r.get("goodput_mbps") and links_used(r)),
            "measured_ce_pct": med(r.get("measured_ce_pct") for r in rs),
            "sum_ecn_marks": med(r.get("sum_ecn_marks") for r in rs),
            "mean_window": med(r.get("mean_window") for r in rs),
            "loadavg": [r["loadavg"][0] for r in rs],
        }
    S["exp4"] = e4
    S["exp4_steps"] = steps_summary(runs, "exp4")
    doc["summary"] = S
    return doc


def fmt(v, w=8, p=1):
    if v is None:
        return "-".rjust(w)
    if isinstance(v, float):
        return f"{v:{w}.{p}f}"
    return str(v).rjust(w)


def print_tables(doc):
    S, m = doc["summary"], doc["meta"]
    print(f"\nTestbed: {m['testbed']}   capacity {m['capacity']['goodput_ceiling_mbps']:.0f} Mbit/s "
          f"goodput ceiling ({m['links']} x {m['rate']})   reps {m['reps']} (median)")
    print(f"loadavg at start {m['loadavg_start']}  at end {m.get('loadavg_end')}  cores {m['nproc']}")
    if "exp1" in S and S["exp1"]:
        print("\n[1] write_bw 64 KiB, one connection: goodput vs paths")
        print("  paths  goodput[Mbit/s]  runs                      links used  R->B share per link [%]")
        for p, v in S["exp1"].items():
            print(f"  {p:>5}  {fmt(v['goodput_mbps'], 15)}  {str(v['runs_mbps']):<26}{str(v['links_used']):<12}"
                  f"{' '.join(f'{x:.0f}' for x in v['link_share_pct_median'].values())}")
        print(f"  paths 8 / paths 1 = {S.get('exp1_ratio_8_to_1')}  (target >= 3.4)")
    if S.get("exp1r"):
        print("\n[1r] paths 1 vs 8, ECMP collision handling off (--no-rebalance) and on; x = / median paths 1")
        for v, d in S["exp1r"].items():
            print(f"  {v:<11} median {fmt(d['goodput_mbps'], 7)} Mbit/s  x median {d['ratio_median']}  "
                  f"min {d['ratio_min']}  runs >= 3.4x: {d['runs_ratio_ge_3_4']}/{len(d['runs_mbps'])}")
            print(f"              x per run {d['ratio_to_paths1_median']}")
            print(f"              links used {d['links_used']}  2nd half {d['links_used_second_half']}  "
                  f"rerolls {d['rebalance_rerolls']}")
    if "exp2" in S and S["exp2"]:
        print("\n[2] random loss on every R->B link: goodput [Mbit/s] (% of the same tool lossless)")
        tools = list(S["exp2"])
        print("  loss  " + "".join(f"{t:>22}" for t in tools))
        for loss in (0, 1, 10):
            row = "".join(
                f"{fmt(S['exp2'][t].get(loss, {}).get('goodput_mbps'), 12)} ({fmt(S['exp2'][t].get(loss, {}).get('pct_of_lossless'), 5)}%)"
                for t in tools)
            print(f"  {loss:>3}%  {row}")
        print("  links used per run (ECMP coverage):",
              {t: {l: v["runs_links_used"] for l, v in d.items()} for t, d in S["exp2"].items()})
        print("  % of the covered links' ceiling:",
              {t: {l: v["pct_of_covered_links_ceiling"] for l, v in d.items()} for t, d in S["exp2"].items()})
        print("  targets: MetaRoCE 1% >= 90%, 10% >= 50% of lossless")
        if not m["rocev2"]["available"]:
            print(f"  RoCEv2 mode: not available in this metaroce-perf ({m['rocev2']['probe_stderr'][:120]!r})")
    for key, title in (("exp2_steps", "[2b] loss steps within ONE MetaRoCE connection (same ports, same links)"),
                       ("exp4_steps", "[4b] CE-mark steps within ONE MetaRoCE connection")):
        st = S.get(key)
        if st:
            print(f"\n{title}; links used per run {st['runs_links_used']}, app errors {st['app_errors']}")
            print("  level%  measured%  goodput[Mbit/s]  % of phase 0 (runs)          mean path window  srtt[us]  ecn marks  retx  timeouts")
            for p in st["phases"]:
                print(f"  {p['level']:>5}  {fmt(p['measured_pct'], 9, 2)}  {fmt(p['goodput_mbps'], 15)}  "
                      f"{fmt(p['pct_of_first'], 6)} {str(p['runs_pct_of_first']):<24}{fmt(p['mean_path_window'], 10, 2)}"
                      f"{fmt(p['mean_srtt_us'], 10, 0)}{fmt(p['ecn_marks'], 11, 0)}{fmt(p['retransmits'], 6, 0)}{fmt(p['timeouts'], 10, 0)}")
    if "exp3" in S and S["exp3"]:
        print("\n[3] busiest link fails mid-transfer (64 KiB WRITEs, 8 paths): completion gaps [ms]")
        print("  variant                     stall (cpu-starved, net)  restore  noise-max (net)  p99  "
              "goodput before/after [Mbit/s]  timeouts rerolls errors")
        for name, v in S["exp3"].items():
            print(f"  {name:<26}{fmt(v['stall_ms'], 7)} ({fmt(v['stall_cpu_starved_ms'], 6)},{fmt(v['stall_net_of_cpu_ms'], 6)})"
                  f"{fmt(v['restore_stall_ms'], 9)}{fmt(v['noise_max_gap_ms'], 11)} ({fmt(v['noise_net_of_cpu_max_ms'], 5)})"
                  f"{fmt(v['noise_p99_gap_ms'], 6)}   {fmt(v['goodput_before_mbps'], 7, 0)} / {fmt(v['goodput_after_mbps'], 7, 0)}"
                  f"         {fmt(v['sum_timeouts'], 8, 0)}{fmt(v['sum_rerolls'], 8, 0)}{fmt(v['app_errors'], 7)}")
        print("  target: stall < 50 ms; runs:", {k: v["runs_stall_ms"] for k, v in S["exp3"].items()})
    if "exp4" in S and S["exp4"]:
        print("\n[4] random ECN CE marks on R->B: goodput [Mbit/s], MetaRoCE per-path marks and windows")
        print("  CE%   measured  MetaRoCE  marks(sum)  mean window  TCP-8 bbr ecn=1  TCP-8 cubic ecn=1")
        mr = S["exp4"].get("metaroce", {})
        tc = S["exp4"].get("tcp8ecn", {})
        tcc = S["exp4"].get("tcp8cubicecn", {})
        for pct in sorted(mr):
            v = mr[pct]
            print(f"  {pct:>3}  {fmt(v['measured_ce_pct'], 9, 2)}{fmt(v['goodput_mbps'], 10)}{fmt(v['sum_ecn_marks'], 12, 0)}"
                  f"{fmt(v['mean_window'], 13)}{fmt(tc.get(pct, {}).get('goodput_mbps'), 17)}"
                  f"{fmt(tcc.get(pct, {}).get('goodput_mbps'), 19)}")
        print("  links used per run:", {t: {p: v["runs_links_used"] for p, v in d.items()} for t, d in S["exp4"].items()})


def git_state():
    head = sh(["git", "-C", ROOT, "rev-parse", "HEAD"], check=False).stdout.strip()
    dirty = sh(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
               check=False).stdout.strip().splitlines()
    return {"head": head, "modified_tracked_files": [l[3:] for l in dirty]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="exp1,exp2,exp3,exp4",
                    help="comma list of exp1 exp1r exp2 exp3 exp4 (exp2steps / exp4steps: only the steps "
                         "part; exp1r: paths 1 vs 8 with ECMP collision handling off and on)")
    ap.add_argument("--summarize", action="store_true", help="only re-print results.json")
    ap.add_argument("--tag", default="", help="write results-TAG.json and raw-TAG/ instead")
    args = ap.parse_args()
    global RAW, RESULTS
    if args.tag:
        RAW, RESULTS = HERE / f"raw-{args.tag}", HERE / f"results-{args.tag}.json"
    if args.summarize:
        doc = summarize(json.loads(RESULTS.read_text()))
        RESULTS.write_text(json.dumps(doc, indent=1))
        print_tables(doc)
        return 0
    RAW.mkdir(exist_ok=True)
    for f in RAW.iterdir():
        f.unlink()
    only = set(args.only.split(","))
    wire = PMTU + 14 + 20 + 8 + 12 + 4  # payload + Eth/IP/UDP/BTH/ICRC, before MetaRoCE headers
    meta = {
        "argv": sys.argv[1:],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git": git_state(),
        "kernel": os.uname().release,
        "nproc": os.cpu_count(),
        "nice": NICE,
        "testbed": f"PFX={PFX} LINKS={LINKS} RATE={RATE} MTU={MTU} (netns-ecmp.sh), MetaRoCE pmtu {PMTU}",
        "links": LINKS, "rate": RATE, "mtu": MTU, "pmtu": PMTU,
        "reps": args.reps,
        "loadavg_start": loadavg(),
        "perf_secs": PERF_SECS, "tcp_secs": TCP_SECS, "stall_secs": STALL_SECS,
        "write_size": WRITE_SIZE,
        "capacity": {
            "link_rate_mbps": rate_bps(RATE) / 1e6,
            "aggregate_mbps": LINKS * rate_bps(RATE) / 1e6,
            "goodput_ceiling_mbps": LINKS * rate_bps(RATE) / 1e6 * PMTU / wire,
            "note": "tbf counts L2 frame bytes; ceiling = rate x pmtu/(pmtu+58) before MetaRoCE's own headers",
        },
        "tools": {
            "iperf3": sh(["iperf3", "--version"], check=False).stdout.splitlines()[0:1],
            "tcp_congestion": sh(nsx(NA, ["sysctl", "-n", "net.ipv4.tcp_congestion_control"]), check=False).stdout.strip(),
        },
    }
    meta["rocev2"] = rocev2_available()
    log(f"rocev2 mode: {meta['rocev2']}")
    runs = []
    doc = {"meta": meta, "runs": runs}

    def save():
        meta["loadavg_end"] = loadavg()
        summarize(doc)
        RESULTS.write_text(json.dumps(doc, indent=1))

    try:
        if "exp1" in only:
            exp1(args.reps, runs)
            save()
        if "exp1r" in only:
            exp1r(args.reps, runs)
            save()
        if "exp2" in only:
            exp2(args.reps, runs, meta["rocev2"])
        if "exp2" in only or "exp2steps" in only:
            exp_steps(args.reps, runs, "exp2", "loss", [0, 1, 10, 0], 3.5)
            save()
        if "exp3" in only:
            variants = [
                ("control", "control", {}),
                ("fail", "fail", {}),
                ("blackhole", "blackhole", {}),
                ("blackhole_reroll1", "blackhole", {"reroll_timeouts": 1}),
                ("blackhole_maxrto20", "blackhole", {"max_rto_ms": 20}),
                ("blackhole_reroll1_maxrto20", "blackhole", {"reroll_timeouts": 1, "max_rto_ms": 20}),
            ]
            exp3(args.reps, runs, variants)
            save()
        if "exp4" in only:
            exp4(args.reps, runs)
        if "exp4" in only or "exp4steps" in only:
            exp_steps(args.reps, runs, "exp4", "ecn", [0, 1, 5, 20, 50, 0], 3.0)
            save()
    finally:
        kill_live()
        save()
    print_tables(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
