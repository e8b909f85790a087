//! The driver task: feeds datagrams and timers into the core, flushes its transmits and
//! routes its events to the waiting handles.

use crate::backend::RecvMeta;
use crate::connection::ConnEntry;
use crate::endpoint::{Shared, State, Waiter};
use crate::error::Error;
use crate::stream::{lock_rx, RxEnd, StreamEntry};
use metaroce::{Event, Transmit, WcStatus};
use std::future::poll_fn;
use std::io::IoSliceMut;
use std::sync::Arc;
use std::time::Instant;

/// Receive buffers per poll, each large enough for a full GRO batch of 64 KiB.
const RECV_BUFS: usize = 8;
const RECV_BUF_LEN: usize = 1 << 16;
/// Transmits gathered under one lock before they are sent.
const TX_BATCH: usize = 32;

pub(crate) async fn run(shared: Arc<Shared>) {
    let mut bufs: Vec<Vec<u8>> = (0..RECV_BUFS).map(|_| vec![0u8; RECV_BUF_LEN]).collect();
    let mut metas = [RecvMeta::EMPTY; RECV_BUFS];
    let mut pool: Vec<Vec<u8>> = Vec::new();
    let mut out: Vec<(Transmit, Vec<u8>)> = Vec::with_capacity(TX_BATCH);
    // Native RoCEv2 QPs (only with an IP backend): whole IP packets in and out.
    let mut ip_out: Vec<(std::net::IpAddr, Vec<u8>)> = Vec::new();
    let mut ip_payload = Vec::new();
    let mut ip_rbuf = if shared.ip_backend.is_some() {
        vec![0u8; RECV_BUF_LEN]
    } else {
        Vec::new()
    };
    loop {
        // Flush everything the core wants to send, in batches gathered under the lock.
        loop {
            let deadline;
            let mut dereg;
            {
                let due = shared
                    .lock()
                    .core
                    .poll_timeout()
                    .is_some_and(|t| t <= Instant::now());
                if due {
                    // A loss timer that came due while the task was not running (scheduling
                    // delay, a long send batch) must see the ACKs that arrived meanwhile, or
                    // it fires tail-loss probes and timeouts for packets already delivered:
                    // take in what the socket holds first.
                    drain_ready(&shared, &mut bufs, &mut metas);
                }
                let mut st = shared.lock();
                let now = Instant::now();
                if st.core.poll_timeout().is_some_and(|t| t <= now) {
                    st.core.handle_timeout(now);
                }
                while out.len() < TX_BATCH {
                    let mut buf = pool
                        .pop()
                        .unwrap_or_else(|| Vec::with_capacity(RECV_BUF_LEN));
                    match st.core.poll_transmit(now, &mut buf) {
                        Some(t) => out.push((t, buf)),
                        None => {
                            pool.push(buf);
                            break;
                        }
                    }
                }
                if shared.ip_backend.is_some() {
                    while ip_out.len() < TX_BATCH {
                        let Some(t) = st.core.poll_rc_transmit(now, &mut ip_payload) else {
                            break;
                        };
                        let mut pkt = Vec::with_capacity(t.size + 48);
                        if t.write_ip_packet(&ip_payload[..t.size], &mut pkt).is_ok() {
                            ip_out.push((t.destination.ip(), pkt));
                        }
                    }
                }
                dispatch(&mut st, &shared);
                // Wake `wait_idle` when the last connection and pending CLOSE are gone.
                let t = st.core.table_sizes();
                let now_idle = st.conns.is_empty() && t.connections == 0 && t.closers == 0;
                if now_idle {
                    shared.idle.notify_waiters();
                }
                if st.drained() && out.is_empty() && ip_out.is_empty() {
                    drop(st);
                    shared
                        .stopped
                        .store(true, std::sync::atomic::Ordering::Release);
                    shared.idle.notify_waiters();
                    tracing::debug!("driver stopped");
                    return;
                }
                deadline = st.core.poll_timeout();
                dereg = std::mem::take(&mut st.dereg_later);
            }
            // Regions the core finished with (cancelled atomics' results): off every shard,
            // each under its own lock.
            for lkey in dereg.drain(..) {
                shared.deregister_everywhere(lkey);
            }
            let full = out.len() == TX_BATCH || ip_out.len() == TX_BATCH;
            if let Some(ipb) = &shared.ip_backend {
                for (dst, pkt) in ip_out.drain(..) {
                    if let Err(e) = poll_fn(|cx| ipb.poll_send(cx, &pkt, dst)).await {
                        tracing::debug!(error = %e, %dst, "rocev2 send failed");
                    }
                }
            }
            for (t, buf) in out.drain(..) {
                if let Err(e) = poll_fn(|cx| shared.backend.poll_send(cx, &t, &buf[..t.size])).await
                {
                    // A failed send is a lost packet: the transport recovers.
                    tracing::debug!(error = %e, dest = %t.destination, "send failed");
                }
                pool.push(buf);
            }
            // Backends that batch submissions (io_uring) hand the batch to the kernel here.
            shared.backend.flush();
            if !full {
                // Wait for input, a timer or new work.
                let sleep = async {
                    match deadline {
                        Some(d) => tokio::time::sleep_until(d.into()).await,
                        None => std::future::pending().await,
                    }
                };
                let mut iovs: Vec<IoSliceMut<'_>> =
                    bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                // `Some(true)`: the backend lent its buffers and the datagrams were handled
                // in place; `Some(false)`: they are in `bufs` / `metas`.
                let recv = poll_fn(|cx| {
                    let mut handle = |meta: &RecvMeta, buf: &[u8]| {
                        let mut st = shared.lock();
                        let now = Instant::now();
                        for d in meta.datagrams(buf) {
                            st.core
                                .handle_datagram(now, meta.from, meta.local_ip, meta.ecn, d);
                        }
                    };
                    if let Some(p) = shared
                        .backend
                        .poll_recv_in_place(cx, RECV_BUFS, &mut handle)
                    {
                        return p.map(|r| r.map(|n| (n, true)));
                    }
                    shared
                        .backend
                        .poll_recv(cx, &mut iovs, &mut metas)
                        .map(|r| r.map(|n| (n, false)))
                });
                let ip_recv = poll_fn(|cx| match &shared.ip_backend {
                    Some(b) => b.poll_recv(cx, &mut ip_rbuf),
                    None => std::task::Poll::Pending,
                });
                tokio::select! {
                    r = ip_recv, if shared.ip_backend.is_some() => match r {
                        Ok(n) => {
                            let mut st = shared.lock();
                            st.core.handle_ip_packet(Instant::now(), &ip_rbuf[..n]);
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "rocev2 receive failed");
                            if e.kind() == std::io::ErrorKind::BrokenPipe {
                                // Memory link closed: do not spin on it.
                                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                            }
                        }
                    },
                    r = recv => {
                        match r {
                            Ok((n, lent)) => {
                                drop(iovs);
                                let mut st = shared.lock();
                                let now = Instant::now();
                                let copied = if lent { 0 } else { n };
                                for (meta, buf) in metas[..copied].iter().zip(&bufs) {
                                    for d in meta.datagrams(buf) {
                                        st.core.handle_datagram(now, meta.from, meta.local_ip, meta.ecn, d);
                                    }
                                }
                                // Drain whatever else is already queued without waiting,
                                // when the batch was full: a partial batch means the socket
                                // was empty, and another receive would only return EAGAIN
                                // (one wasted system call per datagram in a ping-pong).
                                drop(st);
                                if n == RECV_BUFS {
                                    drain_ready(&shared, &mut bufs, &mut metas);
                                }
                            }
                            Err(e) => tracing::debug!(error = %e, "receive failed"),
                        }
                    }
                    _ = sleep => {}
                    _ = shared.wake_driver.notified() => {}
                }
                break;
            }
            tokio::task::yield_now().await;
        }
    }
}

