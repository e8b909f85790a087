//! The per-packet fast paths of issue #13 (branch `core3`) under replayed, late and
//! misaddressed packets:
//!
//! - the endpoint's per-connection index lives in the connection (one QPN lookup per
//!   datagram): a packet of a removed connection reaches nothing, the index entries go with
//!   the connection, and a packet re-addressed to another live connection's QPN is refused
//!   at its identity check and moves none of its state;
//! - a one-packet WRITE is placed and finished without entering the responder's table of
//!   WRITEs in progress: a replayed copy after it finished is a duplicate and is not placed
//!   again, whatever the application wrote there since;
//! - the sender copies a WRITE's bytes straight from the source region into the datagram:
//!   every byte arrives, across packet sizes with and without pad bytes.
//!
//! Sans-IO, virtual time, the in-memory network of `metaroce::testing`.

use metaroce::testing::{pattern, Net, Sent};
use metaroce::wire::{icrc, Opcode, Packet};
use metaroce::{Access, ConnectionHandle, WcStatus, WriteRequest};
use std::net::SocketAddr;
use std::time::Duration;

fn write(wr_id: u64, lkey: u32, len: u32, addr: u64, rkey: u32) -> WriteRequest {
    WriteRequest {
        wr_id,
        lkey,
        local_offset: 0,
        len,
        remote_addr: addr,
        rkey,
        imm: None,
    }
}

/// Run until endpoint 0 reports a completion for `wr_id` on `c`; its status.
fn complete(net: &mut Net, c: ConnectionHandle, wr_id: u64) -> WcStatus {
    let done = net.run_until(net.elapsed() + Duration::from_secs(2), |n| {
        n.completions(0, c).iter().any(|w| w.wr_id == wr_id)
    });
    assert!(done, "WRITE {wr_id} did not complete");
    net.completions(0, c)
        .into_iter()
        .find(|w| w.wr_id == wr_id)
        .unwrap()
        .status
}

/// The last recorded MR_WRITE endpoint 0 sent.
fn last_write(net: &Net) -> Sent {
    net.last_sent(0, |p| p.bth.opcode == Opcode::MR_WRITE)
        .expect("a recorded MR_WRITE")
}

/// `data` with its BTH DestQP replaced by `qpn` and the ICRC stamped again (what an
/// attacker on the path can do: the token in the trailer is what it cannot forge).
fn readdress(data: &[u8], qpn: u32, from: SocketAddr, to: SocketAddr) -> Vec<u8> {
    let mut d = data.to_vec();
    d[5..8].copy_from_slice(&qpn.to_be_bytes()[1..]);
    let ip = icrc::IpHeader::synthesized(from.ip(), to.ip()).unwrap();
    icrc::stamp(&ip, from.port(), to.port(), &mut d).unwrap();
    assert_eq!(Packet::parse(&d).unwrap().bth.dest_qp, qpn);
    d
}

