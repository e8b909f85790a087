//! Per-operation segment bitmaps without a heap allocation for small operations.

use std::ops::{Deref, DerefMut};

/// Words kept inline: 256 segments, i.e. operations up to 1 MiB at a 4096-byte path MTU.
const INLINE_WORDS: usize = 4;

/// A bitmap of `words` 64-bit words, all zero at first: inline up to [`INLINE_WORDS`]
/// words, on the heap beyond (issue #13: no allocation per packet for operations of one or
/// a few segments). Dereferences to the word slice (bit i = bit i % 64 of word i / 64).
#[derive(Debug, Clone)]
pub(crate) enum SegBits {
    Inline {
        bits: [u64; INLINE_WORDS],
        words: u8,
    },
    Heap(Vec<u64>),
}

impl SegBits {
    /// `words` zero words.
    pub(crate) fn zeroed(words: usize) -> SegBits {
        if words <= INLINE_WORDS {
            SegBits::Inline {
                bits: [0; INLINE_WORDS],
                words: words as u8,
            }
        } else {
            SegBits::Heap(vec![0; words])
        }
    }
}

impl Deref for SegBits {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        match self {
            SegBits::Inline { bits, words } => &bits[..*words as usize],
            SegBits::Heap(v) => v,
        }
    }
}

impl DerefMut for SegBits {
    fn deref_mut(&mut self) -> &mut [u64] {
        match self {
            SegBits::Inline { bits, words } => &mut bits[..*words as usize],
            SegBits::Heap(v) => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_and_heap_bitmaps_have_the_asked_length_and_start_zero() {
        for words in [0, 1, 4, 5, 100] {
            let mut b = SegBits::zeroed(words);
            assert_eq!(b.len(), words);
            assert!(b.iter().all(|&w| w == 0));
            if let Some(last) = b.last_mut() {
                *last = u64::MAX;
            }
            assert_eq!(b.iter().filter(|&&w| w == u64::MAX).count(), words.min(1));
            assert_eq!(matches!(b, SegBits::Heap(_)), words > INLINE_WORDS);
        }
    }
}
