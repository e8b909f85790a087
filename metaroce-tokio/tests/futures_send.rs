//! The futures of `Connection`'s operations stay `Send` (users `tokio::spawn` them); a
//! compile-time check (3c168bb turned `write`, `write_with_imm` and `read` into
//! `fn -> impl Future` and made `post_op` borrow its closure).

use metaroce_tokio::{Bytes, Connection, MemoryRegion, RemoteRegion};

fn send<T: Send>(t: T) -> T {
    t
}

#[allow(dead_code)]
fn operations_are_send(c: Connection, mr: MemoryRegion, rr: RemoteRegion) {
    drop(tokio::spawn(async move {
        let _ = send(c.write(&mr, 0..1, rr, 0)).await;
        let _ = send(c.write_with_imm(&mr, 0..1, rr, 0, 7)).await;
        let _ = send(c.read(&mr, 0..1, rr, 0)).await;
        let _ = send(c.send(0, Bytes::from_static(b"x"))).await;
        let _ = send(c.recv_into(0, &mr, 0..1)).await;
        let _ = send(c.compare_swap(rr, 0, 1, 2)).await;
        let _ = send(c.fetch_add(rr, 0, 1)).await;
    }));
}

#[test]
fn compiles() {}
