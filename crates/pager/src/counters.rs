//! The pager's counters: one per event and per reason, so that `netram stats` and the
//! benchmarks say why something happened, not only how often.

macro_rules! counters {
    ($($(#[doc = $doc:literal])* $name:ident),* $(,)?) => {
        /// One counter per event and per reason (zswap style).
        #[derive(Debug, Clone, Default, PartialEq, Eq)]
        pub struct PagerCounters { $($(#[doc = $doc])* pub $name: u64,)* }
        impl PagerCounters {
            pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
                [$((stringify!($name), self.$name)),*].into_iter()
            }
        }
    };
}

counters! {
    reads,
    writes,
    cache_hits,
    /// Reads of pages never written: zeros, without a round trip.
    zero_reads,
    /// Reads decoded from the rest of their Reed-Solomon stripe or parity group (or that
    /// waited for recovery to bring their page back).
    degraded_reads,
    gets,
    puts,
    deletes,
    /// Write-backs of dirty pages evicted from the cache.
    evictions_dirty,
    evictions_clean,
    /// PUTs refused by a full server and placed again.
    puts_refused_full,
    /// PUTs a server found damaged on the way (checksum mismatch), placed again.
    puts_refused_corrupt,
    /// Pages written to the local disk because no server had room or was alive.
    spills,
    disk_reads,
    disk_writes,
    /// Writes the local disk failed. The page stays in memory, dirty, and is written again at
    /// the next eviction or flush; `flush` reports the error.
    disk_write_errors,
    /// Pages whose checksum failed on the way back.
    checksum_failures,
    /// Sealed pages that did not authenticate on the way back (damaged, another page, an old
    /// version, forged): refused like a bad checksum.
    page_auth_failures,
    /// Pages sealed as their LZ4 block (`PagerConfig::compress`), and the bytes that saved
    /// on the wire; pages sealed whole because LZ4 could not shrink them enough to pay
    /// (aborted) or because the link is too fast for any saving to repay the codec.
    pages_compressed,
    bytes_saved_compressing,
    pages_compress_aborted,
    pages_compress_not_worth,
    /// Pages that came back with another version than the page table expects.
    version_mismatches,
    /// GETs answered "missing" by a server that should hold the page.
    missing_pages,
    /// ... of which copies sent as clean pages (`cluster+disk`), which a full server may drop
    /// (GMS): forgotten, and read from the disk, never rebuilt.
    clean_copies_dropped,
    /// Reads served from the disk copy because the server was dead or the copy bad.
    disk_fallbacks,
    /// Replies a caller's operation waited for, with a blocking receive (whether or not the
    /// reply had arrived by then): what the waiting entry points (`read`, `write`, `flush`,
    /// ...) still cost. The event-driven ones (`start_read`, `try_write`, `try_flush`,
    /// `on_reply`, `on_tick`) never add to it.
    waits,
    /// Slots `write_over_budget` added to the pool for want of a free one, and its writes
    /// that waited as `write` does because the pool had grown by its limit already.
    slots_grown,
    writes_over_budget_waited,
    /// Reads by ticket that found no slot to be had without waiting (none free, no clean
    /// cached page, the pool grown by its limit) and waited for one as a state, not a call.
    ticket_slot_waits,
    /// Rounds of probes the maintenance schedule sent (an empty GET to every live server),
    /// and probes that went unanswered for the probe timeout (their servers failed).
    probe_rounds,
    probes_unanswered,
    /// Servers failed because a request waited for past the reply timeout without an answer
    /// ([`crate::Pager::expire`]): a server that hangs, found without waiting on it.
    requests_timed_out,
    servers_dead,
    /// Dead servers reconnected (empty: what they held before is gone).
    servers_revived,
    /// Reads served by another copy after the first failed (dead server, bad checksum, missing).
    reads_from_other_copy,
    /// Reads by ticket whose page was written or discarded while their GET was on its way,
    /// and whose answer (for the newer version) was therefore no fault of the server's: read
    /// again at the current version. Their answers are counted among the mismatches above.
    reads_restarted,
    /// Copies found bad (checksum, missing) and dropped, to be rebuilt from the others.
    copies_dropped_bad,
    /// Write-backs that ended with fewer copies than the scheme keeps (too few servers alive
    /// or with room), the local disk making up for the missing ones.
    writes_degraded,
    /// Pages whose lost copies were rebuilt onto live servers (recovery).
    pages_rebuilt,
    /// Pages that recovery found without any surviving copy.
    pages_unrecoverable,
    /// Reed-Solomon pieces restored as the XOR of their stripe's other pieces, and runs of the
    /// decoder (each for one stripe, or for a batch of stripes with one erasure pattern).
    pieces_restored_by_xor,
    decoder_runs,
    /// Reed-Solomon pieces a rebuild asked for after reads of its first pieces failed.
    pieces_asked_again,
    /// Parity groups opened, shipped to their holders, and failed to ship (their members
    /// joined other groups).
    parity_groups_opened,
    parity_ships,
    parity_groups_shipped,
    parity_ships_failed,
    /// Pages that joined a new group where they were (their old group was gone).
    parity_rejoins,
    /// Members rebuilt from their group's parity and the survivors.
    parity_members_rebuilt,
    /// Pages protected again after their parity holder died or their group was damaged.
    parity_reprotected,
    /// Parity PUTs sent again to the same server after it could not tell the group's holder
    /// (the holder may have changed the group and lost its answer).
    parity_puts_retried,
    /// Rounds that asked every server for damaged groups, and the groups found damaged and
    /// dissolved (their members protected again).
    parity_audits,
    parity_groups_dissolved,
    /// Recovery's reads whose slots a caller wanted (nothing else held one): given back, and
    /// their phase started again at a later step.
    parity_recovery_yields,
    /// Reed-Solomon stripes whose pieces were read but found no free slots to be decoded and
    /// written in (the program took them meanwhile): put back on recovery's list, not waited
    /// for.
    rebuilds_deferred,
    /// Groups whose parity a holder that shrank its offer held above it (Nswap §III), whose
    /// members were sent to new groups elsewhere so that they empty and leave.
    parity_groups_leaving,
    /// Pages whose move off a server that shrank its offer started, and moves that ended
    /// with the page at its new home (Nswap §III); of those, moves that found no server
    /// with room and left the page on the local disk alone.
    migrations_started,
    pages_migrated,
    pages_migrated_to_disk,
    /// Of the pages migrated, those that went server to server (`handover.rs`); and moves
    /// started that ended without moving the page (refused, its server died, the page changed
    /// meanwhile: it stayed where it was). Once nothing moves, `migrations_started` is
    /// `pages_migrated` plus `migrations_refused`.
    pages_migrated_direct,
    migrations_refused,
}
