//! Core support for sharded hosts (issue #13 item 4): QPN residue classes and one region
//! registered under the same keys on several endpoints.

use metaroce::testing::config;
use metaroce::{Access, Endpoint, MrError};
use std::time::Instant;

#[test]
fn qpns_stay_in_the_residue_class() {
    let now = Instant::now();
    for (m, r) in [(2u32, 0u32), (2, 1), (8, 5), (65_536, 65_535)] {
        let mut c = config(0, 7);
        c.qpn_modulus = m;
        c.qpn_residue = r;
        let mut ep = Endpoint::new(c).unwrap();
        for _ in 0..200 {
            let h = ep
                .connect(now, "10.0.0.2:4791".parse().unwrap(), None)
                .unwrap();
            assert_eq!(h.0 % m, r, "QPN {:#x} outside class {r} mod {m}", h.0);
            assert!(h.0 > 1 && h.0 <= 0xFF_FFFF);
        }
    }
}

#[test]
fn modulus_one_allocates_as_before() {
    // The default (modulus 1) must draw exactly what an unsharded endpoint draws: the
    // simulator's runs stay bit-identical.
    let now = Instant::now();
    let mut a = Endpoint::new(config(0, 9)).unwrap();
    let mut c = config(0, 9);
    c.qpn_modulus = 1;
    c.qpn_residue = 0;
    let mut b = Endpoint::new(c).unwrap();
    for _ in 0..50 {
        let peer = "10.0.0.2:4791".parse().unwrap();
        assert_eq!(
            a.connect(now, peer, None).unwrap(),
            b.connect(now, peer, None).unwrap()
        );
    }
}

#[test]
fn bad_residue_class_is_refused() {
    for (m, r) in [(0u32, 0u32), (2, 2), (65_537, 0)] {
        let mut c = config(0, 1);
        c.qpn_modulus = m;
        c.qpn_residue = r;
        assert!(
            Endpoint::new(c).is_err(),
            "modulus {m} residue {r} accepted"
        );
    }
}

#[test]
fn region_imported_with_the_same_keys() {
    let mut a = Endpoint::new(config(0, 1)).unwrap();
    let mut b = Endpoint::new(config(1, 2)).unwrap();
    let _first = a.register_mr(vec![0; 16], Access::LOCAL_WRITE);
    let keys = a.register_mr(vec![0; 4096], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    b.register_mr_memory_with_keys(Box::new(vec![7u8; 4096]), keys)
        .unwrap();
    assert_eq!(b.mr_keys(keys.lkey), Some(keys));
    assert_eq!(b.mr_read(keys.lkey, 0, 2).unwrap(), vec![7, 7]);
    // The same keys twice, or a length that does not match: refused, nothing changes.
    assert_eq!(
        b.register_mr_memory_with_keys(Box::new(vec![0u8; 4096]), keys),
        Err(MrError::InvalidKey)
    );
    let mut other = keys;
    other.lkey += 0x100;
    other.rkey ^= 1;
    assert_eq!(
        b.register_mr_memory_with_keys(Box::new(vec![0u8; 10]), other),
        Err(MrError::InvalidKey)
    );
    assert_eq!(b.registered_mrs(), 1);
    // Deregistered, the slot can be imported again with the next variant.
    b.deregister_mr(keys.lkey).unwrap();
    a.deregister_mr(keys.lkey).unwrap();
    let again = a.register_mr(vec![0; 64], Access::LOCAL_WRITE);
    b.register_mr_memory_with_keys(Box::new(vec![0u8; 64]), again)
        .unwrap();
    assert_eq!(b.mr_keys(again.lkey), Some(again));
    assert_eq!(b.mr_keys(keys.lkey), None, "stale key answers");
}
