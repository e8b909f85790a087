//! The one driver task: feeds datagrams, IP packets and timers into a core, flushes its
//! transmits and routes its events to the waiting handles. It drives a MetaRoCE endpoint
//! shard (`endpoint::Shared`: MetaRoCE connections and RC QPs over a datagram backend,
//! native RC QPs over an IP backend) and a stand-alone RoCEv2 host
//! (`rocev2::RcEndpoint`: RC QPs over an IP backend) through [`Driven`].

use crate::backend::{DatagramBackend, RecvMeta};
use crate::connection::ConnEntry;
use crate::endpoint::{OpDone, Shared, State, Waiter};
use crate::error::Error;
use crate::rocev2::IpBackend;
use crate::stream::{lock_rx, RxEnd, StreamEntry};
use metaroce::rocev2::RcTransmit;
use metaroce::{
    ConnectionError, ConnectionHandle, Event, Lent, Transmit, WcStatus, WorkCompletion,
};
use std::future::poll_fn;
use std::io::IoSliceMut;
use std::sync::{Arc, MutexGuard};
use std::time::Instant;
use tokio::sync::Notify;

/// Receive buffers per poll, each large enough for a full GRO batch of 64 KiB.
const RECV_BUFS: usize = 8;
const RECV_BUF_LEN: usize = 1 << 16;
/// Transmits gathered under one lock before they are sent.
const TX_BATCH: usize = 32;
/// Receive errors in a row after which the driver pauses before receiving again (1 ms,
/// doubling to 128 ms). A transient error (ENOMEM, say) costs nothing. The backends'
/// sockets are unconnected and do not set `IP_RECVERR`, so a peer's ICMP errors never
/// surface as receive errors; a backend that reported them would let a peer drive this
/// pause, and must not count them here.
const RECV_ERRORS_BEFORE_BACKOFF: u32 = 3;
/// IP packets taken without waiting after one arrived (a burst is handled under one lock).
const IP_DRAIN: usize = 64;

/// What the driver drives: a sans-IO core behind a lock, with its backends. The core's
/// calls take the locked state; the rest are the host's.
pub(crate) trait Driven: Send + Sync + 'static {
    type State: Send;
    /// The state, locked.
    fn lock(&self) -> MutexGuard<'_, Self::State>;
    /// The datagram backend (MetaRoCE, RC over UDP), if any.
    fn datagrams(&self) -> Option<&dyn DatagramBackend>;
    /// The whole-IP-packet backend (native RoCEv2), if any.
    fn ip(&self) -> Option<&dyn IpBackend>;
    /// Notified when work was posted or the host is closing.
    fn woken(&self) -> &Notify;
    fn poll_timeout(st: &Self::State) -> Option<Instant>;
    fn handle_timeout(st: &mut Self::State, now: Instant);
    fn handle_datagram(st: &mut Self::State, now: Instant, meta: &RecvMeta, d: &[u8]);
    fn poll_transmit(st: &mut Self::State, now: Instant, buf: &mut Vec<u8>) -> Option<Transmit>;
    /// `poll_transmit` with gather send ([`metaroce::Endpoint::poll_transmit_lent`]); the
    /// default lends nothing.
    fn poll_transmit_lent(
        st: &mut Self::State,
        now: Instant,
        buf: &mut Vec<u8>,
        lent: &mut Lent,
    ) -> Option<Transmit> {
        lent.clear();
        Self::poll_transmit(st, now, buf)
    }
    fn handle_ip_packet(st: &mut Self::State, now: Instant, pkt: &[u8]);
    fn poll_ip_transmit(
        st: &mut Self::State,
        now: Instant,
        payload: &mut Vec<u8>,
    ) -> Option<RcTransmit>;
    /// Route the core's events to the waiting handles (under the lock).
    fn dispatch(&self, st: &mut Self::State);
    /// Whether the driver may stop, given that nothing is left to send.
    fn may_stop(&self, st: &Self::State) -> bool;
    /// Work to do once the lock is released (regions to deregister from every shard).
    fn take_deferred(_st: &mut Self::State) -> Vec<u32> {
        Vec::new()
    }
    fn run_deferred(&self, _lkeys: &mut Vec<u32>) {}
    /// The driver returned.
    fn on_stop(&self) {}
    /// Hands datagram `d` (of a buffer this shard received) to the shard it belongs to,
    /// if that is another one: the kernel steers a GSO or GRO buffer whole by its first
    /// datagram. `true` if handed over (this core must not see it). Default: `false`.
    fn hand_over(&self, _meta: &RecvMeta, _d: &[u8]) -> bool {
        false
    }
    /// Feeds the datagrams other shards handed over ([`hand_over`](Self::hand_over))
    /// into the locked core; whether there were any. Default: nothing.
    fn take_handed_over(&self, _st: &mut Self::State, _now: Instant) -> bool {
        false
    }
    /// The driver task was dropped before it returned (its runtime shut down, or the task
    /// was aborted): nothing will drive the core again. Fails what waits on it, then
    /// [`on_stop`](Self::on_stop).
    fn on_abandoned(&self) {
        self.on_stop();
    }
    /// Transmits an application task left for the driver (`transmit_inline`), moved to
    /// `out` ahead of the core's; and marks the backend's send side taken by the driver
    /// when `out` is not empty.
    fn take_unsent(_st: &mut Self::State, _out: &mut Vec<(Transmit, Vec<u8>, Lent)>) {}
    /// The driver is about to hand `out` to the backend: its send side is taken.
    fn mark_sending(_st: &mut Self::State) {}
    /// The driver computed the timer it will sleep until.
    fn set_deadline(_st: &mut Self::State, _deadline: Option<Instant>) {}
    /// The driver finished handing its batch to the backend.
    fn sent_batch(&self) {}
}

