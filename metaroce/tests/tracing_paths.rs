//! Per-path tracing: every loss, timeout, retransmission and re-roll event is emitted inside
//! a `path{conn, path, port, plane}` span (or carries those fields), so a user reading the
//! log can tell which path and which UDP source port lost, retransmitted or was re-rolled.

use bytes::Bytes;
use metaroce::testing::{Impair, Pair};
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A `MakeWriter` collecting everything into one buffer.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Capture {
    type Writer = Capture;
    fn make_writer(&'a self) -> Capture {
        self.clone()
    }
}

#[test]
fn loss_timeout_and_reroll_events_name_the_path_and_its_source_port() {
    let cap = Capture::default();
    let sub = tracing_subscriber::fmt()
        .with_writer(cap.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::TRACE)
        .finish();
    let _g = tracing::subscriber::set_default(sub);

    // Path 0 of the client leaves from UDP source port 0xC000; that port is blackholed.
    const BLACKHOLED: u16 = 0xC000;
    let mut p = Pair::impaired(
        21,
        Impair {
            blackhole_port: Some(BLACKHOLED),
            ..Default::default()
        },
    );
    let (c, _) = p.connect();
    for i in 0..300u64 {
        p.eps[0]
            .post_send(c, 0, i, Bytes::from(vec![i as u8; 6000]))
            .unwrap();
    }
    assert!(p.run_until(Duration::from_secs(60), |p| p.events[1].len() == 300));
    // Keep traffic flowing until the blackholed path has timed out often enough to be
    // re-rolled.
    let rerolled = |p: &Pair| p.eps[0].connection_stats(c).unwrap().paths[0].stats.rerolls >= 1;
    for round in 0..20u64 {
        if rerolled(&p) {
            break;
        }
        for i in 0..100u64 {
            p.eps[0]
                .post_send(c, 0, 1000 * (round + 1) + i, Bytes::from(vec![1u8; 6000]))
                .unwrap();
        }
        let n = p.events[1].len() + 100;
        assert!(p.run_until(Duration::from_secs(600), |p| p.events[1].len() >= n));
    }
    let st = p.eps[0].connection_stats(c).unwrap();
    assert!(rerolled(&p), "{:?}", st.paths[0]);

    let log = String::from_utf8(cap.0.lock().unwrap().clone()).unwrap();
    let conn = format!("conn={c}");
    let span = format!("path{{{conn} path=0 port={BLACKHOLED} plane=0}}");
    let lines = |what: &str| -> Vec<&str> { log.lines().filter(|l| l.contains(what)).collect() };

    // The timeouts of the blackholed path are reported in its span, with its port.
    let rto = lines("retransmission timeout");
    assert!(
        rto.iter().any(|l| l.contains(&span)),
        "no RTO in {span}: {rto:#?}"
    );
    // No other path timed out (they all deliver), so no RTO names another port.
    assert!(
        rto.iter().all(|l| l.contains("path=0")),
        "RTO on a healthy path: {rto:#?}"
    );
    // The re-roll names the old (blackholed) and the new port.
    let rr = lines("path re-rolled");
    assert!(
        rr.iter().any(|l| l.contains(&span)
            && l.contains(&format!("old_port={BLACKHOLED}"))
            && l.contains("new_port=")),
        "{rr:#?}"
    );
    // Retransmissions say on which path and port they went out, and with which PSN.
    let rx = lines("retransmission ");
    assert!(
        rx.iter().any(|l| l.contains(&conn)
            && l.contains("path=")
            && l.contains("port=")
            && l.contains("psn=")),
        "{rx:#?}"
    );
    // Tail-loss probes too are attributed to the blackholed path.
    let tlp = lines("tail-loss probe");
    assert!(tlp.iter().any(|l| l.contains(&span)), "{tlp:#?}");
}
