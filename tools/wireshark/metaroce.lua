-- metaroce.lua: Wireshark/tshark dissector for MetaRoCE (docs/PROTOCOL.md).
--
-- Decodes the MetaRoCE opcodes 0xC0-0xCB (MR_CONNECT ... MR_ATOMIC_RESPONSE) carried in
-- RoCEv2 framing (UDP, BTH, ICRC): the BTH, every extension header (PathEth, SendEth, RETH,
-- WriteEth, AtomicEth, AtomicAckEth, ImmDt, AckEth with its 256-bit SACK bitmap, NakEth,
-- ConnectEth, CloseEth), the payload (a Reject's or a close's reason text), the pad, the
-- authentication trailer (token or AEAD) and the ICRC. Every other opcode (standard RoCEv2
-- RC/UD/CNP) goes to Wireshark's own InfiniBand dissector, unchanged.
--
-- It takes over UDP port 4791 (chaining to the built-in RoCEv2 dissector for standard
-- opcodes) and registers a heuristic on UDP for other ports (a BTH with TVer 0, P_Key
-- 0xFFFF and a MetaRoCE opcode). Install: see tools/wireshark/README.md.
--   tshark -X lua_script:tools/wireshark/metaroce.lua -r capture.pcap -V
--
-- Field names: metaroce.<header>.<field>, e.g. metaroce.path.id, metaroce.bth.psn,
-- metaroce.send.stream, metaroce.imm, metaroce.reth.rkey, metaroce.ack.sack_count.

local ROCE_PORT = 4791

local p = Proto("metaroce", "MetaRoCE")

local OPCODES = {
    [0xC0] = "MR_CONNECT",
    [0xC1] = "MR_ACK",
    [0xC2] = "MR_SEND",
    [0xC3] = "MR_WRITE",
    [0xC4] = "MR_WRITE_WITH_IMMEDIATE",
    [0xC5] = "MR_NAK",
    [0xC6] = "MR_CLOSE",
    [0xC7] = "MR_READ_REQUEST",
    [0xC8] = "MR_READ_RESPONSE",
    [0xC9] = "MR_COMPARE_SWAP",
    [0xCA] = "MR_FETCH_ADD",
    [0xCB] = "MR_ATOMIC_RESPONSE",
}

-- Extension headers after the BTH, in order, per opcode (docs/PROTOCOL.md "Opcodes").
local LAYOUT = {
    [0xC0] = { "connect" },
    [0xC1] = { "ack" },
    [0xC2] = { "path", "send" },
    [0xC3] = { "path", "reth", "write" },
    [0xC4] = { "path", "reth", "write", "imm" },
    [0xC5] = { "path", "nak" },
    [0xC6] = { "close" },
    [0xC7] = { "path", "reth", "write" },
    [0xC8] = { "path", "write" },
    [0xC9] = { "path", "atomic", "write" },
    [0xCA] = { "path", "atomic", "write" },
    [0xCB] = { "path", "write", "atomic_ack" },
}

local HDR_LEN = {
    connect = 60, ack = 48, path = 12, send = 16, reth = 16, write = 8, imm = 4,
    nak = 8, close = 16, atomic = 28, atomic_ack = 8,
}

local CONNECT_KINDS = {
    [1] = "Request", [2] = "Accept", [3] = "Reject", [4] = "Retry", [5] = "Confirm",
}

local REJECT_REASONS = {
    [1] = "not accepting connections",
    [2] = "connection or half-open limit reached / busy",
    [3] = "invalid request",
    [4] = "packet-protection (AEAD) mismatch",
}

local TRAILER_KINDS = { [0] = "none", [1] = "token", [2] = "AEAD", [3] = "malformed" }
local TRAILER_LEN = { [0] = 0, [1] = 8, [2] = 24 }