impl Driven for Shared {
    type State = State;
    fn lock(&self) -> MutexGuard<'_, State> {
        Shared::lock(self)
    }
    fn datagrams(&self) -> Option<&dyn DatagramBackend> {
        Some(&*self.backend)
    }
    fn ip(&self) -> Option<&dyn IpBackend> {
        self.ip_backend.as_deref()
    }
    fn woken(&self) -> &Notify {
        &self.wake_driver
    }
    fn poll_timeout(st: &State) -> Option<Instant> {
        st.core.poll_timeout()
    }
    fn handle_timeout(st: &mut State, now: Instant) {
        st.core.handle_timeout(now);
    }
    fn handle_datagram(st: &mut State, now: Instant, meta: &RecvMeta, d: &[u8]) {
        st.core
            .handle_datagram(now, meta.from, meta.local_ip, meta.ecn, d);
    }
    fn hand_over(&self, meta: &RecvMeta, d: &[u8]) -> bool {
        match self.shard_of(d) {
            Some(other) => {
                other.hand_over(meta, d);
                true
            }
            None => false,
        }
    }
    fn take_handed_over(&self, st: &mut State, now: Instant) -> bool {
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        if inbox.datagrams.is_empty() {
            return false;
        }
        let datagrams = std::mem::take(&mut inbox.datagrams);
        inbox.bytes = 0;
        drop(inbox);
        for (meta, d) in &datagrams {
            st.core
                .handle_datagram(now, meta.from, meta.local_ip, meta.ecn, d);
        }
        true
    }
    fn poll_transmit(st: &mut State, now: Instant, buf: &mut Vec<u8>) -> Option<Transmit> {
        st.core.poll_transmit(now, buf)
    }
    fn poll_transmit_lent(
        st: &mut State,
        now: Instant,
        buf: &mut Vec<u8>,
        lent: &mut Lent,
    ) -> Option<Transmit> {
        st.core.poll_transmit_lent(now, buf, lent)
    }
    fn handle_ip_packet(st: &mut State, now: Instant, pkt: &[u8]) {
        st.core.handle_ip_packet(now, pkt);
    }
    fn poll_ip_transmit(st: &mut State, now: Instant, payload: &mut Vec<u8>) -> Option<RcTransmit> {
        st.core.poll_rc_transmit(now, payload)
    }
    fn dispatch(&self, st: &mut State) {
        self.sync_fair_share(st);
        dispatch(st, self);
        // Wake `wait_idle` when the last connection and pending CLOSE are gone. The core's
        // table sizes are read only once the handles' map is empty: `table_sizes` walks the
        // core's timer index and re-reads the deadline of every connection touched since
        // the last flush (O(connections)), and this runs after every batch of events and
        // every inline transmit (six times per round trip of a 64 B ping-pong).
        if st.conns.is_empty() {
            let t = st.core.table_sizes();
            if t.connections == 0 && t.closers == 0 {
                self.idle.notify_waiters();
            }
        }
    }
    fn may_stop(&self, st: &State) -> bool {
        st.drained()
    }
    fn take_deferred(st: &mut State) -> Vec<u32> {
        std::mem::take(&mut st.dereg_later)
    }
    fn run_deferred(&self, lkeys: &mut Vec<u32>) {
        // Regions the core finished with (cancelled atomics' results): off every shard,
        // each under its own lock.
        for lkey in lkeys.drain(..) {
            self.deregister_everywhere(lkey);
        }
    }
    fn take_unsent(st: &mut State, out: &mut Vec<(Transmit, Vec<u8>, Lent)>) {
        out.extend(st.unsent.drain(..).map(|(t, b)| (t, b, Lent::new())));
    }
    fn set_deadline(st: &mut State, deadline: Option<Instant>) {
        st.driver_deadline = Some(deadline);
    }
    fn mark_sending(st: &mut State) {
        st.tx_busy = true;
    }
    fn sent_batch(&self) {
        self.lock().tx_busy = false;
    }
    fn on_stop(&self) {
        self.stopped
            .store(true, std::sync::atomic::Ordering::Release);
        self.idle.notify_waiters();
        tracing::debug!("driver stopped");
    }
    fn on_abandoned(&self) {
        tracing::debug!("driver dropped before it stopped (runtime shut down?)");
        let mut st = self.lock();
        // As `Endpoint::close`, without the closing handshakes nobody will send: new calls
        // fail with `EndpointClosed`, `accept` ends.
        st.closed = true;
        st.incoming = None;
        // Pending connects and operations: their senders dropped, they end with
        // `EndpointClosed`.
        st.connecting.clear();
        st.waiters.clear();
        // `Connection::closed` resolves, streams end.
        for e in st.conns.values_mut() {
            e.on_lost(ConnectionError::LocallyClosed);
        }
        // The RC queue pairs hosted beside them.
        st.rc.abandon();
        drop(st);
        self.sq_space.notify_waiters();
        self.on_stop();
    }
}

/// Calls [`Driven::on_abandoned`] if the driver future is dropped before it returns.
struct Abandoned<D: Driven> {
    shared: Arc<D>,
    returned: bool,
}

impl<D: Driven> Drop for Abandoned<D> {
    fn drop(&mut self) {
        if !self.returned {
            self.shared.on_abandoned();
        }
    }
}

/// The driver task's future. A runtime that shuts down drops it, at an await or before its
/// first poll: either way the handles must not wait for a driver that is gone (found by a
/// new user's trial: every handle hung). So the guard is made here, outside the `async`
/// body, and moved into it: a future dropped before it ever ran drops the guard too. (When
/// it was made inside the body, a runtime shut down before the spawned task was first
/// polled left the handles waiting: `rocev2_async::rc_handles_end_when_the_runtime_of_the_
/// driver_shuts_down` timed out now and then.)
pub(crate) fn run<D: Driven>(shared: Arc<D>) -> impl std::future::Future<Output = ()> {
    let abandoned = Abandoned {
        shared: shared.clone(),
        returned: false,
    };
    drive(shared, abandoned)
}