/// Receive datagrams that are ready now (non-blocking), up to a bound, so that a burst is
/// processed before the next flush.
fn drain_ready(shared: &Shared, bufs: &mut [Vec<u8>], metas: &mut [RecvMeta]) {
    let waker = futures::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    for _ in 0..4 {
        let mut handle = |meta: &RecvMeta, buf: &[u8]| {
            let mut st = shared.lock();
            let now = Instant::now();
            for d in meta.datagrams(buf) {
                st.core
                    .handle_datagram(now, meta.from, meta.local_ip, meta.ecn, d);
            }
        };
        if let Some(p) = shared
            .backend
            .poll_recv_in_place(&mut cx, bufs.len(), &mut handle)
        {
            match p {
                std::task::Poll::Ready(Ok(n)) if n > 0 => continue,
                _ => break,
            }
        }
        let mut iovs: Vec<IoSliceMut<'_>> = bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
        match shared.backend.poll_recv(&mut cx, &mut iovs, metas) {
            std::task::Poll::Ready(Ok(n)) if n > 0 => {
                drop(iovs);
                let mut st = shared.lock();
                let now = Instant::now();
                for (meta, buf) in metas[..n].iter().zip(bufs.iter()) {
                    for d in meta.datagrams(buf) {
                        st.core
                            .handle_datagram(now, meta.from, meta.local_ip, meta.ecn, d);
                    }
                }
            }
            _ => break,
        }
    }
}

