//! The bounds every setting is checked against when a configuration is loaded (from the
//! built-in file, a user's file or the environment): a value out of range is refused with the
//! key it was given under, so no session starts with a setting that would hang or overflow.

use super::{API_VERSION, Config, PoolSize};
use crate::error::{Error, Result};
use bytesize::ByteSize;
use gpuio_transport_remoteio::wire::MAX_DATA;

/// The most page cache registering threads LocalIO runs (it clamps to 1..=8).
const MAX_PAGE_CACHE_THREADS: usize = 8;

/// The shortest handshake, request and client timeout taken, in milliseconds.
const MIN_TIMEOUT_MS: u64 = 100;

/// The shortest idle timeout taken, in milliseconds.
const MIN_IDLE_TIMEOUT_MS: u64 = 1000;

impl Config {
    /// Checks every setting; `source_name` says in the error where they were read from.
    pub(super) fn validate(&self, source_name: &str) -> Result<()> {
        let bad = |message: String| {
            Err(Error::Config {
                source_name: source_name.into(),
                message,
            })
        };
        if self.api_version != API_VERSION {
            return bad(format!(
                "api_version {} is not supported (this build reads version {API_VERSION})",
                self.api_version
            ));
        }
        if !(1..=1024).contains(&self.workers) {
            return bad(format!("workers = {}: must be 1 to 1024", self.workers));
        }
        if self.memio.threads > gpuio_transport_memio::MAX_THREADS {
            return bad(format!(
                "memio.threads = {}: at most {}",
                self.memio.threads,
                gpuio_transport_memio::MAX_THREADS
            ));
        }
        if self.memio.resident_linger_ms > 60_000 {
            return bad(format!(
                "memio.resident_linger_ms = {}: at most 60000 (a device-wide synchronize \
                 waits up to that long)",
                self.memio.resident_linger_ms
            ));
        }
        let chunk_ok =
            |c: ByteSize| (4096..=gpuio_transport_memio::MAX_CHUNK as u64).contains(&c.as_u64());
        if !chunk_ok(self.memio.chunk_size) || !chunk_ok(self.localio.chunk_size) {
            return bad("staging chunk sizes must be from 4 KiB to 1 GiB".into());
        }
        if !(2..=64).contains(&self.memio.slots_per_lane)
            || !(2..=64).contains(&self.localio.slots_per_lane)
        {
            return bad("slots_per_lane must be 2 to 64".into());
        }
        if self.localio.lanes > 256 || self.localio.host_threads > 256 {
            return bad(format!(
                "localio.lanes = {}, host_threads = {}: at most 256 each",
                self.localio.lanes, self.localio.host_threads
            ));
        }
        let sc = &self.scheduler;
        if !(4096..=(1u64 << 30)).contains(&sc.chunk_size.as_u64()) {
            return bad("scheduler.chunk_size must be from 4 KiB to 1 GiB".into());
        }
        if sc.engine_in_flight.as_u64() < 4096 || sc.session_in_flight.as_u64() < 4096 {
            return bad("scheduler in-flight budgets must be at least 4 KiB".into());
        }
        if sc.coalesce_max.as_u64() > (1u64 << 30) {
            return bad("scheduler.coalesce_max must be at most 1 GiB".into());
        }
        if sc.max_wait_us > 60_000_000 || sc.urgent_window_us > 60_000_000 || sc.spin_us > 10_000 {
            return bad(
                "scheduler: max_wait_us and urgent_window_us at most 60 s, spin_us at most 10 ms"
                    .into(),
            );
        }
        if sc.lease_linger_us > 10_000 {
            return bad("scheduler.lease_linger_us must be at most 10 ms".into());
        }
        if !(1..=64).contains(&self.host_devices) {
            return bad("host_devices must be 1 to 64".into());
        }
        // One reading of the memory the machine can back now, for every bound below (each
        // reading walks /proc and the cgroup tree).
        let room = gpuio_hal::memory::backing::backable_bytes(false);
        self.validate_page_cache(room).or_else(bad)?;
        self.validate_pool_size(room).or_else(bad)?;
        self.validate_retry_and_remote().or_else(bad)?;
        self.cache.validate().or_else(bad)
    }