async fn drive<D: Driven>(shared: Arc<D>, mut abandoned: Abandoned<D>) {
    // Fixed arrays: the receive's I/O vectors are built on the stack for every wait, not
    // collected into a `Vec` (one allocation per wake-up, so per datagram in a ping-pong).
    let mut bufs: [Vec<u8>; RECV_BUFS] = std::array::from_fn(|_| vec![0u8; RECV_BUF_LEN]);
    let mut metas = [RecvMeta::EMPTY; RECV_BUFS];
    let mut pool: Vec<Vec<u8>> = Vec::new();
    let mut out: Vec<(Transmit, Vec<u8>, Lent)> = Vec::with_capacity(TX_BATCH);
    let mut lents: Vec<Lent> = Vec::new();
    // Gather send (issue #13, P1): WRITE payloads go from their regions
    // to the kernel in one copy, when the backend sends I/O vectors.
    let gather = shared.datagrams().is_some_and(|d| d.sends_gathered());
    // A transmit in more pieces than fit the stack array below, joined.
    let mut joined = Vec::new();
    // Native RoCEv2 QPs (only with an IP backend): whole IP packets in and out.
    let mut ip_out: Vec<(std::net::IpAddr, Vec<u8>)> = Vec::new();
    let mut ip_payload = Vec::new();
    let mut ip_rbuf = if shared.ip().is_some() {
        vec![0u8; RECV_BUF_LEN]
    } else {
        Vec::new()
    };
    let has_dgram = shared.datagrams().is_some();
    let has_ip = shared.ip().is_some();
    // One timer for the driver's life, moved only when the core's deadline changes: a new
    // `Sleep` per wait registered and removed a timer-wheel entry at every wake-up (once per
    // datagram in a ping-pong), though the deadline mostly stays put.
    let mut sleep = std::pin::pin!(tokio::time::sleep_until(tokio::time::Instant::now()));
    // The deadline `sleep` is set to and has not fired for.
    let mut armed: Option<Instant> = None;
    // Receive errors in a row (reset by a successful receive).
    let mut recv_errors: u32 = 0;
    loop {
        // Flush everything the core wants to send, in batches gathered under the lock.
        loop {
            let deadline;
            let mut deferred;
            {
                let mut st = shared.lock();
                let mut now = Instant::now();
                let mut due = D::poll_timeout(&st).is_some_and(|t| t <= now);
                // Whether the core or the clock changed since `due` was read.
                let mut changed = false;
                if due {
                    // A loss timer that came due while the task was not running (scheduling
                    // delay, a long send batch) must see the ACKs that arrived meanwhile, or
                    // it fires tail-loss probes and timeouts for packets already delivered:
                    // take in what the socket holds first. (One lock and one clock read
                    // when nothing is due, the usual case.)
                    drop(st);
                    drain_ready(&*shared, &mut bufs, &mut metas);
                    st = shared.lock();
                    now = Instant::now();
                    changed = true;
                }
                // Datagrams of this shard that another shard received (inside a GSO or
                // GRO buffer steered by its first datagram).
                changed |= shared.take_handed_over(&mut st, now);
                // (The core's deadline is read again only if something changed since: each
                // read computes the deadline of every connection touched since the core's
                // last flush of its timer index, O(paths) each.)
                if changed {
                    due = D::poll_timeout(&st).is_some_and(|t| t <= now);
                }
                if due {
                    D::handle_timeout(&mut st, now);
                }
                // What an application task could not send goes first (it left the core
                // before anything polled now).
                D::take_unsent(&mut st, &mut out);
                while has_dgram && out.len() < TX_BATCH {
                    let mut buf = pool
                        .pop()
                        .unwrap_or_else(|| Vec::with_capacity(RECV_BUF_LEN));
                    let mut lent = lents.pop().unwrap_or_default();
                    let t = if gather {
                        D::poll_transmit_lent(&mut st, now, &mut buf, &mut lent)
                    } else {
                        D::poll_transmit(&mut st, now, &mut buf)
                    };
                    match t {
                        Some(t) => out.push((t, buf, lent)),
                        None => {
                            pool.push(buf);
                            lents.push(lent);
                            break;
                        }
                    }
                }
                if has_ip {
                    while ip_out.len() < TX_BATCH {
                        let Some(t) = D::poll_ip_transmit(&mut st, now, &mut ip_payload) else {
                            break;
                        };
                        let mut pkt = Vec::with_capacity(t.size + 48);
                        if t.write_ip_packet(&ip_payload[..t.size], &mut pkt).is_ok() {
                            ip_out.push((t.destination.ip(), pkt));
                        }
                    }
                }
                shared.dispatch(&mut st);
                if out.is_empty() && ip_out.is_empty() && shared.may_stop(&st) {
                    drop(st);
                    abandoned.returned = true;
                    shared.on_stop();
                    return;
                }
                deadline = D::poll_timeout(&st);
                D::set_deadline(&mut st, deadline);
                if !out.is_empty() {
                    D::mark_sending(&mut st);
                }
                deferred = D::take_deferred(&mut st);
            }
            shared.run_deferred(&mut deferred);
            let full = out.len() == TX_BATCH || ip_out.len() == TX_BATCH;
            if let Some(ipb) = shared.ip() {
                for (dst, pkt) in ip_out.drain(..) {
                    if let Err(e) = poll_fn(|cx| ipb.poll_send(cx, &pkt, dst)).await {
                        tracing::debug!(error = %e, %dst, "rocev2 send failed");
                    }
                }
            }
            let sent_some = !out.is_empty();
            if let Some(dgb) = shared.datagrams() {
                for (t, mut buf, mut lent) in out.drain(..) {
                    let sent = if lent.is_empty() {
                        // The backend may keep `buf` (no copy) and hand back another buffer.
                        poll_fn(|cx| dgb.poll_send_owned(cx, &t, &mut buf)).await
                    } else {
                        poll_fn(|cx| send_lent(dgb, cx, &t, &buf, &lent, &mut joined)).await
                    };
                    if let Err(e) = sent {
                        // A failed send is a lost packet: the transport recovers.
                        tracing::debug!(error = %e, dest = %t.destination, "send failed");
                    }
                    pool.push(buf);
                    lent.clear();
                    lents.push(lent);
                }
                // Backends that batch submissions (io_uring) hand the batch to the kernel
                // here.
                dgb.flush();
            }
            if sent_some {
                shared.sent_batch();
            }
            if !full {
                // Wait for input, a timer or new work.
                if deadline != armed {
                    if let Some(d) = deadline {
                        sleep.as_mut().reset(d.into());
                    }
                    armed = deadline;
                }
                let mut iovs = bufs.each_mut().map(|b| IoSliceMut::new(b));
                // `Some(true)`: the backend lent its buffers and the datagrams were handled
                // in place; `Some(false)`: they are in `bufs` / `metas`.
                let recv = poll_fn(|cx| {
                    let Some(dgb) = shared.datagrams() else {
                        return std::task::Poll::Pending;
                    };
                    // The core's lock and the clock are taken once per batch of lent
                    // buffers (at the first), not once per buffer: at 64 B each buffer is
                    // one datagram.
                    let mut held = None;
                    let mut handle = |meta: &RecvMeta, buf: &[u8]| {
                        handle_lent(&*shared, &mut held, meta, buf);
                    };
                    let lent = dgb.poll_recv_in_place(cx, RECV_BUFS, &mut handle);
                    // The core's lock is released before any other backend call (the order
                    // is backend, then core), whatever the backend answered.
                    drop(held);
                    if let Some(p) = lent {
                        return p.map(|r| r.map(|n| (n, true)));
                    }
                    dgb.poll_recv(cx, &mut iovs, &mut metas)
                        .map(|r| r.map(|n| (n, false)))
                });
                let ip_recv = poll_fn(|cx| match shared.ip() {
                    Some(b) => b.poll_recv(cx, &mut ip_rbuf),
                    None => std::task::Poll::Pending,
                });
                tokio::select! {
                    r = ip_recv, if has_ip => match r {
                        Ok(n) => {
                            let mut st = shared.lock();
                            let now = Instant::now();
                            D::handle_ip_packet(&mut st, now, &ip_rbuf[..n]);
                            // Take whatever else is queued without waiting.
                            if let Some(ipb) = shared.ip() {
                                let waker = futures::task::noop_waker();
                                let mut cx = std::task::Context::from_waker(&waker);
                                for _ in 0..IP_DRAIN {
                                    match ipb.poll_recv(&mut cx, &mut ip_rbuf) {
                                        std::task::Poll::Ready(Ok(n)) => {
                                            D::handle_ip_packet(&mut st, now, &ip_rbuf[..n]);
                                        }
                                        _ => break,
                                    }
                                }
                            }
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "rocev2 receive failed");
                            if e.kind() == std::io::ErrorKind::BrokenPipe {
                                // Memory link closed: do not spin on it.
                                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                            }
                        }
                    },
                    r = recv, if has_dgram => {
                        match r {
                            Ok((n, lent)) => {
                                recv_errors = 0;
                                let mut st = shared.lock();
                                let now = Instant::now();
                                let copied = if lent { 0 } else { n };
                                for (meta, buf) in metas[..copied].iter().zip(&bufs) {
                                    for d in meta.datagrams(buf) {
                                        if !shared.hand_over(meta, d) {
                                            D::handle_datagram(&mut st, now, meta, d);
                                        }
                                    }
                                }
                                // Drain whatever else is already queued without waiting,
                                // when the batch was full: a partial batch means the socket
                                // was empty, and another receive would only return EAGAIN
                                // (one wasted system call per datagram in a ping-pong).
                                drop(st);
                                if n == RECV_BUFS {
                                    drain_ready(&*shared, &mut bufs, &mut metas);
                                }
                            }
                            Err(e) => {
                                recv_errors += 1;
                                tracing::debug!(error = %e, in_a_row = recv_errors, "receive failed");
                                if recv_errors >= RECV_ERRORS_BEFORE_BACKOFF {
                                    // A lasting error (an io_uring whose submissions the
                                    // kernel refuses, say) answers every poll at once: without
                                    // a pause the driver spun and starved its runtime (found
                                    // by review). Timers wait at most the longest pause.
                                    let k = (recv_errors - RECV_ERRORS_BEFORE_BACKOFF).min(7);
                                    if k == 7 {
                                        tracing::warn!(error = %e, "receiving keeps failing");
                                    }
                                    let pause = std::time::Duration::from_millis(1 << k);
                                    tokio::time::sleep(pause).await;
                                }
                            }
                        }
                    }
                    _ = sleep.as_mut(), if armed.is_some() => armed = None,
                    _ = shared.woken().notified() => {}
                }
                break;
            }
            tokio::task::yield_now().await;
        }
    }
}

