//! A set of `u32` ids kept as disjoint ranges per parity: the stream ids of one direction of a
//! connection that ended and were forgotten (`RecvState` and `SendQueue` retire them).
//!
//! Stream ids are single-use per connection and direction, and `open_stream` hands them out
//! in increasing order per side, so the retired ids of a long-lived connection that opens a
//! stream per request merge into a few ranges: the set stays small while the per-stream
//! state it replaces would grow with every request.

use std::collections::BTreeMap;

/// Disjoint, non-adjacent inclusive ranges `start ..= end` of ids of one parity, kept per
/// parity as ranges of `id / 2`: each side of a connection opens streams of its own parity
/// (`open_stream`: even for the connecting side, odd for the accepting side), so its ids,
/// two apart, merge.
#[derive(Debug, Default, Clone)]
pub(crate) struct IdSet {
    /// Per parity (`id & 1`): ranges of `id >> 1`, keyed by start.
    ranges: [BTreeMap<u32, u32>; 2],
}

impl IdSet {
    fn split(id: u32) -> (usize, u32) {
        ((id & 1) as usize, id >> 1)
    }

    fn has(map: &BTreeMap<u32, u32>, k: u32) -> bool {
        map.range(..=k)
            .next_back()
            .is_some_and(|(_, &end)| k <= end)
    }

    /// Whether `id` is in the set. O(log ranges).
    pub fn contains(&self, id: u32) -> bool {
        let (p, k) = Self::split(id);
        Self::has(&self.ranges[p], k)
    }

    /// Number of ranges (what the set costs in memory).
    pub fn ranges(&self) -> usize {
        self.ranges[0].len() + self.ranges[1].len()
    }

    /// Whether inserting `id` would add a range (it joins no neighbour of its parity and
    /// is not in the set): the caller may refuse that when the set is at its size limit.
    pub fn would_grow(&self, id: u32) -> bool {
        let (p, k) = Self::split(id);
        let map = &self.ranges[p];
        if Self::has(map, k) {
            return false;
        }
        let joins_below = k.checked_sub(1).is_some_and(|below| Self::has(map, below));
        let joins_above = k
            .checked_add(1)
            .is_some_and(|above| map.contains_key(&above));
        !joins_below && !joins_above
    }

    /// Adds `id`, merging it with the ranges next to it. O(log ranges).
    pub fn insert(&mut self, id: u32) {
        let (p, k) = Self::split(id);
        let map = &mut self.ranges[p];
        if Self::has(map, k) {
            return;
        }
        let mut start = k;
        let mut end = k;
        if let Some(below) = k.checked_sub(1) {
            if let Some((&s, &e)) = map.range(..=below).next_back() {
                if e == below {
                    start = s;
                }
            }
        }
        if let Some(above) = k.checked_add(1) {
            if let Some(e) = map.remove(&above) {
                end = e;
            }
        }
        map.insert(start, end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ids_in_order_stay_one_range_per_parity() {
        // One side's streams: ids two apart.
        let mut s = IdSet::default();
        for id in (0..100_000u32).map(|i| 2 * i + 1) {
            s.insert(id);
        }
        assert_eq!(s.ranges(), 1);
        assert!(s.contains(1) && s.contains(199_999) && !s.contains(2) && !s.contains(0));
        // Every third odd id: nothing merges.
        let mut s = IdSet::default();
        for id in (0..1_000u32).map(|i| 6 * i + 1) {
            s.insert(id);
        }
        assert_eq!(s.ranges(), 1_000);
        let mut s = IdSet::default();
        for id in 0..100_000u32 {
            s.insert(id);
        }
        assert_eq!(s.ranges(), 2);
        assert!(s.contains(0) && s.contains(99_999) && !s.contains(100_000));
        s.insert(u32::MAX);
        s.insert(u32::MAX - 2);
        assert_eq!(s.ranges(), 3);
        assert!(s.contains(u32::MAX) && !s.contains(u32::MAX - 4));
    }

    proptest! {
        /// Against a plain set: membership after any inserts, ranges disjoint and
        /// non-adjacent, and `would_grow` says whether an insert adds a range.
        #[test]
        fn agrees_with_a_plain_set(ids in proptest::collection::vec(0u32..64, 0..80)) {
            let mut s = IdSet::default();
            let mut plain = std::collections::BTreeSet::new();
            for id in ids {
                let before = s.ranges();
                let grow = s.would_grow(id);
                s.insert(id);
                plain.insert(id);
                prop_assert_eq!(s.ranges() > before, grow);
                for probe in 0..66 {
                    prop_assert_eq!(s.contains(probe), plain.contains(&probe));
                }
                for map in &s.ranges {
                    let mut last: Option<u32> = None;
                    for (&a, &b) in map {
                        prop_assert!(a <= b);
                        if let Some(l) = last {
                            prop_assert!(a > l + 1, "ranges touch or overlap");
                        }
                        last = Some(b);
                    }
                }
            }
        }
    }
}