/// Route the core's events to the handles waiting for them.
fn dispatch(st: &mut State, shared: &Shared) {
    let mut freed = false;
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
            }
            Event::RecvCompletion { conn, wc, .. } => match st.waiters.remove(&(conn, wc.wr_id)) {
                Some(Waiter::Op(tx)) => {
                    let _ = tx.send(wc);
                }
                Some(Waiter::Cancelled { dereg, recv }) => {
                    crate::connection::on_cancelled_completion(st, conn, wc, dereg, recv);
                }
                _ => {}
            },
            Event::Completion { conn, wc } => {
                freed = true;
                match st.waiters.remove(&(conn, wc.wr_id)) {
                    Some(Waiter::Op(tx)) => {
                        let _ = tx.send(wc);
                    }
                    Some(Waiter::Cancelled { dereg, recv }) => {
                        crate::connection::on_cancelled_completion(st, conn, wc, dereg, recv);
                    }
                    Some(Waiter::Stream(id)) => {
                        let pending = st.core.stream_send_pending(conn, id);
                        if let Some(s) =
                            st.conns.get_mut(&conn).and_then(|c| c.streams.get_mut(&id))
                        {
                            let err =
                                (wc.status != WcStatus::Success).then_some(Error::Completion(wc));
                            s.on_completion(err, pending);
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
            Event::StreamFinished { conn, stream } => {
                tracing::trace!(%conn, stream, "stream finished by the peer");
                if let Some(e) = stream_entry(st, conn, stream) {
                    lock_rx(&e.rx).end(RxEnd::Finished);
                }
            }
            Event::StreamReset { conn, stream, code } => {
                tracing::debug!(%conn, stream, code, "stream reset by the peer");
                if let Some(e) = stream_entry(st, conn, stream) {
                    lock_rx(&e.rx).end(RxEnd::Error(Error::StreamReset { stream, code }));
                }
            }
            Event::StreamStopped { conn, stream, code } => {
                tracing::debug!(%conn, stream, code, "stream stopped by the peer");
                if let Some(e) = st
                    .conns
                    .get_mut(&conn)
                    .and_then(|c| c.streams.get_mut(&stream))
                {
                    // Not an error of the messages already delivered (they complete
                    // Success): the flushed ones and later sink calls fail with it.
                    e.stopped = Some(Error::StreamStopped { stream, code });
                    if let Some(w) = e.waker.take() {
                        w.wake();
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
    if freed {
        shared.sq_space.notify_waiters();
    }
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