/// Most pieces [`send_lent`] passes on from the stack: a 64-datagram batch is 129.
const MAX_PIECES: usize = 160;

/// One poll of sending a gather transmit: `buf` with the payloads `lent` names, read from
/// their region under its lock for this one call (never across `Pending`). A region
/// deregistered since the packet was built fails the send (a lost packet: the re-send
/// finds the region gone and fails its work request).
fn send_lent(
    dgb: &dyn DatagramBackend,
    cx: &mut std::task::Context<'_>,
    t: &Transmit,
    buf: &[u8],
    lent: &Lent,
    joined: &mut Vec<u8>,
) -> std::task::Poll<std::io::Result<()>> {
    let sent = crate::mr::with_lent(lent, |region| {
        let mut pieces: [&[u8]; MAX_PIECES] = [&[]; MAX_PIECES];
        let mut n = 0;
        let fits = lent.for_each_piece(buf, region, |p| {
            if let Some(slot) = pieces.get_mut(n) {
                *slot = p;
            }
            n += 1;
        });
        if !fits {
            let e = std::io::Error::other("a lent payload lies outside its region");
            return std::task::Poll::Ready(Err(e));
        }
        if n <= MAX_PIECES {
            return dgb.poll_send_pieces(cx, t, &pieces[..n]);
        }
        lent.assemble(buf, region, joined);
        dgb.poll_send(cx, t, joined)
    });
    sent.unwrap_or_else(|| {
        let e = std::io::Error::other("the region of a lent payload was deregistered");
        std::task::Poll::Ready(Err(e))
    })
}

