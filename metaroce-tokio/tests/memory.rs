//! Memory regions over UDP on 127.0.0.1: user buffers registered without a copy and given
//! back, externally owned memory, checked RemoteRegion arithmetic, and local copies that
//! do not stall packet processing.

mod common;

use common::pair;
use metaroce::{Access, MrError};
use metaroce_tokio::{Config, Error, ExternalMemory, RemoteRegion};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn remote_region_slice_cannot_overflow() {
    let r = RemoteRegion {
        addr: u64::MAX - 10,
        len: 100,
        rkey: 7,
    };
    // Inside both the region and the address space.
    assert_eq!(
        r.slice(5, 4),
        Some(RemoteRegion {
            addr: u64::MAX - 5,
            len: 4,
            rkey: 7
        })
    );
    // Inside the (hostile) length but past u64::MAX: refused, in debug and release.
    assert_eq!(r.slice(20, 1), None);
    assert_eq!(r.slice(5, 6), None);
    assert_eq!(r.slice(u64::MAX, 1), None);
    assert_eq!(r.slice(1, u64::MAX), None);
    assert_eq!(r.slice(0, 101), None);
    let full = RemoteRegion {
        addr: 0,
        len: u64::MAX,
        rkey: 1,
    };
    assert_eq!(full.slice(u64::MAX, 0).map(|s| s.addr), Some(u64::MAX));
    assert_eq!(
        full.slice(u64::MAX - 1, 1).map(|s| s.addr),
        Some(u64::MAX - 1)
    );
}

#[tokio::test]
async fn operations_refuse_addresses_past_u64_max() {
    let (_se, ce, c, _s) = pair(Config::default()).await;
    let src = ce.alloc(64, Access::LOCAL_WRITE);
    let hostile = RemoteRegion::from_bytes(
        &RemoteRegion {
            addr: u64::MAX - 8,
            len: u64::MAX,
            rkey: 1,
        }
        .to_bytes(),
    )
    .unwrap();
    let e = c.write(&src, 0..64, hostile, 16).await.unwrap_err();
    assert!(matches!(e, Error::Memory(MrError::OutOfBounds)), "{e:?}");
    let e = c.read(&src, 0..64, hostile, 16).await.unwrap_err();
    assert!(matches!(e, Error::Memory(MrError::OutOfBounds)), "{e:?}");
    let e = c.fetch_add(hostile, 16, 1).await.unwrap_err();
    assert!(matches!(e, Error::Memory(MrError::OutOfBounds)), "{e:?}");
    let e = c.compare_swap(hostile, 16, 0, 1).await.unwrap_err();
    assert!(matches!(e, Error::Memory(MrError::OutOfBounds)), "{e:?}");
}