#[test]
fn replayed_one_packet_write_is_not_placed_again() {
    let mut net = Net::new(3);
    net.record = 100_000;
    let (c, s) = net.connect();
    let src = net.eps[0].register_mr(vec![0xA5; 64], Access::LOCAL_WRITE);
    let dst = net.eps[1].register_mr(vec![0; 64], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    net.eps[0]
        .post_write(c, write(1, src.lkey, 64, dst.addr, dst.rkey))
        .unwrap();
    assert_eq!(complete(&mut net, c, 1), WcStatus::Success);
    assert_eq!(net.eps[1].mr_read(dst.lkey, 0, 64).unwrap(), vec![0xA5; 64]);
    let copy = last_write(&net);
    let before = net.eps[1].connection_stats(s).unwrap().recv;
    // The application reuses the buffer; then a late copy of the finished WRITE arrives.
    net.eps[1].mr_write(dst.lkey, 0, &[0x11; 64]).unwrap();
    for _ in 0..3 {
        net.deliver(1, copy.from, &copy.data);
    }
    net.run_for(Duration::from_millis(5));
    assert_eq!(
        net.eps[1].mr_read(dst.lkey, 0, 64).unwrap(),
        vec![0x11; 64],
        "a replayed WRITE packet of a finished operation was placed again"
    );
    let after = net.eps[1].connection_stats(s).unwrap().recv;
    assert_eq!(
        after.write_bytes, before.write_bytes,
        "bytes placed by the replay"
    );
    assert!(
        after.duplicates > before.duplicates,
        "the replay is counted as a duplicate"
    );
    assert_eq!(after.tracked_ops, before.tracked_ops);
    // The connection goes on: a second WRITE lands.
    net.eps[0]
        .post_write(c, write(2, src.lkey, 64, dst.addr, dst.rkey))
        .unwrap();
    assert_eq!(complete(&mut net, c, 2), WcStatus::Success);
    assert_eq!(net.eps[1].mr_read(dst.lkey, 0, 64).unwrap(), vec![0xA5; 64]);
}

#[test]
fn packet_of_a_removed_connection_or_for_another_qpn_reaches_nothing() {
    let mut net = Net::new(5);
    net.record = 100_000;
    let (a, a_srv) = net.connect();
    let (b, b_srv) = net.connect();
    assert_ne!(a_srv, b_srv);
    let src = net.eps[0].register_mr(pattern(1, 256), Access::LOCAL_WRITE);
    let dst = net.eps[1].register_mr(vec![0; 256], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    net.eps[0]
        .post_write(a, write(1, src.lkey, 128, dst.addr, dst.rkey))
        .unwrap();
    assert_eq!(complete(&mut net, a, 1), WcStatus::Success);
    let copy = last_write(&net);
    assert_eq!(Packet::parse(&copy.data).unwrap().bth.dest_qp, a_srv.0);
    let to = net.addrs[1];

    // Re-addressed to the other live connection's QPN: refused by its identity check
    // (the token belongs to connection A), nothing of B moves.
    net.eps[1].mr_write(dst.lkey, 0, &[0; 256]).unwrap();
    let st0 = net.eps[1].stats();
    let b0 = net.eps[1].connection_stats(b_srv).unwrap();
    let forged = readdress(&copy.data, b_srv.0, copy.from, to);
    net.deliver(1, copy.from, &forged);
    let st1 = net.eps[1].stats();
    let b1 = net.eps[1].connection_stats(b_srv).unwrap();
    assert_eq!(
        st1.bad_auth,
        st0.bad_auth + 1,
        "refused at the identity check"
    );
    assert_eq!(b1.data_packets_received, b0.data_packets_received);
    assert_eq!(b1.recv, b0.recv);
    assert!(net.eps[1]
        .mr_read(dst.lkey, 0, 256)
        .unwrap()
        .iter()
        .all(|&x| x == 0));

    // Connection A closes on both sides; its packets then find no connection, and its
    // index entries are gone with it.
    net.eps[0].close(net.now, a);
    net.run_until(net.elapsed() + Duration::from_secs(2), |n| {
        n.eps[1].connection_stats(a_srv).is_none()
    });
    assert!(net.eps[1].connection_stats(a_srv).is_none());
    let st2 = net.eps[1].stats();
    for _ in 0..3 {
        net.deliver(1, copy.from, &copy.data);
    }
    let st3 = net.eps[1].stats();
    assert_eq!(st3.unknown_connection, st2.unknown_connection + 3);
    assert!(net.eps[1]
        .mr_read(dst.lkey, 0, 256)
        .unwrap()
        .iter()
        .all(|&x| x == 0));
    assert_eq!(net.eps[1].connections().count(), 1);
    net.run_for(Duration::from_millis(50));
    // B still works, and its WRITE lands where A's forged copy did not.
    net.eps[0]
        .post_write(b, write(2, src.lkey, 256, dst.addr, dst.rkey))
        .unwrap();
    assert_eq!(complete(&mut net, b, 2), WcStatus::Success);
    assert_eq!(
        net.eps[1].mr_read(dst.lkey, 0, 256).unwrap(),
        pattern(1, 256)
    );
    // Only B's connection is left in the index: once B is closed too, nothing is.
    net.eps[0].close(net.now, b);
    net.run_until(net.elapsed() + Duration::from_secs(2), |n| {
        n.eps[1].connections().count() == 0 && n.eps[0].connections().count() == 0
    });
    assert_eq!(net.eps[1].table_sizes().index, 0);
    assert_eq!(net.eps[0].table_sizes().index, 0);
}

#[test]
fn writes_copied_from_the_region_arrive_whole() {
    let mut net = Net::new(9);
    let (c, s) = net.connect();
    let total = 64 * 1024;
    let src = net.eps[0].register_mr(pattern(7, total), Access::LOCAL_WRITE);
    let dst = net.eps[1].register_mr(vec![0; total], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    // Lengths with every remainder mod 4 (pad bytes), one packet, a path MTU and more.
    let lens = [
        1u32, 2, 3, 5, 63, 64, 1023, 1024, 1025, 4095, 4096, 4097, 9001, 30_000,
    ];
    let mut off = 0u64;
    for (k, &len) in lens.iter().enumerate() {
        let mut w = write(k as u64, src.lkey, len, dst.addr + off, dst.rkey);
        w.local_offset = off;
        net.eps[0].post_write(c, w).unwrap();
        off += len as u64 + 1;
    }
    for k in 0..lens.len() as u64 {
        assert_eq!(complete(&mut net, c, k), WcStatus::Success);
    }
    let got = net.eps[1].mr_read(dst.lkey, 0, total as u64).unwrap();
    let want = pattern(7, total);
    let mut off = 0usize;
    for &len in &lens {
        let r = off..off + len as usize;
        assert_eq!(got[r.clone()], want[r], "WRITE of {len} bytes");
        // The byte after each WRITE was not touched.
        assert_eq!(got[off + len as usize], 0);
        off += len as usize + 1;
    }
    assert_eq!(
        net.eps[1].connection_stats(s).unwrap().recv.write_bytes,
        lens.iter().map(|&l| l as u64).sum::<u64>(),
        "each byte placed once"
    );
}
