//! The WRITE_WITH_IMM fence (docs/PROTOCOL.md "Semantics", RDMA WRITE): the immediate of op
//! id *k* reaches the responder's application only once every op id before *k* of the
//! connection is finished — every byte of every earlier WRITE in memory — while the data of
//! all of them is still placed out of order. Memory is copied the moment the event is
//! polled (the harness polls after every datagram and timer).

mod harness;

use harness::*;
use metaroce::{Access, Event, ReadRequest, WcStatus, WriteRequest};
use std::time::Duration;

const BIG: usize = 256 * 1024;

/// Holds back the first copy of some middle segments of op 0 (the big WRITE) so that it
/// finishes long after the small WRITE with immediate posted after it has landed.
fn hold_op0(net: &mut Net) {
    net.add_rule(Rule::always(
        Filter::any().from(0).when(|p| {
            p.write.is_some_and(|(_, w, _)| {
                w.op_id == 0 && !p.retransmit && (w.offset / 1024) % 37 == 5
            })
        }),
        Action::Hold {
            prob: 1.0,
            after: Duration::from_millis(3),
        },
    ));
}

#[test]
fn imm_waits_for_every_byte_of_an_earlier_write() {
    for seed in 0..6u64 {
        let mut net = Net::new(seed);
        hold_op0(&mut net);
        net.add_rule(Rule::always(Filter::any(), Action::Drop(0.02)));
        net.add_rule(Rule::always(
            Filter::any(),
            Action::Jitter {
                prob: 0.2,
                max: Duration::from_micros(30),
            },
        ));
        let (c, s) = net.connect();
        let src = pattern(seed, BIG);
        let local = net.eps[0].register_mr(src.clone(), Access::LOCAL_WRITE);
        let big = net.eps[1].register_mr(vec![0; BIG], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        let small = net.eps[1].register_mr(vec![0; 64], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        net.snap_on_imm = Some((1, big.lkey, 0, BIG as u64));
        let w = |wr_id, len: u32, dst: &metaroce::MrKeys, imm| WriteRequest {
            wr_id,
            lkey: local.lkey,
            local_offset: 0,
            len,
            remote_addr: dst.addr,
            rkey: dst.rkey,
            imm,
        };
        net.eps[0]
            .post_write(c, w(1, BIG as u32, &big, None))
            .unwrap();
        net.eps[0]
            .post_write(c, w(2, 16, &small, Some(0xABCD)))
            .unwrap();
        let ok = net.run_until(Duration::from_secs(10), |n| n.completions(0, c).len() == 2);
        assert!(ok, "seed {seed}: WRITEs did not complete");
        assert!(net
            .completions(0, c)
            .iter()
            .all(|wc| wc.status == WcStatus::Success));
        let imms = net.immediates(1, s);
        assert_eq!(imms, vec![(0xABCD, 16)], "seed {seed}");
        assert_eq!(net.imm_snaps.len(), 1);
        let (imm, mem) = &net.imm_snaps[0];
        assert_eq!(*imm, 0xABCD);
        let missing = mem.iter().zip(&src).filter(|(a, b)| a != b).count();
        assert_eq!(
            missing, 0,
            "seed {seed}: immediate reported with {missing} bytes of the earlier WRITE not in memory"
        );
        let st = net.last_stats[1][&s].recv;
        println!(
            "seed {seed}: immediate after the earlier WRITE landed; held now {}, drops {}",
            st.held_immediates, st.held_immediate_drops
        );
    }
}

/// A READ and a refused WRITE between two WRITEs with immediate do not block the second
/// immediate: both finish at the responder (executed / refused), so the floor moves past them.
#[test]
fn read_and_refused_write_in_between_do_not_block_the_immediate() {
    let mut net = Net::new(7);
    net.add_rule(Rule::always(Filter::any(), Action::Drop(0.03)));
    let (c, s) = net.connect();
    let src = pattern(7, 8192);
    let local = net.eps[0].register_mr(src.clone(), Access::LOCAL_WRITE);
    let dst = net.eps[1].register_mr(
        vec![0; 8192],
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    let w = |wr_id, rkey, imm| WriteRequest {
        wr_id,
        lkey: local.lkey,
        local_offset: 0,
        len: 4096,
        remote_addr: dst.addr,
        rkey,
        imm,
    };
    net.eps[0].post_write(c, w(1, dst.rkey, Some(1))).unwrap();
    net.eps[0]
        .post_read(
            c,
            ReadRequest {
                wr_id: 2,
                lkey: local.lkey,
                local_offset: 4096,
                len: 1024,
                remote_addr: dst.addr,
                rkey: dst.rkey,
            },
        )
        .unwrap();
    net.eps[0]
        .post_write(c, w(3, dst.rkey ^ 0x5555, None))
        .unwrap();
    net.eps[0].post_write(c, w(4, dst.rkey, Some(2))).unwrap();
    let ok = net.run_until(Duration::from_secs(10), |n| {
        n.completions(0, c).len() == 4 && n.immediates(1, s).len() == 2
    });
    assert!(
        ok,
        "{:?} / {:?}",
        net.completions(0, c),
        net.immediates(1, s)
    );
    let st: Vec<WcStatus> = net.completions(0, c).iter().map(|wc| wc.status).collect();
    assert_eq!(
        st,
        vec![
            WcStatus::Success,
            WcStatus::Success,
            WcStatus::RemoteAccessError,
            WcStatus::Success
        ]
    );
    assert_eq!(net.immediates(1, s), vec![(1, 4096), (2, 4096)]);
}

/// Held immediates are bounded by `max_held_immediates`: above it the completing packet of a
/// further WRITE with immediate is dropped unacknowledged and re-sent; every immediate still
/// arrives exactly once, in op id order, each after all earlier WRITEs landed.
#[test]
fn held_immediates_are_bounded() {
    let mut a = config(0, 3);
    let mut b = config(1, 3);
    a.transport.max_held_immediates = 2;
    b.transport.max_held_immediates = 2;
    let mut net = Net::with_configs(3, a, b);
    hold_op0(&mut net);
    let (c, s) = net.connect();
    let src = pattern(3, BIG);
    let local = net.eps[0].register_mr(src.clone(), Access::LOCAL_WRITE);
    let dst = net.eps[1].register_mr(
        vec![0; BIG + 64 * 16],
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    );
    net.snap_on_imm = Some((1, dst.lkey, 0, BIG as u64));
    net.eps[0]
        .post_write(
            c,
            WriteRequest {
                wr_id: 0,
                lkey: local.lkey,
                local_offset: 0,
                len: BIG as u32,
                remote_addr: dst.addr,
                rkey: dst.rkey,
                imm: None,
            },
        )
        .unwrap();
    for k in 1..=10u64 {
        net.eps[0]
            .post_write(
                c,
                WriteRequest {
                    wr_id: k,
                    lkey: local.lkey,
                    local_offset: 0,
                    len: 16,
                    remote_addr: dst.addr + BIG as u64 + 16 * k,
                    rkey: dst.rkey,
                    imm: Some(k as u32),
                },
            )
            .unwrap();
    }
    let mut max_held = 0;
    let done = net.run_until(Duration::from_secs(10), |n| {
        if let Some(st) = n.last_stats[1].get(&s) {
            max_held = max_held.max(st.recv.held_immediates);
        }
        n.completions(0, c).len() == 11
    });
    assert!(done);
    let st = net.last_stats[1][&s].recv;
    println!(
        "max held {max_held}, drops for the bound {}",
        st.held_immediate_drops
    );
    assert!(max_held <= 2, "held {max_held} > max_held_immediates");
    assert!(st.held_immediate_drops > 0, "the bound was never reached");
    let imms: Vec<u32> = net.immediates(1, s).iter().map(|i| i.0).collect();
    assert_eq!(imms, (1..=10).collect::<Vec<u32>>());
    for (imm, mem) in &net.imm_snaps {
        assert!(
            mem[..] == src[..],
            "immediate {imm} before the big WRITE landed"
        );
    }
    assert!(net.events[1]
        .iter()
        .all(|e| !matches!(e, Event::WriteWithImm { byte_len, .. } if *byte_len != 16)));
}