local f = {
    -- BTH (IBA Vol. 1 9.2)
    opcode = ProtoField.uint8("metaroce.bth.opcode", "OpCode", base.HEX, OPCODES),
    se = ProtoField.bool("metaroce.bth.se", "Solicited Event", 8, nil, 0x80),
    migreq = ProtoField.bool("metaroce.bth.m", "MigReq", 8, nil, 0x40),
    padcnt = ProtoField.uint8("metaroce.bth.padcnt", "Pad Count", base.DEC, nil, 0x30),
    tver = ProtoField.uint8("metaroce.bth.tver", "Header Version", base.DEC, nil, 0x0F),
    pkey = ProtoField.uint16("metaroce.bth.pkey", "P_Key", base.HEX),
    fecn = ProtoField.bool("metaroce.bth.fecn", "FECN", 8, nil, 0x80),
    becn = ProtoField.bool("metaroce.bth.becn", "BECN", 8, nil, 0x40),
    destqp = ProtoField.uint24("metaroce.bth.destqp", "Destination QP", base.HEX),
    ackreq = ProtoField.bool("metaroce.bth.ackreq", "AckReq", 8, nil, 0x80),
    tkind = ProtoField.uint8("metaroce.bth.trailer_kind", "Trailer kind", base.DEC, TRAILER_KINDS, 0x03),
    psn = ProtoField.uint24("metaroce.bth.psn", "PSN", base.DEC),
    -- PathEth
    path_id = ProtoField.uint8("metaroce.path.id", "Path id", base.DEC),
    path_flags = ProtoField.uint8("metaroce.path.flags", "Flags", base.HEX),
    path_retx = ProtoField.bool("metaroce.path.retransmission", "Retransmission", 8, nil, 0x01),
    path_abort = ProtoField.bool("metaroce.path.abort", "Abort (stream abort on SEND, op abort on WRITE; with FIN: STOP)", 8, nil, 0x02),
    path_fin = ProtoField.bool("metaroce.path.fin", "FIN (stream end on SEND)", 8, nil, 0x04),
    path_gen = ProtoField.uint8("metaroce.path.generation", "Re-roll generation", base.DEC, nil, 0xF0),
    path_ts = ProtoField.uint32("metaroce.path.timestamp", "Timestamp (ns mod 2^32)", base.DEC),
    path_plane = ProtoField.uint8("metaroce.path.plane", "Plane", base.DEC, nil, 0x07),
    path_floor = ProtoField.uint24("metaroce.path.floor_psn", "Floor PSN", base.DEC),
    -- SendEth
    stream = ProtoField.uint32("metaroce.send.stream", "Stream id", base.DEC),
    msg_seq = ProtoField.uint32("metaroce.send.msg_seq", "Message sequence", base.DEC),
    send_off = ProtoField.uint32("metaroce.send.offset", "Offset", base.DEC),
    msg_len = ProtoField.uint32("metaroce.send.msg_len", "Message length", base.DEC),
    -- RETH (IBA 9.3)
    reth_va = ProtoField.uint64("metaroce.reth.va", "Virtual address", base.HEX),
    reth_rkey = ProtoField.uint32("metaroce.reth.rkey", "R_Key", base.HEX),
    reth_len = ProtoField.uint32("metaroce.reth.dma_len", "DMA length", base.DEC),
    -- WriteEth
    op_id = ProtoField.uint32("metaroce.op.id", "Op id", base.DEC),
    op_off = ProtoField.uint32("metaroce.op.offset", "Offset", base.DEC),
    -- ImmDt
    imm = ProtoField.uint32("metaroce.imm", "Immediate data", base.HEX),
    -- AtomicEth / AtomicAckEth
    at_va = ProtoField.uint64("metaroce.atomic.va", "Virtual address", base.HEX),
    at_rkey = ProtoField.uint32("metaroce.atomic.rkey", "R_Key", base.HEX),
    at_swap = ProtoField.uint64("metaroce.atomic.swap_add", "Swap / add data", base.HEX),
    at_cmp = ProtoField.uint64("metaroce.atomic.compare", "Compare data", base.HEX),
    at_orig = ProtoField.uint64("metaroce.atomic_ack.orig", "Original data", base.HEX),
    -- AckEth
    ack_path = ProtoField.uint8("metaroce.ack.path_id", "Path id", base.DEC),
    ack_flags = ProtoField.uint8("metaroce.ack.flags", "Flags", base.HEX),
    ack_ece = ProtoField.bool("metaroce.ack.ece", "ECE (CE seen since the last ACK)", 8, nil, 0x01),
    ack_ka = ProtoField.bool("metaroce.ack.keepalive", "KEEPALIVE", 8, nil, 0x02),
    ack_bundle = ProtoField.bool("metaroce.ack.bundle", "BUNDLE (ACK blocks follow)", 8, nil, 0x04),
    ack_blocks = ProtoField.uint16("metaroce.ack.blocks", "Further ACK blocks (paths)", base.DEC),
    ack_block_cum = ProtoField.uint24("metaroce.ack.block_cum", "Cumulative PSN of the block's path", base.DEC),
    ack_delay = ProtoField.uint16("metaroce.ack.ack_delay", "ACK delay (us)", base.DEC),
    ack_echo = ProtoField.uint32("metaroce.ack.echo_ts", "Echoed timestamp", base.DEC),
    ack_ce = ProtoField.uint32("metaroce.ack.ce_count", "CE count", base.DEC),
    ack_grant = ProtoField.uint8("metaroce.ack.window_grant", "Window grant (units of 8 packets, 0 = none)", base.DEC),
    ack_rate = ProtoField.uint24("metaroce.ack.rate_hint", "Rate hint (Mbit/s, 0 = no limit)", base.DEC),
    ack_sack = ProtoField.bytes("metaroce.ack.sack", "SACK bitmap (bit i = PSN cum+1+i)"),
    ack_sack_n = ProtoField.uint16("metaroce.ack.sack_count", "PSNs selectively acknowledged", base.DEC),
    ack_sack_hi = ProtoField.uint24("metaroce.ack.sack_highest", "Highest PSN selectively acknowledged", base.DEC),
    -- NakEth
    nak_syn = ProtoField.uint8("metaroce.nak.syndrome", "Syndrome", base.HEX),
    nak_kind = ProtoField.string("metaroce.nak.kind", "NAK"),
    nak_refused = ProtoField.bool("metaroce.nak.stream_refused", "Stream refused (stream table full)", 8, nil, 0x01),
    nak_op = ProtoField.uint32("metaroce.nak.op_id", "Op id (stream id for a SEND)", base.DEC),
    -- ConnectEth
    c_kind = ProtoField.uint8("metaroce.connect.kind", "Kind", base.DEC, CONNECT_KINDS),
    c_ver = ProtoField.uint8("metaroce.connect.version", "Protocol version", base.DEC),
    c_paths = ProtoField.uint16("metaroce.connect.paths", "Path count", base.DEC),
    c_src = ProtoField.uint24("metaroce.connect.src_qpn", "Sender QPN", base.HEX),
    c_dst = ProtoField.uint24("metaroce.connect.dst_qpn", "Receiver QPN", base.HEX),
    c_pmtu = ProtoField.uint16("metaroce.connect.pmtu", "Path MTU", base.DEC),
    c_port = ProtoField.uint16("metaroce.connect.listen_port", "Listen port", base.DEC),
    c_ipsn = ProtoField.uint24("metaroce.connect.init_psn", "Initial PSN", base.DEC),
    c_nonce = ProtoField.uint64("metaroce.connect.nonce", "Client nonce", base.HEX),
    c_reason = ProtoField.uint32("metaroce.connect.reject_code", "Reject code", base.DEC),
    c_grant = ProtoField.uint32("metaroce.connect.grant", "Grant (Mbit/s, 0 = no limit)", base.DEC),
    c_snonce = ProtoField.uint64("metaroce.connect.server_nonce", "Server nonce", base.HEX),
    c_flags = ProtoField.uint16("metaroce.connect.flags", "Flags", base.HEX),
    c_aead = ProtoField.bool("metaroce.connect.aead", "AEAD packet protection", 16, nil, 0x0001),
    c_cookie = ProtoField.bytes("metaroce.connect.cookie", "Retry cookie"),
    c_text = ProtoField.string("metaroce.connect.reject_reason", "Reject reason"),
    -- CloseEth
    cl_code = ProtoField.uint32("metaroce.close.code", "Close code", base.DEC),
    cl_flags = ProtoField.uint8("metaroce.close.flags", "Flags", base.HEX),
    cl_ack = ProtoField.bool("metaroce.close.ack", "ACK (answers a close)", 8, nil, 0x01),
    cl_port = ProtoField.uint16("metaroce.close.reply_port", "Reply port", base.DEC),
    cl_nonce = ProtoField.uint64("metaroce.close.nonce", "Client nonce", base.HEX),
    cl_text = ProtoField.string("metaroce.close.reason", "Close reason"),
    -- payload, pad, trailer, ICRC
    payload = ProtoField.bytes("metaroce.payload", "Payload"),
    payload_len = ProtoField.uint32("metaroce.payload_len", "Payload length", base.DEC),
    pad = ProtoField.bytes("metaroce.pad", "Pad"),
    token = ProtoField.uint64("metaroce.trailer.token", "Token", base.HEX),
    key_phase = ProtoField.uint8("metaroce.trailer.key_phase", "Key phase", base.DEC),
    pn = ProtoField.uint64("metaroce.trailer.pn", "Packet number", base.DEC),
    tag = ProtoField.bytes("metaroce.trailer.tag", "AES-GCM tag"),
    icrc = ProtoField.uint32("metaroce.icrc", "ICRC (little-endian)", base.HEX),
}