/// Receive datagrams that are ready now (non-blocking), up to a bound, so that a burst is
/// processed before the next flush.
fn drain_ready<D: Driven>(
    shared: &D,
    bufs: &mut [Vec<u8>; RECV_BUFS],
    metas: &mut [RecvMeta; RECV_BUFS],
) {
    let Some(dgb) = shared.datagrams() else {
        return;
    };
    let waker = futures::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    for _ in 0..4 {
        let mut held = None;
        let mut handle = |meta: &RecvMeta, buf: &[u8]| {
            handle_lent(shared, &mut held, meta, buf);
        };
        let lent = dgb.poll_recv_in_place(&mut cx, RECV_BUFS, &mut handle);
        drop(held);
        if let Some(p) = lent {
            match p {
                std::task::Poll::Ready(Ok(n)) if n > 0 => continue,
                _ => break,
            }
        }
        let mut iovs = bufs.each_mut().map(|b| IoSliceMut::new(b));
        match dgb.poll_recv(&mut cx, &mut iovs, metas) {
            std::task::Poll::Ready(Ok(n)) if n > 0 => {
                let mut st = shared.lock();
                let now = Instant::now();
                for (meta, buf) in metas[..n].iter().zip(bufs.iter()) {
                    for d in meta.datagrams(buf) {
                        if !shared.hand_over(meta, d) {
                            D::handle_datagram(&mut st, now, meta, d);
                        }
                    }
                }
            }
            _ => break,
        }
    }
}

/// Feeds the datagrams of one buffer a backend lent (`poll_recv_in_place`) into the core.
/// The first call of a batch locks the state and reads the clock into `held`; the later
/// ones reuse both, so a batch of buffers costs one lock and one clock read, as a batch of
/// copied buffers does. The caller drops `held` once the backend returned (the backend's
/// own lock is then released: the order stays backend, then core).
fn handle_lent<'a, D: Driven>(
    shared: &'a D,
    held: &mut Option<(MutexGuard<'a, D::State>, Instant)>,
    meta: &RecvMeta,
    buf: &[u8],
) {
    let (st, now) = held.get_or_insert_with(|| (shared.lock(), Instant::now()));
    for d in meta.datagrams(buf) {
        if !shared.hand_over(meta, d) {
            D::handle_datagram(st, *now, meta, d);
        }
    }
}

