//! Redis Cluster hash slots: which slot a lock name's keys live in, and a
//! short hash tag for every slot, so that a per-slot key (the restart
//! guard's record) can sit beside the locks of that slot in one script.

use std::sync::LazyLock;

/// How many hash slots a Redis Cluster has.
pub(crate) const SLOTS: u16 = 16384;

/// The slot of a key whose hash tag is `tag` (Redis hashes only what is
/// between the first `{` and the next `}`): CRC16/XMODEM modulo 16,384, as
/// the server and the driver compute it.
pub(crate) fn slot(tag: &str) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(tag.as_bytes()) % SLOTS
}

/// For every slot, the smallest decimal number whose text hashes to it,
/// found once per process (about 200,000 CRCs, a few milliseconds).
static TAGS: LazyLock<Vec<u32>> = LazyLock::new(|| {
    let mut tags = vec![u32::MAX; usize::from(SLOTS)];
    let mut missing = usize::from(SLOTS);
    let mut n = 0u32;
    while missing > 0 {
        let t = &mut tags[usize::from(slot(&n.to_string()))];
        if *t == u32::MAX {
            *t = n;
            missing -= 1;
        }
        n += 1;
    }
    tags
});

/// A hash tag (without braces) that maps to `slot`.
pub(crate) fn tag_of(slot: u16) -> String {
    TAGS[usize::from(slot % SLOTS)].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
    #[test]
    fn slots_are_the_servers() {
        assert_eq!(slot("123456789"), 0x31C3 % SLOTS);
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("bar"), 5061);
        assert_eq!(slot("jobs/import"), slot("jobs/import"));
    }

    #[test]
    fn every_slot_has_a_tag_that_maps_to_it() {
        for s in 0..SLOTS {
            assert_eq!(slot(&tag_of(s)), s, "slot {s}");
        }
        assert!(TAGS.iter().all(|t| *t < 1_000_000), "tags stay short");
    }
}