    /// `[localio]` page cache settings: the registering threads LocalIO runs (it takes 1 to 8),
    /// and the pinned bytes kept for hot files, at most what the machine can back pinned
    /// (`room`, from `backable_bytes(false)`).
    fn validate_page_cache(&self, room: Option<u64>) -> std::result::Result<(), String> {
        let threads = self.localio.page_cache_threads;
        if !(1..=MAX_PAGE_CACHE_THREADS).contains(&threads) {
            return Err(format!(
                "localio.page_cache_threads = {threads}: must be 1 to {MAX_PAGE_CACHE_THREADS}"
            ));
        }
        if let PoolSize::Bytes(keep) = self.localio.page_cache_keep
            && let Some(most) = room
            && keep.as_u64() > most
        {
            return Err(format!(
                "localio.page_cache_keep = {}: must be 0 to {} (what this machine can back as \
                 pinned memory now), or \"auto\"",
                keep.display().iec(),
                ByteSize::b(most).display().iec()
            ));
        }
        Ok(())
    }

    /// `memory_pool_size`: room for at least one lane of either transport (a transfer needs
    /// one; more lanes are taken only where there is room) and no more than the machine can
    /// back as pinned memory now (available memory within the cgroup, without swap: pinned
    /// pages cannot be swapped). `auto` is resolved now to check the lane against it.
    fn validate_pool_size(&self, room: Option<u64>) -> std::result::Result<(), String> {
        let iec = |n: u64| ByteSize::b(n).display().iec().to_string();
        let lane = self.lane_staging_bytes();
        let PoolSize::Bytes(size) = self.memory_pool_size else {
            let limit = gpuio_staging::auto_limit_of(room);
            if limit < lane {
                return Err(format!(
                    "memory_pool_size = \"auto\" is {} on this machine, below what one staging \
                     lane needs ({}: {}); lower those, or give memory_pool_size a size",
                    iec(limit),
                    iec(lane),
                    self.lane_settings()
                ));
            }
            return Ok(());
        };
        if size.as_u64() < lane {
            return Err(format!(
                "memory_pool_size = {}: below what one staging lane needs ({}: {}); give at \
                 least that, or \"auto\"",
                size.display().iec(),
                iec(lane),
                self.lane_settings()
            ));
        }
        if let Some(most) = room
            && size.as_u64() > most
        {
            return Err(format!(
                "memory_pool_size = {}: above what this machine can back as pinned memory now \
                 ({}: available memory within its cgroup, without swap); give at most that, or \
                 \"auto\"",
                size.display().iec(),
                iec(most)
            ));
        }
        Ok(())
    }

    /// What a staging lane holds, by the settings that size it, for the errors.
    fn lane_settings(&self) -> String {
        format!(
            "a MemIO lane holds memio.slots_per_lane x memio.chunk_size = {} x {}, a LocalIO \
             lane localio.slots_per_lane x localio.chunk_size = {} x {}, each buffer rounded up \
             to a power of two",
            self.memio.slots_per_lane,
            self.memio.chunk_size.display().iec(),
            self.localio.slots_per_lane,
            self.localio.chunk_size.display().iec()
        )
    }