#[tokio::test]
async fn owned_buffers_are_registered_without_a_copy_and_given_back() {
    let (_se, ce, c, s) = pair(Config::default()).await;
    let ep = s.endpoint();
    // Vec<u8>: the same heap allocation comes back.
    let v = vec![0u8; 1 << 20];
    let ptr = v.as_ptr();
    let dst = ep.register_buffer(v, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let src = ce.register_buffer(vec![5u8; 1 << 20].into_boxed_slice(), Access::LOCAL_WRITE);
    c.write(&src, 0..1 << 20, dst.remote(), 0).await.unwrap();
    // The wrong type leaves the region registered.
    let dst = dst.into_inner::<bytes::BytesMut>().unwrap_err();
    let v: Vec<u8> = dst.into_inner().unwrap();
    assert_eq!(v.as_ptr(), ptr, "the Vec was copied");
    assert!(v.iter().all(|&b| b == 5));
    // BytesMut and Box<[u8]> too.
    let b = bytes::BytesMut::zeroed(4096);
    let bptr = b.as_ptr();
    let mr = ep.register_buffer(b, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    c.write(&src, 0..4096, mr.remote(), 0).await.unwrap();
    let b: bytes::BytesMut = mr.into_inner().unwrap();
    assert_eq!(b.as_ptr(), bptr);
    assert!(b.iter().all(|&x| x == 5));
    let boxed: Box<[u8]> = src.into_inner().unwrap();
    assert_eq!(boxed.len(), 1 << 20);
    // After deregistration the peer's WRITE is refused.
    let gone = ep.register_buffer(vec![0u8; 64], Access::REMOTE_WRITE);
    let remote = gone.remote();
    let _ = gone.into_inner::<Vec<u8>>().unwrap();
    let src = ce.alloc(64, Access::LOCAL_WRITE);
    let e = c.write(&src, 0..64, remote, 0).await.unwrap_err();
    assert!(
        matches!(e, Error::Completion(wc) if wc.status == metaroce::WcStatus::RemoteAccessError),
        "{e:?}"
    );
}

#[tokio::test]
async fn external_memory_receives_remote_writes() {
    let (_se, ce, c, s) = pair(Config::default()).await;
    // Stands in for an mmap'd huge page: the owner keeps the allocation alive, and nothing
    // but the ExternalMemory touches it while registered.
    let mut backing = vec![0u8; 8192];
    let ptr = backing.as_mut_ptr();
    // SAFETY: `backing` is moved into the owner and not used until the ExternalMemory is
    // dropped; moving a Vec does not move (nor retag) its heap bytes, so `ptr` stays valid
    // for the 8192 initialized bytes.
    let ext = unsafe { ExternalMemory::new(ptr, 8192, Box::new(backing)) };
    let mr = s
        .endpoint()
        .register_buffer(ext, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let src = ce.register(vec![0x42; 8192], Access::LOCAL_WRITE);
    c.write(&src, 0..8192, mr.remote(), 0).await.unwrap();
    assert!(mr.read(0, 8192).unwrap().iter().all(|&b| b == 0x42));
    let ext: ExternalMemory = mr.into_inner().unwrap();
    let owner = ext.into_owner().downcast::<Vec<u8>>().unwrap();
    assert!(owner.iter().all(|&b| b == 0x42));
}

/// A large local copy (`read` of the 64 MiB region a remote WRITE stream is landing in,
/// and a long `with_bytes` on another region) while the stream proceeds: the receiver's
/// placed-bytes counter moves *during* the copies. Samples are taken from the async side
/// while a blocking thread copies; a sample pair counts only if the copy generation (odd
/// while a copy runs) did not change between them, and one copy must contain several
/// such pairs that saw bytes land. On the old code, where `read` held the endpoint lock
/// for the whole copy, a pair could only fit in the moments the copier waited for the
/// lock: run there, this test saw 16 pairs in 10 copies, at most 3 in one copy, and 32
/// 1 MiB WRITEs completed in all; with per-region locks, 298 pairs, up to 32 in one copy,
/// 268 WRITEs (debug build, 2 shared cores).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_copies_do_not_stall_packet_processing() {
    let (_se, ce, c, s) = pair(Config::default()).await;
    let n = 64usize << 20;
    let target = Arc::new(
        s.endpoint()
            .alloc(n, Access::LOCAL_WRITE | Access::REMOTE_WRITE),
    );
    let other = s.endpoint().alloc(1 << 20, Access::LOCAL_WRITE);
    let src = ce.alloc(1 << 20, Access::LOCAL_WRITE);
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (c, stop, remote) = (c.clone(), stop.clone(), target.remote());
        tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let off = (i % 64) << 20;
                c.write(&src, 0..1 << 20, remote, off).await.unwrap();
                i += 1;
            }
            i
        })
    };
    // Let the stream start.
    while s.stats().unwrap().recv.write_bytes < 4 << 20 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let gen = Arc::new(AtomicU64::new(0));
    let copier = {
        let (target, gen) = (target.clone(), gen.clone());
        std::thread::spawn(move || {
            let mut spent = Duration::ZERO;
            for _ in 0..10 {
                gen.fetch_add(1, Ordering::SeqCst);
                let t = Instant::now();
                let b = target.read(0, n as u64).unwrap();
                spent += t.elapsed();
                gen.fetch_add(1, Ordering::SeqCst);
                assert_eq!(b.len(), n);
            }
            spent
        })
    };
    let (mut samples, mut moving, mut landed) = (0u32, 0u32, 0u64);
    let mut per_copy = std::collections::HashMap::<u64, u32>::new();
    while !copier.is_finished() {
        let g1 = gen.load(Ordering::SeqCst);
        let w1 = s.stats().unwrap().recv.write_bytes;
        tokio::time::sleep(Duration::from_micros(500)).await;
        let w2 = s.stats().unwrap().recv.write_bytes;
        let g2 = gen.load(Ordering::SeqCst);
        if g1 == g2 && g1 % 2 == 1 {
            samples += 1;
            if w2 > w1 {
                moving += 1;
                landed += w2 - w1;
                *per_copy.entry(g1).or_default() += 1;
            }
        }
    }
    let spent = copier.join().unwrap();
    let best = per_copy.values().copied().max().unwrap_or(0);
    // with_bytes on another region: the endpoint lock is not held by the closure, so the
    // stream goes on (and the endpoint can even be queried from inside it).
    let s2 = s.clone();
    let inside = tokio::task::spawn_blocking(move || {
        other
            .with_bytes(|b| {
                let w1 = s2.stats().unwrap().recv.write_bytes;
                std::thread::sleep(Duration::from_millis(50));
                let w2 = s2.stats().unwrap().recv.write_bytes;
                (b.len(), w2 - w1)
            })
            .unwrap()
    });
    let (len, during_with_bytes) = tokio::time::timeout(Duration::from_secs(10), inside)
        .await
        .expect("with_bytes blocked the endpoint")
        .unwrap();
    assert_eq!(len, 1 << 20);
    stop.store(true, Ordering::Relaxed);
    let writes = writer.await.unwrap();
    println!(
        "10 reads of 64 MiB took {spent:?}; {samples} sample pairs inside a copy, {moving} \
         saw WRITE bytes land ({landed} bytes), at most {best} within one copy; \
         {during_with_bytes} bytes landed during a 50 ms with_bytes; {writes} 1 MiB WRITEs \
         in all"
    );
    assert!(samples > 0, "no sample fell inside a copy");
    assert!(
        best >= 8,
        "WRITE bytes landed in at most {best} sample pairs within one 64 MiB copy"
    );
    assert!(
        during_with_bytes > 0,
        "no WRITE byte landed during with_bytes"
    );
}
