#!/usr/bin/env python3
"""Extract the UDP payloads of RoCEv2 packets (UDP port 4791) from classic pcap files into
a libFuzzer corpus directory, one file per distinct payload, named by its SHA-1 (as
libFuzzer names corpus files).

    tools/pcap_to_corpus.py [-o corpus/wire_parse] FILE.pcap [FILE.pcap ...]

Handles microsecond and nanosecond pcaps of either byte order, with Ethernet (optionally
802.1Q-tagged), Linux cooked (SLL) or raw-IP link types, IPv4 (with options) and IPv6
(fixed header). Packets that are not UDP to or from port 4791, or are truncated, are
skipped. Standard library only.
"""

import argparse
import hashlib
import os
import struct
import sys

ROCE_PORT = 4791
LINKTYPE_ETHERNET = 1
LINKTYPE_RAW = 101
LINKTYPE_LINUX_SLL = 113
LINKTYPE_IPV4 = 228
LINKTYPE_IPV6 = 229


def frames(path):
    """Yield (linktype, frame bytes) for every record of a classic pcap file."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 24:
        raise ValueError(f"{path}: too short for a pcap header")
    magic = data[:4]
    if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1"):
        endian = "<"
    elif magic in (b"\xa1\xb2\xc3\xd4", b"\xa1\xb2\x3c\x4d"):
        endian = ">"
    else:
        raise ValueError(f"{path}: not a classic pcap file (pcapng is not supported)")
    linktype = struct.unpack(endian + "I", data[20:24])[0] & 0x0FFFFFFF
    off = 24
    while off + 16 <= len(data):
        incl = struct.unpack(endian + "I", data[off + 8 : off + 12])[0]
        yield linktype, data[off + 16 : off + 16 + incl]
        off += 16 + incl


def ip_packet(linktype, frame):
    """The IP packet inside a frame, or None."""
    if linktype == LINKTYPE_ETHERNET:
        if len(frame) < 14:
            return None
        ethertype = struct.unpack(">H", frame[12:14])[0]
        off = 14
        while ethertype in (0x8100, 0x88A8) and len(frame) >= off + 4:
            ethertype = struct.unpack(">H", frame[off + 2 : off + 4])[0]
            off += 4
        return frame[off:] if ethertype in (0x0800, 0x86DD) else None
    if linktype == LINKTYPE_LINUX_SLL:
        if len(frame) < 16:
            return None
        proto = struct.unpack(">H", frame[14:16])[0]
        return frame[16:] if proto in (0x0800, 0x86DD) else None
    if linktype in (LINKTYPE_RAW, LINKTYPE_IPV4, LINKTYPE_IPV6):
        return frame
    return None


def udp_payload(ip):
    """The RoCEv2 UDP payload of an IP packet, or None."""
    if not ip:
        return None
    version = ip[0] >> 4
    if version == 4:
        ihl = (ip[0] & 0x0F) * 4
        if ihl < 20 or len(ip) < ihl + 8 or ip[9] != 17:
            return None
        udp = ip[ihl:]
    elif version == 6:
        if len(ip) < 48 or ip[6] != 17:
            return None
        udp = ip[40:]
    else:
        return None
    sport, dport, length = struct.unpack(">HHH", udp[:6])
    if ROCE_PORT not in (sport, dport) or length < 8 or len(udp) < length:
        return None
    return bytes(udp[8:length])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument(
        "-o",
        "--out",
        default=os.path.join(here, "..", "corpus", "wire_parse"),
        help="corpus directory (default: fuzz/corpus/wire_parse)",
    )
    ap.add_argument("pcaps", nargs="+")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    seen = new = 0
    for path in args.pcaps:
        for linktype, frame in frames(path):
            payload = udp_payload(ip_packet(linktype, frame))
            if payload is None:
                continue
            seen += 1
            name = os.path.join(args.out, hashlib.sha1(payload).hexdigest())
            if not os.path.exists(name):
                with open(name, "wb") as f:
                    f.write(payload)
                new += 1
    print(f"{seen} RoCEv2 payloads, {new} new files in {os.path.normpath(args.out)}")
    return 0 if seen else 1


if __name__ == "__main__":
    sys.exit(main())