    /// The settings of `[retry]`, `[agent]` and `[remote]`: a zero that would hang (no
    /// connection ever served, a timeout that has always expired, a lease that is gone before
    /// it is renewed) or an unbounded count is refused, naming the key.
    fn validate_retry_and_remote(&self) -> std::result::Result<(), String> {
        fn within<T: PartialOrd + std::fmt::Display>(
            key: &str,
            value: T,
            range: std::ops::RangeInclusive<T>,
            unit: &str,
        ) -> std::result::Result<(), String> {
            if range.contains(&value) {
                return Ok(());
            }
            Err(format!(
                "{key} = {value}: must be {} to {}{unit}",
                range.start(),
                range.end()
            ))
        }
        // Timeouts: up to an hour.
        const MAX_TIMEOUT_MS: u64 = 3_600_000;
        let r = &self.retry;
        within("retry.max_retries", r.max_retries, 0..=100, "")?;
        within(
            "retry.max_backoff_us",
            r.max_backoff_us,
            0..=60_000_000,
            " (microseconds)",
        )?;
        within(
            "retry.initial_backoff_us",
            r.initial_backoff_us,
            0..=r.max_backoff_us,
            " (microseconds, at most max_backoff_us)",
        )?;
        if !(r.backoff_multiplier.is_finite() && (1.0..=1000.0).contains(&r.backoff_multiplier)) {
            return Err(format!(
                "retry.backoff_multiplier = {}: must be a number from 1 to 1000",
                r.backoff_multiplier
            ));
        }
        let a = &self.agent;
        let rm = &self.remote;
        // Floors, each with the reason the error gives: a timeout of a millisecond or two
        // is taken, and then every handshake or copy fails.
        for (key, ms, floor, why) in [
            (
                "agent.handshake_timeout_ms",
                a.handshake_timeout_ms,
                MIN_TIMEOUT_MS,
                "below it, clients a few round trips away can never authenticate",
            ),
            (
                "agent.io_timeout_ms",
                a.io_timeout_ms,
                MIN_TIMEOUT_MS,
                "below it, requests (up to 16 MiB each) time out before their data crosses",
            ),
            (
                "agent.idle_timeout_ms",
                a.idle_timeout_ms,
                MIN_IDLE_TIMEOUT_MS,
                "below it, sessions close between a client's requests, to be reopened, handshake and all",
            ),
            (
                "remote.timeout_ms",
                rm.timeout_ms,
                MIN_TIMEOUT_MS,
                "below it, connecting and awaiting answers time out, and every copy fails",
            ),
        ] {
            if !(floor..=MAX_TIMEOUT_MS).contains(&ms) {
                return Err(format!(
                    "{key} = {ms}: must be {floor} to {MAX_TIMEOUT_MS} milliseconds ({why})"
                ));
            }
        }
        within("agent.max_connections", a.max_connections, 1..=65_536, "")?;
        within("agent.max_handshakes", a.max_handshakes, 1..=65_536, "")?;
        within(
            "agent.max_handshakes_per_address",
            a.max_handshakes_per_address,
            1..=65_536,
            "",
        )?;
        within(
            "agent.max_sessions_per_key",
            a.max_sessions_per_key,
            1..=65_536,
            "",
        )?;
        if !(MAX_DATA as u64..=1 << 40).contains(&a.buffer_memory.as_u64()) {
            return Err(format!(
                "agent.buffer_memory = {}: must hold one message ({}) and be at most 1 TiB",
                a.buffer_memory,
                ByteSize::b(MAX_DATA as u64).display().iec()
            ));
        }
        within("agent.threads", a.threads, 1..=64, "")?;
        // Renewed every third of it; etcd's leases need a couple of seconds.
        within("agent.lease_ttl_s", a.lease_ttl_s, 2..=86_400, " (seconds)")?;
        for e in &a.exports {
            if e.memory.is_some_and(|m| m.as_u64() == 0) {
                return Err(format!(
                    "agent.exports {:?}: memory = 0: nothing would be served",
                    e.name
                ));
            }
        }
        within("remote.connections", rm.connections, 1..=256, "")?;
        if !(4096..=MAX_DATA as u64).contains(&rm.stripe_size.as_u64()) {
            return Err(format!(
                "remote.stripe_size = {}: must be from 4 KiB to {} (a request's largest payload)",
                rm.stripe_size,
                ByteSize::b(MAX_DATA as u64).display().iec()
            ));
        }
        Ok(())
    }
}
