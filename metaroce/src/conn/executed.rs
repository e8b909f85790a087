//! The responder's record of what its most recently executed operation ids did
//! ([`ExecutedOps`]), kept as a ring indexed by op id instead of a hash map.
//!
//! A requester issues op ids one after the other per connection, so the ids executed last
//! are (nearly) consecutive: slot `id mod size` of a power-of-two ring holds the latest id of
//! its residue class, and recording one executed operation is a store into the slot after
//! the previous one's, in place of a hash insert plus a hash remove of the evicted record
//! (issue #13: with the default `max_tracked_ops` of 65,536 the map was about 6.6 MB and
//! every operation missed the cache twice in it).

use super::recv::OpParams;

/// The ring never starts smaller than this many slots.
const MIN_SLOTS: usize = 4;

/// One slot: the op id it holds, its insertion number plus one (0: never used) and what the
/// operation did.
#[derive(Debug, Clone, Copy)]
struct Slot {
    id: u32,
    seq: u64,
    params: OpParams,
}

const EMPTY: Slot = Slot {
    id: 0,
    seq: 0,
    params: OpParams::NONE,
};

/// What the last `cap` executed op ids were used for, oldest evicted first.
///
/// Semantics, as the hash map plus FIFO of ids it replaces: a record is made per executed
/// id ([`ExecutedOps::record`]); the records kept are those of the last `cap` ids recorded
/// (recording an id that is still kept only replaces its parameters); [`ExecutedOps::get`]
/// answers for kept ids only. One difference, from the fixed ring: a kept id is also
/// forgotten when an id `k × size` later (`size` = `cap` rounded up to a power of two,
/// `k ≥ 1`) is recorded while it is kept. Both are then at least `size` ≥ `cap` apart, so the
/// older one is below the floor of finished op ids (every id is executed at most `cap` ahead
/// of the floor): forgetting it answers a later packet reusing it with other parameters as a
/// duplicate (acknowledged, nothing done) instead of NAK 0x61, as the map did once it had
/// evicted the record. An honest requester never reuses an op id with other parameters.
///
/// Memory: the ring starts empty and doubles (from 4 slots) only when an id would replace a
/// record that must be kept, up to `size` slots of 56 bytes (3.5 MiB at the default `cap` of
/// 65,536, against about 6.6 MiB for the map and its FIFO once full); an idle connection
/// holds no slots, one that executed `n` < `cap` consecutive ids about `n` rounded up to a
/// power of two. No allocation once it is `size` slots long.
#[derive(Debug, Default)]
pub(crate) struct ExecutedOps {
    /// Empty or a power of two long, at most `size_for(cap)`.
    slots: Vec<Slot>,
    /// Records made (distinct ids or ids recorded again after they were evicted).
    recorded: u64,
    /// The `cap` of the last [`ExecutedOps::record`] (for [`ExecutedOps::len`]).
    cap: u32,
}

/// Slots of a full ring for `cap` records: `cap` rounded up to a power of two (at least 1).
fn size_for(cap: u32) -> usize {
    (cap.max(1) as usize).next_power_of_two()
}

impl ExecutedOps {
    /// Whether the slot's record is among the last `cap` made.
    #[inline]
    fn kept(&self, s: &Slot, cap: u32) -> bool {
        s.seq != 0 && self.recorded + 1 - s.seq <= u64::from(cap)
    }

    /// What operation `id` did, if it is among the last `cap` recorded.
    #[inline]
    pub fn get(&self, id: u32, cap: u32) -> Option<&OpParams> {
        if self.slots.is_empty() {
            return None;
        }
        let s = &self.slots[id as usize & (self.slots.len() - 1)];
        (s.id == id && self.kept(s, cap)).then_some(&s.params)
    }

    /// Record that `id` executed with `params`, evicting the oldest record beyond `cap`.
    #[inline]
    pub fn record(&mut self, id: u32, params: OpParams, cap: u32) {
        self.cap = cap;
        let next = self.recorded + 1;
        let mask = self.slots.len().wrapping_sub(1);
        if let Some(s) = self.slots.get_mut(id as usize & mask) {
            // The common case, consecutive ids: the slot holds nothing this record must keep
            // (the id `size` before, evicted now or earlier): overwritten in place.
            if s.seq == 0 || (s.id != id && next + 1 - s.seq > u64::from(cap)) {
                *s = Slot {
                    id,
                    seq: next,
                    params,
                };
                self.recorded = next;
                return;
            }
        }
        self.record_slow(id, params, cap);
    }

    /// [`ExecutedOps::record`] when the ring is empty, must grow, or holds `id` already.
    fn record_slow(&mut self, id: u32, params: OpParams, cap: u32) {
        loop {
            let len = self.slots.len();
            if len == 0 {
                self.slots = vec![EMPTY; MIN_SLOTS.min(size_for(cap))];
                continue;
            }
            let i = id as usize & (len - 1);
            let s = self.slots[i];
            if s.id == id && self.kept(&s, cap) {
                // Still kept: only its parameters change (the map's insert of a present key).
                self.slots[i].params = params;
                return;
            }
            // This record evicts the oldest one if `cap` are kept, so `s` survives it when it
            // was made after that one.
            let survives = s.seq != 0 && self.recorded + 2 - s.seq <= u64::from(cap);
            if survives && len < size_for(cap) {
                self.grow();
                continue;
            }
            self.recorded += 1;
            self.slots[i] = Slot {
                id,
                seq: self.recorded,
                params,
            };
            return;
        }
    }