/// Route the core's events to the handles waiting for them.
fn dispatch(st: &mut State, shared: &Shared) {
    let mut freed = false;
    // Operations flushed (`WrFlushError`) in this batch of events, and the connections that
    // ended in it: the core reports an ending connection's flushes and then its
    // `ConnectionLost` in one batch, so an operation flushed in the batch where its
    // connection ended failed because of the end, and is told the reason.
    let mut flushed: Vec<(ConnectionHandle, Flushed, WorkCompletion)> = Vec::new();
    let mut ended: Vec<(ConnectionHandle, ConnectionError)> = Vec::new();
    while let Some(ev) = st.core.poll_event() {
        match ev {
            Event::Connected(h) => {
                tracing::debug!(conn = %h, "connected");
                if let Some(tx) = st.connecting.remove(&h) {
                    let _ = tx.send(Ok(()));
                }
            }
            Event::Incoming(h) => {
                // The core holds the request (manual accept) until `Incoming::accept`.
                let queued = !st.closed
                    && st
                        .incoming
                        .as_ref()
                        .is_some_and(|tx| tx.try_send((shared.shard, h)).is_ok());
                if queued {
                    st.conns.insert(h, ConnEntry::new());
                } else {
                    tracing::debug!(conn = %h, "connection request refused: accept queue full");
                    let _ = st.core.refuse_incoming(
                        h,
                        crate::endpoint::REFUSED_BUSY,
                        b"accept queue full",
                    );
                }
            }
            Event::ConnectionLost { conn, reason } => {
                tracing::debug!(%conn, %reason, "connection ended");
                let reason_for_flushes = reason.clone();
                if let Some(tx) = st.connecting.remove(&conn) {
                    let _ = tx.send(Err(reason.clone()));
                }
                if let Some(mut e) = st.conns.remove(&conn) {
                    e.on_lost(reason);
                }
                // Completions of every operation were reported before this event; a waiter
                // left over would never resolve.
                st.waiters.retain(|(c, _), _| *c != conn);
                freed = true;
                ended.push((conn, reason_for_flushes));
            }
            Event::RecvCompletion { conn, wc, .. } => match st.waiters.remove(&(conn, wc.wr_id)) {
                Some(Waiter::Op(tx, ..)) if wc.status == WcStatus::WrFlushError => {
                    flushed.push((conn, Flushed::Op(tx), wc));
                }
                Some(Waiter::Op(tx, ..)) => {
                    let _ = tx.send(OpDone {
                        wc,
                        ended: None,
                        refused: None,
                    });
                }
                Some(Waiter::Cancelled { dereg, recv, .. }) => {
                    crate::connection::on_cancelled_completion(st, conn, wc, dereg, recv);
                }
                _ => {}
            },
            Event::Completion { conn, wc } => {
                freed = true;
                match st.waiters.remove(&(conn, wc.wr_id)) {
                    Some(Waiter::Op(tx, send_stream, refused)) => {
                        if wc.status == WcStatus::WrFlushError {
                            flushed.push((conn, Flushed::Op(tx), wc));
                        } else {
                            let _ = tx.send(OpDone {
                                wc,
                                ended: None,
                                refused: send_stream.filter(|_| refused),
                            });
                        }
                        send_progress(st, conn, send_stream);
                    }
                    Some(Waiter::Cancelled {
                        dereg,
                        recv,
                        send_stream,
                    }) => {
                        crate::connection::on_cancelled_completion(st, conn, wc, dereg, recv);
                        send_progress(st, conn, send_stream);
                    }
                    Some(Waiter::Batch { batch, index }) if wc.status == WcStatus::WrFlushError => {
                        flushed.push((conn, Flushed::Batch(batch, index), wc));
                    }
                    Some(Waiter::Batch { batch, index }) => batch.on_completion(index, wc, None),
                    Some(Waiter::Stream(id)) => {
                        if let Some(s) = st.stream_mut(conn, id) {
                            let err =
                                (wc.status != WcStatus::Success).then_some(Error::Completion(wc));
                            s.on_completion(err);
                        }
                    }
                    None => {}
                }
            }
            Event::Message { conn, stream, data } => {
                let discard = stream_entry(st, conn, stream).and_then(|e| e.deliver(data));
                if let Some(n) = discard {
                    st.core.stream_consumed(conn, stream, n);
                }
            }
            // The end of a stream this side has no entry for had no message before it (an
            // end is reported after the stream's messages). The core forgets such a stream
            // at once, so its entry here is all that is left of it: a finished empty
            // stream is offered to `accept_stream` only while fewer than `max_streams`
            // peer streams wait there, and a reset one is not offered (the peer dropped
            // an unused handle). Otherwise a peer ending empty streams without pause
            // would fill the driver (found by review, once closed streams stopped
            // counting against `max_streams`).
            Event::StreamFinished { conn, stream } => {
                tracing::trace!(%conn, stream, "stream finished by the peer");
                let room = st.conns.get(&conn).is_some_and(|c| {
                    c.accept_queue.len() < shared.cfg.transport.max_streams as usize
                });
                let e = if room {
                    stream_entry(st, conn, stream)
                } else {
                    st.stream_mut(conn, stream)
                };
                if let Some(e) = e {
                    lock_rx(&e.rx).end(RxEnd::Finished);
                }
            }
            Event::StreamReset { conn, stream, code } => {
                tracing::debug!(%conn, stream, code, "stream reset by the peer");
                if let Some(e) = st.stream_mut(conn, stream) {
                    lock_rx(&e.rx).end(RxEnd::Error(Error::StreamReset { stream, code }));
                }
            }
            // Before the refused SEND's completion: it, the stream's later SENDs (flushed)
            // and its later sink calls fail with `Error::StreamRefused`.
            Event::StreamRefused {
                conn,
                stream,
                wr_id,
            } => {
                tracing::debug!(%conn, stream, "stream refused by the peer (its table is full)");
                if let Some(Waiter::Op(_, _, refused)) = st.waiters.get_mut(&(conn, wr_id)) {
                    *refused = true;
                }
                if let Some(e) = st.stream_mut(conn, stream) {
                    if e.stopped.is_none() {
                        e.stopped = Some(Error::StreamRefused { stream });
                    }
                    if let Some(w) = e.waker.take() {
                        w.wake();
                    }
                }
            }
            Event::StreamStopped { conn, stream, code } => {
                tracing::debug!(%conn, stream, code, "stream stopped by the peer");
                if let Some(e) = st.stream_mut(conn, stream) {
                    // Not an error of the messages already delivered (they complete
                    // Success): the flushed ones and later sink calls fail with it.
                    e.stopped = Some(Error::StreamStopped { stream, code });
                    if let Some(w) = e.waker.take() {
                        w.wake();
                    }
                }
            }
            Event::StreamClosed { conn, stream } => {
                tracing::trace!(%conn, stream, "stream closed");
                if let Some(c) = st.conns.get_mut(&conn) {
                    match c.streams.get_mut(&stream) {
                        // Its handle is gone: nothing will ask for it again.
                        Some(e) if !e.has_reader => {
                            c.streams.remove(&stream);
                        }
                        // Removed when the handle is dropped (or, not accepted yet, once
                        // `accept_stream` took it and it was dropped). A reader whose
                        // stream was forgotten without the peer's end (stopped before any
                        // message, `Endpoint::stop_stream`) ends here.
                        Some(e) => {
                            e.closed = true;
                            lock_rx(&e.rx).end(RxEnd::Error(Error::StreamClosed(stream)));
                        }
                        None => {}
                    }
                }
            }
            Event::WriteWithImm {
                conn,
                imm,
                byte_len,
            } => {
                if let Some(c) = st.conns.get_mut(&conn) {
                    c.imm_queue.push_back((imm, byte_len));
                    c.signals.queued.notify_waiters();
                }
            }
            Event::Rc(ev) => st.rc.on_event(ev),
            _ => {}
        }
    }
    for (conn, w, wc) in flushed {
        let reason = ended
            .iter()
            .find(|(c, _)| *c == conn)
            .map(|(_, r)| r.clone());
        match w {
            Flushed::Op(tx) => {
                let _ = tx.send(OpDone {
                    wc,
                    ended: reason,
                    refused: None,
                });
            }
            Flushed::Batch(batch, index) => batch.on_completion(index, wc, reason),
        }
    }
    // (Also after a refused post: the queue may have shrunk with no completion.)
    if freed | std::mem::take(&mut st.sq_full) {
        shared.sq_space.notify_waiters();
        for (conn, id) in std::mem::take(&mut st.sq_blocked) {
            if let Some(w) = st.stream_mut(conn, id).and_then(|e| e.waker.take()) {
                w.wake();
            }
        }
    }
    release_send_bound(st, shared);
}

