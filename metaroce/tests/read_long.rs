//! A READ whose response takes longer to arrive than the requester's whole response-timeout
//! budget: response packets that keep arriving are progress, so the READ must complete
//! without being sent again and without failing (IBA: the requester's transport timer is
//! restarted by every valid response packet).

use metaroce::testing::{Impair, Pair};
use metaroce::{Access, Event, ReadRequest, WcOpcode, WcStatus, WorkCompletion};
use std::time::Duration;

fn completions(events: &[Event]) -> Vec<WorkCompletion> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Completion { wc, .. } => Some(*wc),
            _ => None,
        })
        .collect()
}

#[test]
fn long_read_response_is_progress_not_a_timeout() {
    let seed = 7;
    let mut a = metaroce::testing::pair_config(0, seed);
    let mut b = metaroce::testing::pair_config(1, seed);
    // A small retry budget so the READ outlasts it: with path RTOs near the 1 ms minimum
    // (RTT 200 us) the requester's response waits (twice the largest RTO, doubling) add
    // up to about 2 + 4 = 6 ms before the READ would fail.
    for c in [&mut a, &mut b] {
        c.transport.retry_count = 1;
    }
    let mut p = Pair::impaired_with_configs(seed, Impair::default(), a, b);
    // 100 us one way: the response is window-limited to over 12 ms of virtual time (when
    // response packets do not restart the wait, the READ fails after about 9 ms).
    p.delay = Duration::from_micros(100);
    let (c, _) = p.connect();
    let n = 64usize << 20;
    let src: Vec<u8> = (0..n).map(|i| (i * 7 + i / 4093) as u8).collect();
    let remote = p.eps[1].register_mr(src.clone(), Access::REMOTE_READ);
    let local = p.eps[0].register_mr(vec![0; n], Access::LOCAL_WRITE);
    let req = ReadRequest {
        wr_id: 1,
        lkey: local.lkey,
        local_offset: 0,
        len: n as u32,
        remote_addr: remote.addr,
        rkey: remote.rkey,
    };
    let start = p.now;
    p.eps[0].post_read(c, req).unwrap();
    assert!(
        p.run_until(Duration::from_secs(60), |p| !completions(&p.events[0])
            .is_empty()),
        "the READ never completed"
    );
    let took = p.now - start;
    let wcs = completions(&p.events[0]);
    assert_eq!(
        (wcs[0].wr_id, wcs[0].status, wcs[0].opcode),
        (1, WcStatus::Success, WcOpcode::RdmaRead),
        "READ of {n} bytes over {took:?} of virtual time"
    );
    // The response outlasted the requester's response-timeout budget (else this test
    // shows nothing).
    assert!(
        took > Duration::from_millis(12),
        "the response took only {took:?}"
    );
    let got = p.eps[0].mr_read(local.lkey, 0, n as u64).unwrap();
    assert!(got == src, "READ data differs");
}