    /// Double the ring, keeping every record kept (ids distinct modulo the old length stay
    /// distinct modulo the new one).
    fn grow(&mut self) {
        let len = self.slots.len() * 2;
        let mut slots = vec![EMPTY; len];
        for s in self.slots.iter().filter(|s| s.seq != 0) {
            slots[s.id as usize & (len - 1)] = *s;
        }
        self.slots = slots;
    }

    /// Records kept: `min(records made, cap)` (the map's length; an id forgotten by the
    /// ring's rule above is still counted).
    pub fn len(&self) -> usize {
        self.recorded.min(u64::from(self.cap)) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, VecDeque};

    fn params(k: u64) -> OpParams {
        let mut p = OpParams::NONE;
        p.set_va_for_test(k);
        p
    }

    /// The hash map plus FIFO of ids the ring replaced, verbatim.
    #[derive(Default)]
    struct Model {
        map: HashMap<u32, OpParams>,
        order: VecDeque<u32>,
    }

    impl Model {
        fn record(&mut self, id: u32, p: OpParams, cap: u32) {
            if self.map.insert(id, p).is_none() {
                self.order.push_back(id);
                while self.order.len() > cap as usize {
                    let old = self.order.pop_front().unwrap();
                    self.map.remove(&old);
                }
            }
        }
    }

    /// Drives the ring and the model with the same records and compares every answer: equal,
    /// except where the ring forgot an id because a kept id a multiple of the ring size later
    /// took its slot (the one documented difference).
    fn check(cap: u32, ids: impl IntoIterator<Item = u32>, probe: impl Fn(u32) -> Vec<u32>) {
        let mut ring = ExecutedOps::default();
        let mut model = Model::default();
        let size = size_for(cap) as u32;
        for (k, id) in ids.into_iter().enumerate() {
            let p = params(k as u64);
            ring.record(id, p, cap);
            model.record(id, p, cap);
            assert_eq!(ring.len(), model.map.len(), "len after {k} records");
            assert!(ring.slots.len() <= size as usize);
            for q in probe(id) {
                let (r, m) = (ring.get(q, cap), model.map.get(&q));
                if r != m {
                    let taken = model
                        .order
                        .iter()
                        .rev()
                        .take_while(|&&o| o != q)
                        .any(|&o| o != q && o.wrapping_sub(q) % size == 0);
                    assert!(
                        r.is_none() && taken,
                        "cap {cap}: id {q} after record {k} (id {id}): ring {r:?}, map {m:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn consecutive_ids_match_the_map_exactly() {
        for cap in [1, 3, 4, 5, 64, 100] {
            let probe = |id: u32| (id.wrapping_sub(2 * cap + 3)..=id.wrapping_add(2)).collect();
            check(cap, 0..1000, probe);
            // Across the u32 wrap.
            check(cap, (0..1000u32).map(|k| k.wrapping_sub(500)), |id| {
                (0..2 * cap + 5).map(|d| id.wrapping_sub(d)).collect()
            });
        }
    }

    #[test]
    fn scattered_ids_match_the_map_but_for_ring_collisions() {
        // Ids a little out of order, with gaps (refused or aborted ops), duplicates and the
        // occasional far jump, as a requester with ops in flight and a misbehaving peer send.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for cap in [2, 7, 16, 33] {
            let mut base = u32::MAX - 300;
            let ids: Vec<u32> = (0..3000)
                .map(|_| {
                    let r = rnd();
                    base = base.wrapping_add((r % 3) as u32);
                    if r % 97 == 0 {
                        base = base.wrapping_add(cap * 5);
                    }
                    base.wrapping_add((r >> 8) as u32 % cap)
                })
                .collect();
            check(cap, ids, |id| {
                (0..3 * cap + 4)
                    .map(|d| id.wrapping_add(cap).wrapping_sub(d))
                    .collect()
            });
        }
    }

    #[test]
    fn idle_and_small_records_stay_small() {
        let mut ring = ExecutedOps::default();
        assert!(ring.slots.is_empty());
        assert_eq!(ring.get(0, 65_536), None);
        for id in 0..10 {
            ring.record(id, params(id as u64), 65_536);
        }
        assert_eq!(ring.slots.len(), 16);
        for id in 10..70_000 {
            ring.record(id, params(id as u64), 65_536);
        }
        assert_eq!(ring.slots.len(), 65_536);
        assert_eq!(
            ring.get(70_000 - 65_536, 65_536),
            Some(&params(70_000 - 65_536))
        );
        assert_eq!(ring.get(70_000 - 65_537, 65_536), None);
        assert_eq!(ring.len(), 65_536);
    }
}