/// A `Connection::send` on `stream` completed: wake the stream's sink, which may wait
/// behind the send's bytes (a sink waiting behind a `send`'s bytes waited forever, found
/// by review; `release_send_bound` wakes it too when bytes are freed earlier).
fn send_progress(st: &mut State, conn: ConnectionHandle, stream: Option<u32>) {
    let Some(id) = stream else {
        return;
    };
    if let Some(e) = st.stream_mut(conn, id) {
        if let Some(w) = e.waker.take() {
            w.wake();
        }
    }
}

/// A sink or a `Connection::send` of `conn` waits for a byte bound (its stream's or the
/// connection's): the driver looks at it after every batch of events until it is released.
pub(crate) fn wait_send_bound(st: &mut State, conn: ConnectionHandle) {
    let freed = st.core.send_bytes_finished(conn);
    if let Some(c) = st.conns.get_mut(&conn) {
        if !c.in_send_bound {
            c.in_send_bound = true;
            c.send_freed_seen = freed;
            st.send_bound.push(conn);
        }
    }
}

/// After a batch of events: for each connection with sinks or `Connection::send`s waiting
/// for a byte bound whose SENDs freed bytes since it last looked, wake the sinks and sends
/// whose stream is now below `stream_send_buffer`, if the connection is below
/// `connection_send_buffer`. The core frees a SEND's bytes when it finishes, which may be
/// long before its completion is reported (completions come in posting order per stream,
/// after the one-sided operations posted before them), or without
/// one (a reset, a STOP), so the check runs after every batch, not on completions (found
/// by review: sinks and sends waited forever while newcomers went ahead). O(connections
/// waiting) when nothing was freed.
fn release_send_bound(st: &mut State, shared: &Shared) {
    if st.send_bound.is_empty() {
        return;
    }
    let cfg = &shared.cfg;
    let (stream_max, conn_max) = (
        cfg.stream_send_buffer as u64,
        cfg.connection_send_buffer as u64,
    );
    let mut notify = false;
    let mut waiting = std::mem::take(&mut st.send_bound);
    let State { core, conns, .. } = st;
    waiting.retain(|&conn| {
        let Some(c) = conns.get_mut(&conn) else {
            return false;
        };
        let freed = core.send_bytes_finished(conn);
        if freed == c.send_freed_seen || core.send_pending(conn) >= conn_max {
            return true;
        }
        c.send_freed_seen = freed;
        let below = |id: u32| core.stream_send_pending(conn, id) < stream_max;
        let streams = &mut c.streams;
        c.send_blocked.retain(|&id| {
            if !below(id) {
                return true;
            }
            if let Some(w) = streams.get_mut(&id).and_then(|e| e.waker.take()) {
                w.wake();
            }
            false
        });
        let before = c.send_waits.len();
        c.send_waits.retain(|&id| !below(id));
        notify |= c.send_waits.len() < before;
        let keep = !c.send_blocked.is_empty() || !c.send_waits.is_empty();
        c.in_send_bound = keep;
        keep
    });
    st.send_bound = waiting;
    if notify {
        shared.sq_space.notify_waiters();
    }
}

/// The waiter of an operation flushed in a batch of events (see `dispatch`).
enum Flushed {
    Op(tokio::sync::oneshot::Sender<OpDone>),
    Batch(Arc<crate::connection::BatchSlot>, usize),
}

/// The routing entry of `stream`, created (and announced to `accept_stream`) if the peer
/// opened it; `None` if the connection is gone.
fn stream_entry(
    st: &mut State,
    conn: metaroce::ConnectionHandle,
    stream: u32,
) -> Option<&mut StreamEntry> {
    let c = st.conns.get_mut(&conn)?;
    Some(c.streams.entry(stream).or_insert_with(|| {
        c.accept_queue.push_back(stream);
        c.signals.queued.notify_waiters();
        StreamEntry::new(true).0
    }))
}

/// Most transmits an application task sends itself per call of [`transmit_inline`]; more
/// are left to the driver (which is then woken).
const INLINE_TX: usize = 4;

