//! io_uring forbidden by a seccomp filter, as sandboxes do. A filter that refuses all three
//! io_uring system calls (Docker's default profile) makes `bind_backend` fall back to UDP; a
//! filter that refuses only `io_uring_enter` (which binding never needed) must not leave a
//! backend that binds and then silently never receives (found by review: it did). Each
//! filter is installed on a thread of its own, which it alone affects.
#![allow(unsafe_code)]

use std::future::poll_fn;
use std::io::IoSliceMut;
use std::net::SocketAddr;
use std::time::Duration;

use metaroce::Transmit;
use metaroce_tokio::backend::{
    bind_backend, BackendKind, DatagramBackend, RecvMeta, UdpBackend, UringConfig,
};

/// Installs, on the calling thread (and threads it creates later), a seccomp filter that
/// makes the system calls `nrs` fail with EPERM.
fn forbid(nrs: &[u32]) {
    #[repr(C)]
    struct F {
        code: u16,
        jt: u8,
        jf: u8,
        k: u32,
    }
    #[repr(C)]
    struct P {
        len: u16,
        filter: *const F,
    }
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x15;
    const RET_K: u16 = 0x06;
    const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
    const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
    let mut prog = vec![F {
        code: LD_W_ABS,
        jt: 0,
        jf: 0,
        k: 0,
    }]; // seccomp_data.nr
    for (i, &nr) in nrs.iter().enumerate() {
        // Match: jump to the EPERM return after the remaining checks and the ALLOW.
        let to_deny = (nrs.len() - i) as u8;
        prog.push(F {
            code: JEQ_K,
            jt: to_deny,
            jf: 0,
            k: nr,
        });
    }
    prog.push(F {
        code: RET_K,
        jt: 0,
        jf: 0,
        k: SECCOMP_RET_ALLOW,
    });
    prog.push(F {
        code: RET_K,
        jt: 0,
        jf: 0,
        k: SECCOMP_RET_ERRNO | libc::EPERM as u32,
    });
    let p = P {
        len: prog.len() as u16,
        filter: prog.as_ptr(),
    };
    // SAFETY: plain prctl calls with a valid, live sock_fprog.
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &p as *const P
            ),
            0,
            "seccomp: {}",
            std::io::Error::last_os_error()
        );
    }
}

const SETUP: u32 = libc::SYS_io_uring_setup as u32;
const ENTER: u32 = libc::SYS_io_uring_enter as u32;
const REGISTER: u32 = libc::SYS_io_uring_register as u32;

/// Runs `f` on a fresh thread under a filter forbidding `nrs`, in a current-thread runtime.
fn under_filter<F, Fut>(nrs: &'static [u32], f: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    std::thread::spawn(move || {
        forbid(nrs);
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f());
    })
    .join()
    .unwrap();
}

/// Sends one datagram from a UDP backend to `b` and waits up to 2 s for it.
async fn one_datagram_arrives(b: &dyn DatagramBackend) -> Result<Vec<u8>, String> {
    let a = UdpBackend::bind("127.0.0.1:0".parse().unwrap(), 1).unwrap();
    let t = Transmit {
        destination: b.local_addr(),
        src_port: a.source_ports()[0],
        ecn: None,
        size: 5,
        segment_size: None,
    };
    poll_fn(|cx| a.poll_send(cx, &t, b"hello")).await.unwrap();
    let mut buf = vec![0u8; 65_536];
    let mut meta = [RecvMeta::default(); 1];
    let r = tokio::time::timeout(
        Duration::from_secs(2),
        poll_fn(|cx| {
            let mut s = [IoSliceMut::new(&mut buf)];
            b.poll_recv(cx, &mut s, &mut meta)
        }),
    )
    .await;
    match r {
        Err(_) => Err("nothing received within 2 s, and no error reported".into()),
        Ok(Err(e)) => Err(format!("receive error: {e}")),
        Ok(Ok(n)) => {
            assert_eq!(n, 1);
            Ok(buf[..meta[0].len].to_vec())
        }
    }
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Docker-style: every io_uring call refused. Expected (and observed): a fallback to UDP
/// with the reason, and a working backend.
#[test]
fn all_io_uring_calls_forbidden_falls_back_to_udp() {
    under_filter(&[SETUP, ENTER, REGISTER], || async {
        let bound = bind_backend(BackendKind::Uring, loopback(), 1, &UringConfig::default())
            .expect("bind_backend");
        assert_eq!(bound.kind, BackendKind::Udp);
        assert!(bound.fallback_reason.is_some());
        assert_eq!(
            one_datagram_arrives(&*bound.backend).await.unwrap(),
            b"hello"
        );
    });
}

/// Only `io_uring_enter` refused: binding now submits a NOP, so `bind_backend` falls back to
/// UDP (before, it kept the io_uring backend, whose receive was never submitted: deaf,
/// silently).
#[test]
fn io_uring_enter_forbidden_falls_back_to_udp_with_the_reason() {
    under_filter(&[ENTER], || async {
        let bound = bind_backend(BackendKind::Uring, loopback(), 1, &UringConfig::default())
            .expect("bind_backend");
        assert_eq!(bound.kind, BackendKind::Udp);
        let why = bound.fallback_reason.expect("a fallback says why");
        assert!(why.contains("io_uring_enter"), "{why}");
        assert_eq!(
            one_datagram_arrives(&*bound.backend).await.unwrap(),
            b"hello"
        );
    });
}

/// `io_uring_enter` refused after the endpoint bound (a process that sandboxes itself once
/// its sockets are open): every receive poll fails at once. The driver pauses between
/// failed receives instead of spinning: a 10 ms sleep beside the endpoint on the same
/// current-thread runtime finishes (it never did: found by review).
#[test]
fn a_receive_that_keeps_failing_does_not_starve_the_runtime() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move {
                let b = metaroce_tokio::backend::UringBackend::bind(loopback(), 1)
                    .expect("io_uring backend");
                forbid(&[ENTER]);
                let ep = metaroce_tokio::Endpoint::with_backend(b, Default::default()).unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
                let _ = tx.send(());
                drop(ep);
            });
    });
    assert!(
        rx.recv_timeout(Duration::from_secs(10)).is_ok(),
        "a 10 ms sleep beside the endpoint did not finish: the driver spins"
    );
}