local list = {}
for _, v in pairs(f) do
    list[#list + 1] = v
end
p.fields = list

local ef_malformed = ProtoExpert.new("metaroce.malformed", "Malformed MetaRoCE packet",
    expert.group.MALFORMED, expert.severity.ERROR)
local ef_nak = ProtoExpert.new("metaroce.nak.expert", "MetaRoCE NAK",
    expert.group.RESPONSE_CODE, expert.severity.NOTE)
p.experts = { ef_malformed, ef_nak }

local function nak_kind(s)
    if s >= 0x20 and s <= 0x3F then
        return string.format("RNR NAK (timer code %d)", s % 32)
    elseif s >= 0x40 and s <= 0x5F then
        return string.format("flow-control RNR NAK (timer code %d)", s % 32)
    elseif s == 0x61 then
        return "invalid request"
    elseif s == 0x62 then
        return "remote access error"
    elseif s == 0x63 then
        return "remote operational error"
    end
    return string.format("unknown syndrome 0x%02x", s)
end

local function popcount8(b)
    local n = 0
    while b > 0 do
        n = n + (b % 2)
        b = math.floor(b / 2)
    end
    return n
end

local function printable(tvb)
    -- The reason bytes as text when they are printable ASCII, else as hex.
    local s = tvb:raw()
    if s:match("^[%g ]*$") then
        return s
    end
    return tvb:bytes():tohex()
end

-- Each dissects one header at `r` (a TvbRange of its exact length) into `t`; returns an
-- Info column fragment.
local H = {}

function H.path(r, t)
    t:add(f.path_id, r(0, 1))
    local fl = t:add(f.path_flags, r(1, 1))
    fl:add(f.path_retx, r(1, 1))
    fl:add(f.path_abort, r(1, 1))
    fl:add(f.path_fin, r(1, 1))
    fl:add(f.path_gen, r(1, 1))
    t:add(f.path_ts, r(4, 4))
    t:add(f.path_plane, r(8, 1))
    t:add(f.path_floor, r(9, 3))
    local flags = r(1, 1):uint()
    local extra = ""
    if flags % 2 == 1 then extra = extra .. " retx" end
    if math.floor(flags / 2) % 2 == 1 then extra = extra .. " abort" end
    if math.floor(flags / 4) % 2 == 1 then extra = extra .. " fin" end
    return string.format("path=%d%s", r(0, 1):uint(), extra)
end

function H.send(r, t)
    t:add(f.stream, r(0, 4))
    t:add(f.msg_seq, r(4, 4))
    t:add(f.send_off, r(8, 4))
    t:add(f.msg_len, r(12, 4))
    return string.format("stream=%d msg=%d off=%d len=%d",
        r(0, 4):uint(), r(4, 4):uint(), r(8, 4):uint(), r(12, 4):uint())
end

function H.reth(r, t)
    t:add(f.reth_va, r(0, 8))
    t:add(f.reth_rkey, r(8, 4))
    t:add(f.reth_len, r(12, 4))
    return string.format("va=0x%s rkey=0x%08x dma_len=%d",
        r(0, 8):uint64():tohex(), r(8, 4):uint(), r(12, 4):uint())
end

function H.write(r, t)
    t:add(f.op_id, r(0, 4))
    t:add(f.op_off, r(4, 4))
    return string.format("op=%d off=%d", r(0, 4):uint(), r(4, 4):uint())
end

function H.imm(r, t)
    t:add(f.imm, r(0, 4))
    return string.format("imm=0x%08x", r(0, 4):uint())
end

function H.atomic(r, t)
    t:add(f.at_va, r(0, 8))
    t:add(f.at_rkey, r(8, 4))
    t:add(f.at_swap, r(12, 8))
    t:add(f.at_cmp, r(20, 8))
    return string.format("va=0x%s rkey=0x%08x", r(0, 8):uint64():tohex(), r(8, 4):uint())
end

function H.atomic_ack(r, t)
    t:add(f.at_orig, r(0, 8))
    return "orig=0x" .. r(0, 8):uint64():tohex()
end

function H.ack(r, t, cum)
    t:add(f.ack_path, r(0, 1))
    local fl = t:add(f.ack_flags, r(1, 1))
    fl:add(f.ack_ece, r(1, 1))
    fl:add(f.ack_ka, r(1, 1))
    fl:add(f.ack_bundle, r(1, 1))
    t:add(f.ack_delay, r(2, 2))
    t:add(f.ack_echo, r(4, 4))
    t:add(f.ack_ce, r(8, 4))
    t:add(f.ack_grant, r(12, 1))
    t:add(f.ack_rate, r(13, 3))
    local sack = r(16, 32)
    local st = t:add(f.ack_sack, sack)
    local n, hi = 0, nil
    for i = 0, 31 do
        local b = sack(i, 1):uint()
        n = n + popcount8(b)
        if b ~= 0 then
            -- Bit i is bit (7 - i mod 8) of byte i/8: the lowest set bit of the byte is the
            -- highest PSN it covers.
            local low = 0
            while b % 2 == 0 do
                b = math.floor(b / 2)
                low = low + 1
            end
            hi = (cum + 1 + i * 8 + (7 - low)) % 16777216
        end
    end
    st:add(f.ack_sack_n, sack, n):set_generated()
    if hi then
        st:add(f.ack_sack_hi, sack, hi):set_generated()
    end
    local flags = r(1, 1):uint()
    local what = "cum=" .. cum
    if math.floor(flags / 2) % 2 == 1 then what = "KEEPALIVE" end
    if math.floor(flags / 4) % 2 == 1 then what = what .. " BUNDLE" end
    if flags % 2 == 1 then what = what .. " ECE" end
    return string.format("path=%d %s sack=%d", r(0, 1):uint(), what, n)
end

function H.nak(r, t)
    local s = r(0, 1):uint()
    t:add(f.nak_syn, r(0, 1))
    t:add(f.nak_kind, r(0, 1), nak_kind(s)):set_generated()
    t:add(f.nak_refused, r(1, 1))
    t:add(f.nak_op, r(4, 4))
    local refused = ""
    if r(1, 1):uint() % 2 == 1 then refused = " stream refused" end
    return nak_kind(s) .. refused .. " op=" .. r(4, 4):uint()
end

function H.connect(r, t)
    local kind = r(0, 1):uint()
    t:add(f.c_kind, r(0, 1))
    t:add(f.c_ver, r(1, 1))
    t:add(f.c_paths, r(2, 2))
    t:add(f.c_src, r(5, 3))
    t:add(f.c_dst, r(9, 3))
    t:add(f.c_pmtu, r(12, 2))
    t:add(f.c_port, r(14, 2))
    t:add(f.c_ipsn, r(17, 3))
    t:add(f.c_nonce, r(20, 8))
    if kind == 3 then
        local code = r(28, 4):uint()
        local it = t:add(f.c_reason, r(28, 4))
        if REJECT_REASONS[code] then
            it:append_text(" (" .. REJECT_REASONS[code] .. ")")
        end
    else
        t:add(f.c_grant, r(28, 4))
    end
    t:add(f.c_snonce, r(32, 8))
    local fl = t:add(f.c_flags, r(40, 2))
    fl:add(f.c_aead, r(40, 2))
    t:add(f.c_cookie, r(44, 16))
    local name = CONNECT_KINDS[kind]
    if not name then
        t:add_proto_expert_info(ef_malformed, "ConnectEth kind " .. kind .. " is not defined")
        name = "kind " .. kind
    end
    local s = name .. string.format(" src_qpn=0x%06x", r(5, 3):uint())
    if kind == 3 then
        s = s .. " code=" .. r(28, 4):uint()
    end
    return s
end

function H.close(r, t)
    t:add(f.cl_code, r(0, 4))
    local fl = t:add(f.cl_flags, r(4, 1))
    fl:add(f.cl_ack, r(4, 1))
    t:add(f.cl_port, r(6, 2))
    t:add(f.cl_nonce, r(8, 8))
    if r(4, 1):uint() % 2 == 1 then
        return "answer code=" .. r(0, 4):uint()
    end
    return "close code=" .. r(0, 4):uint()
end

local HDR_NAMES = {
    path = "PathEth", send = "SendEth", reth = "RETH", write = "WriteEth", imm = "ImmDt",
    atomic = "AtomicEth", atomic_ack = "AtomicAckEth", ack = "AckEth", nak = "NakEth",
    connect = "ConnectEth", close = "CloseEth",
}

local function malformed(tree, pinfo, msg)
    tree:add_proto_expert_info(ef_malformed, msg)
    pinfo.cols.info:append(" [Malformed: " .. msg .. "]")
end

local function dissect_mr(tvb, pinfo, tree)
    local len = tvb:len()
    local op = tvb(0, 1):uint()
    local name = OPCODES[op]
    pinfo.cols.protocol = "MetaRoCE"
    local root = tree:add(p, tvb(), "MetaRoCE " .. name)
    -- BTH
    local bth = root:add(tvb(0, 12), "Base Transport Header")
    bth:add(f.opcode, tvb(0, 1))
    bth:add(f.se, tvb(1, 1))
    bth:add(f.migreq, tvb(1, 1))
    bth:add(f.padcnt, tvb(1, 1))
    bth:add(f.tver, tvb(1, 1))
    bth:add(f.pkey, tvb(2, 2))
    bth:add(f.fecn, tvb(4, 1))
    bth:add(f.becn, tvb(4, 1))
    bth:add(f.destqp, tvb(5, 3))
    bth:add(f.ackreq, tvb(8, 1))
    bth:add(f.tkind, tvb(8, 1))
    bth:add(f.psn, tvb(9, 3))
    local psn = tvb(9, 3):uint()
    local padcnt = math.floor(tvb(1, 1):uint() / 16) % 4
    local tkind = tvb(8, 1):uint() % 4
    local info = { name, string.format("QP=0x%06x", tvb(5, 3):uint()), "PSN=" .. psn }

    if len % 4 ~= 0 then
        malformed(root, pinfo, "length " .. len .. " is not a multiple of 4")
        return
    end
    local layout = LAYOUT[op]
    local off = 12
    for _, h in ipairs(layout) do
        off = off + HDR_LEN[h]
    end
    local hdr_end = off
    local tlen = TRAILER_LEN[tkind]
    if tlen == nil then
        malformed(root, pinfo, "trailer kind 3")
        return
    end
    if len < hdr_end + tlen + 4 then
        malformed(root, pinfo, string.format("%d bytes, headers + trailer + ICRC need %d",
            len, hdr_end + tlen + 4))
        return
    end
    local body = len - hdr_end - tlen - 4
    if padcnt > body then
        malformed(root, pinfo, "PadCnt " .. padcnt .. " exceeds the " .. body .. " payload bytes")
        return
    end

    off = 12
    for _, h in ipairs(layout) do
        local n = HDR_LEN[h]
        local r = tvb(off, n)
        local t = root:add(r, HDR_NAMES[h])
        info[#info + 1] = H[h](r, t, psn)
        off = off + n
    end

    local plen = body - padcnt
    if plen > 0 then
        local pr = tvb(off, plen)
        if op == 0xC0 and tvb(12, 1):uint() == 3 then
            root:add(f.c_text, pr, printable(pr))
            info[#info + 1] = "reason=\"" .. printable(pr) .. "\""
        elseif op == 0xC6 then
            root:add(f.cl_text, pr, printable(pr))
            info[#info + 1] = "reason=\"" .. printable(pr) .. "\""
        elseif op == 0xC1 and math.floor(tvb(13, 1):uint() / 4) % 2 == 1 then
            -- ACK bundle: 52-byte blocks, each a cumulative PSN word and an AckEth.
            local k = math.floor(plen / 52)
            local bt = root:add(pr, "ACK blocks")
            bt:add(f.ack_blocks, pr, k):set_generated()
            if plen % 52 ~= 0 then
                malformed(root, pinfo, "ACK bundle payload of " .. plen .. " bytes is not whole 52-byte blocks")
            end
            for j = 0, k - 1 do
                local b = tvb(off + 52 * j, 52)
                local cum = b(1, 3):uint()
                local t = bt:add(b, "ACK block")
                t:add(f.ack_block_cum, b(1, 3))
                info[#info + 1] = "+ " .. H.ack(b(4, 48), t, cum)
            end
        else
            root:add(f.payload, pr)
        end
    end
    root:add(f.payload_len, tvb(off, plen), plen):set_generated()
    if plen > 0 and op ~= 0xC0 and op ~= 0xC6 and op ~= 0xC1 then
        info[#info + 1] = "payload=" .. plen
    end
    off = off + plen
    if padcnt > 0 then
        root:add(f.pad, tvb(off, padcnt))
        off = off + padcnt
    end
    if tkind == 1 then
        local tt = root:add(tvb(off, 8), "Authentication trailer (token)")
        tt:add(f.token, tvb(off, 8))
    elseif tkind == 2 then
        local tt = root:add(tvb(off, 24), "Authentication trailer (AEAD)")
        local hi = tvb(off, 1):uint()
        tt:add(f.key_phase, tvb(off, 1), math.floor(hi / 128))
        local word = tvb(off, 8):uint64()
        local pnv = word:band(UInt64(0xFFFFFFFF, 0x7FFFFFFF))
        tt:add(f.pn, tvb(off, 8), pnv)
        tt:add(f.tag, tvb(off + 8, 16))
        info[#info + 1] = "AEAD pn=" .. tostring(pnv)
    end
    off = off + tlen
    root:add_le(f.icrc, tvb(off, 4))
    if op == 0xC5 then
        root:add_proto_expert_info(ef_nak, info[4] or "NAK")
    end
    pinfo.cols.info:set(table.concat(info, " "))
end

local function is_metaroce(tvb)
    if tvb:len() < 16 then
        return false
    end
    local op = tvb(0, 1):uint()
    return OPCODES[op] ~= nil
end

-- UDP 4791: MetaRoCE opcodes here, everything else to the built-in RoCEv2 dissector.
local udp_port = DissectorTable.get("udp.port")
local builtin = udp_port:get_dissector(ROCE_PORT)

function p.dissector(tvb, pinfo, tree)
    if is_metaroce(tvb) then
        dissect_mr(tvb, pinfo, tree)
        return tvb:len()
    end
    if builtin then
        -- The built-in dissector reports its own malformed packets; from Lua they arrive
        -- as an error, shown here the same way.
        local ok, r = pcall(function() return builtin:call(tvb, pinfo, tree) end)
        if ok then
            return r
        end
        tree:add_proto_expert_info(ef_malformed, "InfiniBand dissector: " .. tostring(r))
        return tvb:len()
    end
    return 0
end

udp_port:add(ROCE_PORT, p)

-- Other ports (tests, shared hosts): a BTH with TVer 0, P_Key 0xFFFF and a MetaRoCE opcode.
local function heuristic(tvb, pinfo, tree)
    if not is_metaroce(tvb) or tvb:len() % 4 ~= 0 then
        return false
    end
    if tvb(1, 1):uint() % 16 ~= 0 or tvb(2, 2):uint() ~= 0xFFFF then
        return false
    end
    dissect_mr(tvb, pinfo, tree)
    return true
end

p:register_heuristic("udp", heuristic)