/// Send what the core has to send now from the calling (application) task, instead of
/// waking the driver for it (`Config::inline_transmit`, issue #13 P2: one task hop fewer
/// per message). Takes the locked state `st` of `shared` and releases it.
///
/// Only while no one else is sending (`State::tx_busy`; the backend's send side has one
/// user at a time) and nothing is left over from an earlier call. Each transmit is handed
/// to the backend with a no-op waker: a `Pending` one and those after it go to
/// `State::unsent` for the driver, which is woken and sends them first (the backend's
/// "the next call is for the same transmit" rule holds: the driver's next send is that
/// transmit). The driver is also woken when the core's next timer is earlier than the
/// one it sleeps until, when more than [`INLINE_TX`] transmits were due, or when events
/// or deferred work wait. Never blocks: one non-blocking send per transmit.
pub(crate) fn transmit_inline(shared: &Shared, mut st: MutexGuard<'_, State>) {
    if !shared.cfg.inline_transmit
        || !shared.backend.send_from_any_task()
        || st.tx_busy
        || !st.unsent.is_empty()
        || st.closed
    {
        drop(st);
        shared.wake_driver.notify_one();
        return;
    }
    let now = Instant::now();
    // (Kept in the state between calls, with the buffers: no allocation per message once
    // warm.)
    let mut out = std::mem::take(&mut st.tx_out);
    while out.len() < INLINE_TX {
        let mut buf = st.tx_pool.pop().unwrap_or_default();
        match st.core.poll_transmit(now, &mut buf) {
            Some(t) => out.push((t, buf)),
            None => {
                st.tx_pool.push(buf);
                break;
            }
        }
    }
    let more = out.len() == INLINE_TX;
    // Events (completions) the transmits produced go to their handles now.
    Driven::dispatch(shared, &mut st);
    let timer_moved = match (st.core.poll_timeout(), st.driver_deadline) {
        (Some(t), Some(Some(d))) => t < d,
        (Some(_), _) => true,
        (None, _) => false,
    };
    let mut wake = more || timer_moved || !st.dereg_later.is_empty();
    if out.is_empty() {
        st.tx_out = out;
        drop(st);
        if wake {
            shared.wake_driver.notify_one();
        }
        return;
    }
    st.tx_busy = true;
    drop(st);
    let dgb = &*shared.backend;
    let waker = futures::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    // Sent: `out[..sent]`; the rest (from a `Pending` one on) is the driver's.
    let mut sent = 0;
    for (t, buf) in &mut out {
        // Owned: a backend that can keep the buffer (io_uring) swaps it for a spare one
        // instead of copying; the others send `buf[..t.size]` as `poll_send` does.
        match dgb.poll_send_owned(&mut cx, t, buf) {
            std::task::Poll::Ready(r) => {
                if let Err(e) = r {
                    // A failed send is a lost packet: the transport recovers.
                    tracing::debug!(error = %e, dest = %t.destination, "send failed");
                }
                sent += 1;
            }
            std::task::Poll::Pending => break,
        }
    }
    dgb.flush();
    let mut st = shared.lock();
    st.tx_busy = false;
    if sent < out.len() {
        st.unsent.extend(out.drain(sent..));
        wake = true;
    }
    for (_, mut b) in out.drain(..) {
        if st.tx_pool.len() < INLINE_TX {
            b.clear();
            st.tx_pool.push(b);
        }
    }
    st.tx_out = out;
    drop(st);
    if wake {
        shared.wake_driver.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    use std::task::{Context, Poll};

    /// A backend that lends its queued datagrams, one per buffer, up to `max` per call.
    #[derive(Debug, Default)]
    struct Lender(Mutex<VecDeque<Vec<u8>>>);

    impl DatagramBackend for Lender {
        fn local_addr(&self) -> std::net::SocketAddr {
            RecvMeta::EMPTY.from
        }
        fn source_ports(&self) -> Vec<u16> {
            Vec::new()
        }
        fn max_gso_segments(&self) -> usize {
            1
        }
        fn max_gro_segments(&self) -> usize {
            1
        }
        fn poll_recv(
            &self,
            _cx: &mut Context<'_>,
            _bufs: &mut [IoSliceMut<'_>],
            _meta: &mut [RecvMeta],
        ) -> Poll<std::io::Result<usize>> {
            unreachable!("a lending backend is read in place")
        }
        fn poll_send(
            &self,
            _cx: &mut Context<'_>,
            _transmit: &Transmit,
            _contents: &[u8],
        ) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_recv_in_place(
            &self,
            _cx: &mut Context<'_>,
            max: usize,
            f: &mut dyn FnMut(&RecvMeta, &[u8]),
        ) -> Option<Poll<std::io::Result<usize>>> {
            let mut q = self.0.lock().unwrap();
            let mut n = 0;
            while n < max {
                let Some(d) = q.pop_front() else { break };
                let meta = RecvMeta {
                    len: d.len(),
                    stride: d.len(),
                    ..RecvMeta::EMPTY
                };
                f(&meta, &d);
                n += 1;
            }
            Some(if n == 0 {
                Poll::Pending
            } else {
                Poll::Ready(Ok(n))
            })
        }
    }

    /// A core that records each datagram with the time it was handled at, and counts how
    /// often it is locked.
    #[derive(Default)]
    struct Recorder {
        state: Mutex<Vec<(Instant, Vec<u8>)>>,
        locks: AtomicUsize,
        backend: Lender,
        woken: Notify,
    }

    impl Driven for Recorder {
        type State = Vec<(Instant, Vec<u8>)>;
        fn lock(&self) -> MutexGuard<'_, Self::State> {
            self.locks.fetch_add(1, Ordering::Relaxed);
            self.state.lock().unwrap()
        }
        fn datagrams(&self) -> Option<&dyn DatagramBackend> {
            Some(&self.backend)
        }
        fn ip(&self) -> Option<&dyn IpBackend> {
            None
        }
        fn woken(&self) -> &Notify {
            &self.woken
        }
        fn poll_timeout(_st: &Self::State) -> Option<Instant> {
            None
        }
        fn handle_timeout(_st: &mut Self::State, _now: Instant) {}
        fn handle_datagram(st: &mut Self::State, now: Instant, _meta: &RecvMeta, d: &[u8]) {
            st.push((now, d.to_vec()));
        }
        fn poll_transmit(
            _st: &mut Self::State,
            _now: Instant,
            _buf: &mut Vec<u8>,
        ) -> Option<Transmit> {
            None
        }
        fn handle_ip_packet(_st: &mut Self::State, _now: Instant, _pkt: &[u8]) {}
        fn poll_ip_transmit(
            _st: &mut Self::State,
            _now: Instant,
            _payload: &mut Vec<u8>,
        ) -> Option<RcTransmit> {
            None
        }
        fn dispatch(&self, _st: &mut Self::State) {}
        fn may_stop(&self, _st: &Self::State) -> bool {
            true
        }
    }

    #[test]
    fn lent_buffers_are_handled_in_order_under_one_lock_per_batch() {
        let r = Recorder::default();
        r.backend
            .0
            .lock()
            .unwrap()
            .extend((0..20u8).map(|i| vec![i; 3]));
        let mut bufs: [Vec<u8>; RECV_BUFS] = std::array::from_fn(|_| vec![0u8; 64]);
        let mut metas = [RecvMeta::EMPTY; RECV_BUFS];
        drain_ready(&r, &mut bufs, &mut metas);
        let got = r.state.lock().unwrap();
        let want: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; 3]).collect();
        assert_eq!(
            got.iter().map(|(_, d)| d.clone()).collect::<Vec<_>>(),
            want,
            "every datagram, once, in order"
        );
        // Batches of 8, 8 and 4 buffers: one lock (and one clock read) each, not one per
        // buffer.
        assert_eq!(r.locks.load(Ordering::Relaxed), 3);
        for batch in got.chunks(8) {
            assert!(batch.iter().all(|(t, _)| *t == batch[0].0));
        }
    }
}
