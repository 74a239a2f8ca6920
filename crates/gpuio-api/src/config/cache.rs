//! `[cache]`: the block cache in front of files opened with
//! [`Session::open_cached`](crate::Session::open_cached) (docs/REFERENCE.md#block-cache). Its
//! sizes, write policy and prefetching as written in TOML, their `GPUIO_CACHE_*` overrides,
//! the bounds checked when a configuration is loaded, and the core's [`CacheConfig`] built
//! from them, where the sizes are also checked against what this machine can back now: L1
//! against its GPU's memory, L2 against the host memory available (invariant I12 in
//! docs/ARCHITECTURE.md), L3 against the free space of its directory.

use super::Config;
use crate::error::{Error, Result};
use bytesize::ByteSize;
use gpuio_core::cache::prefetch::{MAX_DEPTH, MAX_HISTORY};
use gpuio_core::cache::{CacheConfig, MAX_BLOCK_SIZE, PrefetchConfig, WriteMode};
use gpuio_hal::Gpu;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Smallest accepted `[cache] block_size`.
pub const MIN_CACHE_BLOCK: u64 = 4096;

/// Most blocks one cache level may have (each level keeps a list of its free slots, 8 bytes
/// per block, from the start).
pub const MAX_CACHE_BLOCKS: u64 = 1 << 24;

/// Largest L1 or L2 (`l1_size`, `l2_size`).
pub const MAX_CACHE_MEMORY: u64 = 1 << 40;

/// Largest L3 (`l3_size`).
pub const MAX_CACHE_L3: u64 = 64 << 40;

/// When writes through the cache reach the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WritePolicy {
    /// Writes stay in the cache (dirty) until a flush, an eviction or the file's close.
    #[default]
    WriteBack,
    /// Every write reaches the file before it returns.
    WriteThrough,
}

impl std::str::FromStr for WritePolicy {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "write-back" => Ok(Self::WriteBack),
            "write-through" => Ok(Self::WriteThrough),
            _ => Err(format!(
                "unknown write policy {s:?} (write-back, write-through)"
            )),
        }
    }
}

impl From<WritePolicy> for WriteMode {
    fn from(p: WritePolicy) -> Self {
        match p {
            WritePolicy::WriteBack => Self::WriteBack,
            WritePolicy::WriteThrough => Self::WriteThrough,
        }
    }
}

/// `[cache]`: the block cache of files opened with `Session::open_cached`. Each such file has
/// a cache of these sizes of its own; sizes are rounded down to whole blocks, and a level of
/// no blocks is absent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheSection {
    /// Bytes per block ([`MIN_CACHE_BLOCK`] to 1 GiB).
    #[serde(serialize_with = "super::sections::exact_size")]
    pub block_size: ByteSize,
    /// L1, in the memory of GPU `gpu` (0: no L1).
    #[serde(serialize_with = "super::sections::exact_size")]
    pub l1_size: ByteSize,
    /// The GPU of L1 (its ordinal in the session).
    pub gpu: u32,
    /// L2, in host memory (0: no L2); pinned for the GPU where there is an L1.
    #[serde(serialize_with = "super::sections::exact_size")]
    pub l2_size: ByteSize,
    /// Directory of L3's file, on a local SSD (empty: no L3). The file is unlinked as soon as
    /// it is open.
    pub l3_dir: String,
    /// L3's size, where there is an `l3_dir`.
    #[serde(serialize_with = "super::sections::exact_size")]
    pub l3_size: ByteSize,
    /// Write-back or write-through.
    pub write_policy: WritePolicy,
    /// Prefetch predicted blocks on a background thread.
    pub prefetch: bool,
    /// Blocks predicted ahead of a sequential or strided run (1 to 1024).
    pub prefetch_depth: usize,
    /// Entries of the prefetcher's history table (0 to 1048576).
    pub prefetch_history: usize,
}

impl Default for CacheSection {
    fn default() -> Self {
        let p = PrefetchConfig::default();
        Self {
            block_size: ByteSize::kib(64),
            l1_size: ByteSize::b(0),
            gpu: 0,
            l2_size: ByteSize::mib(64),
            l3_dir: String::new(),
            l3_size: ByteSize::gib(1),
            write_policy: WritePolicy::WriteBack,
            prefetch: p.enabled,
            prefetch_depth: p.depth,
            prefetch_history: p.history,
        }
    }
}

fn iec(bytes: u64) -> String {
    ByteSize::b(bytes).display().iec().to_string()
}

impl CacheSection {
    /// Blocks of a level of `size` bytes.
    fn blocks(&self, size: ByteSize) -> u64 {
        size.as_u64() / self.block_size.as_u64().max(1)
    }

    /// Whether L3 is configured (a directory and at least one block).
    fn has_l3(&self) -> bool {
        !self.l3_dir.is_empty() && self.blocks(self.l3_size) > 0
    }

    /// The bounds, checked when a configuration is loaded; the message names the key.
    pub(super) fn validate(&self) -> std::result::Result<(), String> {
        let bs = self.block_size.as_u64();
        if !(MIN_CACHE_BLOCK..=MAX_BLOCK_SIZE as u64).contains(&bs) {
            return Err(format!(
                "cache.block_size = {}: must be from {} to {}",
                iec(bs),
                iec(MIN_CACHE_BLOCK),
                iec(MAX_BLOCK_SIZE as u64)
            ));
        }
        let l3_used = !self.l3_dir.is_empty();
        for (key, size, max, used) in [
            ("cache.l1_size", self.l1_size, MAX_CACHE_MEMORY, true),
            ("cache.l2_size", self.l2_size, MAX_CACHE_MEMORY, true),
            ("cache.l3_size", self.l3_size, MAX_CACHE_L3, l3_used),
        ] {
            let n = size.as_u64();
            if n > max {
                return Err(format!("{key} = {}: at most {}", iec(n), iec(max)));
            }
            if used && n > 0 && n < bs {
                return Err(format!(
                    "{key} = {}: holds no block of block_size {}",
                    iec(n),
                    iec(bs)
                ));
            }
            if n / bs > MAX_CACHE_BLOCKS {
                return Err(format!(
                    "{key} = {}: {} blocks of {}, at most {MAX_CACHE_BLOCKS} per level (use \
                     larger blocks)",
                    iec(n),
                    n / bs,
                    iec(bs)
                ));
            }
        }
        if self.l3_dir.contains('\0') {
            return Err("cache.l3_dir contains a NUL byte".into());
        }
        if !(1..=MAX_DEPTH).contains(&self.prefetch_depth) {
            return Err(format!(
                "cache.prefetch_depth = {}: must be 1 to {MAX_DEPTH} (prefetch = false turns \
                 prefetching off)",
                self.prefetch_depth
            ));
        }
        if self.prefetch_history > MAX_HISTORY {
            return Err(format!(
                "cache.prefetch_history = {}: at most {MAX_HISTORY}",
                self.prefetch_history
            ));
        }
        if self.blocks(self.l1_size) == 0 && self.blocks(self.l2_size) == 0 && !self.has_l3() {
            return Err(
                "[cache] has no level: give l1_size, l2_size, or l3_dir with l3_size".into(),
            );
        }
        Ok(())
    }

    /// Applies the `GPUIO_CACHE_*` overrides read through `get`.
    pub(super) fn apply_env(&mut self, get: &dyn Fn(&str) -> Option<String>) -> Result<()> {
        fn parse<T: std::str::FromStr>(var: &str, v: &str, expected: &str) -> Result<T> {
            v.trim().parse().map_err(|_| Error::ConfigEnv {
                var: var.into(),
                value: v.into(),
                expected: expected.into(),
            })
        }
        let size = "a size such as 64MiB";
        for (var, field) in [
            ("GPUIO_CACHE_BLOCK_SIZE", &mut self.block_size),
            ("GPUIO_CACHE_L1_SIZE", &mut self.l1_size),
            ("GPUIO_CACHE_L2_SIZE", &mut self.l2_size),
            ("GPUIO_CACHE_L3_SIZE", &mut self.l3_size),
        ] {
            if let Some(v) = get(var) {
                *field = parse(var, &v, size)?;
            }
        }
        if let Some(v) = get("GPUIO_CACHE_L3_DIR") {
            self.l3_dir = v;
        }
        if let Some(v) = get("GPUIO_CACHE_WRITE_POLICY") {
            self.write_policy = parse(
                "GPUIO_CACHE_WRITE_POLICY",
                &v,
                "write-back or write-through",
            )?;
        }
        if let Some(v) = get("GPUIO_CACHE_PREFETCH") {
            self.prefetch = match v.trim().to_ascii_lowercase().as_str() {
                "1" | "on" | "true" | "yes" => true,
                "0" | "off" | "false" | "no" => false,
                _ => {
                    return Err(Error::ConfigEnv {
                        var: "GPUIO_CACHE_PREFETCH".into(),
                        value: v,
                        expected: "on or off".into(),
                    });
                }
            };
        }
        if let Some(v) = get("GPUIO_CACHE_PREFETCH_DEPTH") {
            self.prefetch_depth = parse("GPUIO_CACHE_PREFETCH_DEPTH", &v, "a number of blocks")?;
        }
        Ok(())
    }
}

impl Config {
    /// The block cache's configuration for a file opened cached, with L1 on one of `gpus`
    /// (the session's). Refused with a [`Error::Config`] naming the key where this machine
    /// cannot back a level now: L1 larger than its GPU's memory (or `cache.gpu` not among
    /// `gpus`), L2 larger than the host memory available (pinned where there is an L1, so
    /// swap does not count then), L3 larger than the free space of `l3_dir` (or the directory
    /// unusable).
    pub fn cache_config(&self, gpus: &[Gpu]) -> Result<CacheConfig> {
        let c = &self.cache;
        let bs = c.block_size.as_u64();
        let l1_blocks = c.blocks(c.l1_size);
        let gpu = if l1_blocks > 0 {
            let gpu = gpus.get(c.gpu as usize).ok_or_else(|| {
                self.config_error(format!(
                    "cache.gpu = {}: this session has {} GPU(s)",
                    c.gpu,
                    gpus.len()
                ))
            })?;
            let (want, has) = (l1_blocks * bs, gpu.info().total_memory);
            if want > has {
                return Err(self.config_error(format!(
                    "cache.l1_size = {}: GPU {} has {} of memory",
                    iec(want),
                    c.gpu,
                    iec(has)
                )));
            }
            Some(gpu.clone())
        } else {
            None
        };
        let l2_blocks = c.blocks(c.l2_size);
        let pinned = gpu.is_some();
        if l2_blocks > 0
            && let Some(room) = gpuio_hal::memory::backing::backable_bytes(!pinned)
            && l2_blocks * bs > room
        {
            return Err(self.config_error(format!(
                "cache.l2_size = {}: this machine can back {} of {} memory now",
                iec(l2_blocks * bs),
                iec(room),
                if pinned { "pinned host" } else { "host" }
            )));
        }
        let l3_dir = c.has_l3().then(|| PathBuf::from(&c.l3_dir));
        let l3_blocks = if l3_dir.is_some() {
            c.blocks(c.l3_size)
        } else {
            0
        };
        if let Some(dir) = &l3_dir {
            let free = gpuio_hal::file::available_space(dir).map_err(|e| {
                self.config_error(format!("cache.l3_dir = {:?}: {e}", dir.display()))
            })?;
            if l3_blocks * bs > free {
                return Err(self.config_error(format!(
                    "cache.l3_size = {}: {:?} has {} free",
                    iec(l3_blocks * bs),
                    dir.display(),
                    iec(free)
                )));
            }
        }
        Ok(CacheConfig {
            block_size: bs as usize,
            l1_blocks: l1_blocks as usize,
            l2_blocks: l2_blocks as usize,
            l3_blocks: l3_blocks as usize,
            l3_dir,
            gpu,
            mode: c.write_policy.into(),
            prefetch: PrefetchConfig {
                enabled: c.prefetch,
                depth: c.prefetch_depth,
                history: c.prefetch_history,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuio_hal::BackendPreference;
    use std::collections::HashMap;

    fn cache(toml: &str) -> Result<Config> {
        Config::from_toml(&format!("[cache]\n{toml}\n"), None)
    }

    fn host_gpus() -> Vec<Gpu> {
        gpuio_hal::probe_with(BackendPreference::Host, 1)
            .unwrap()
            .gpus
    }

    #[test]
    fn the_built_in_file_and_the_rust_defaults_agree() {
        assert_eq!(Config::default().cache, CacheSection::default());
        let cfg = Config::default().cache_config(&host_gpus()).unwrap();
        assert_eq!(cfg.block_size, 64 << 10);
        assert_eq!((cfg.l1_blocks, cfg.l2_blocks, cfg.l3_blocks), (0, 1024, 0));
        assert!(cfg.gpu.is_none() && cfg.l3_dir.is_none());
        assert_eq!(cfg.mode, WriteMode::WriteBack);
        assert!(cfg.prefetch.enabled);
        assert_eq!(cfg.prefetch.depth, 8);
    }

    #[test]
    fn files_set_every_key() {
        let dir = tempfile::tempdir().unwrap();
        let c = cache(&format!(
            "block_size = \"16 KiB\"\nl1_size = \"1 MiB\"\ngpu = 0\nl2_size = \"2 MiB\"\n\
             l3_dir = {:?}\nl3_size = \"100 KiB\"\nwrite_policy = \"write-through\"\n\
             prefetch = false\nprefetch_depth = 3\nprefetch_history = 10",
            dir.path().to_str().unwrap()
        ))
        .unwrap();
        assert_eq!(c.cache.write_policy, WritePolicy::WriteThrough);
        let round = Config::from_toml(&c.to_toml(), None).unwrap();
        assert_eq!(round.cache, c.cache);
        let cfg = c.cache_config(&host_gpus()).unwrap();
        // Rounded down to whole blocks: 100 KiB holds six of 16 KiB.
        assert_eq!((cfg.l1_blocks, cfg.l2_blocks, cfg.l3_blocks), (64, 128, 6));
        assert_eq!(cfg.gpu.as_ref().map(Gpu::ordinal), Some(0));
        assert_eq!(cfg.l3_dir.as_deref(), Some(dir.path()));
        assert_eq!(cfg.mode, WriteMode::WriteThrough);
        assert_eq!(
            cfg.prefetch,
            PrefetchConfig {
                enabled: false,
                depth: 3,
                history: 10
            }
        );
        // No directory, no L3, whatever its size.
        let c = cache("l3_size = \"5 GiB\"").unwrap();
        assert_eq!(c.cache_config(&host_gpus()).unwrap().l3_blocks, 0);
    }

    #[test]
    fn out_of_bounds_values_are_refused_naming_the_key() {
        let cases = [
            ("block_size = \"1 KiB\"", "cache.block_size"),
            ("block_size = \"2 GiB\"", "cache.block_size"),
            ("l1_size = \"2 TiB\"", "cache.l1_size"),
            ("l2_size = \"2 TiB\"", "cache.l2_size"),
            ("l2_size = \"4 KiB\"", "cache.l2_size"),
            (
                "block_size = \"4 KiB\"\nl2_size = \"128 GiB\"",
                "cache.l2_size",
            ),
            ("l3_dir = \"/tmp\"\nl3_size = \"65 TiB\"", "cache.l3_size"),
            ("l3_dir = \"/tmp\"\nl3_size = \"1 KiB\"", "cache.l3_size"),
            ("prefetch_depth = 0", "cache.prefetch_depth"),
            ("prefetch_depth = 1025", "cache.prefetch_depth"),
            ("prefetch_history = 2000000", "cache.prefetch_history"),
            ("l2_size = \"0 B\"", "[cache] has no level"),
            (
                "l2_size = \"0 B\"\nl3_size = \"1 GiB\"",
                "[cache] has no level",
            ),
            ("write_policy = \"sometimes\"", "sometimes"),
            ("size = \"1 GiB\"", "size"),
        ];
        for (toml, key) in cases {
            let e = cache(toml).unwrap_err();
            assert!(matches!(e, Error::Config { .. }), "{toml}: {e}");
            assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg);
            assert!(e.to_string().contains(key), "{toml}: {e}");
        }
        // A level of its own is enough.
        assert!(cache("l2_size = \"0 B\"\nl1_size = \"1 MiB\"").is_ok());
        assert!(cache("l2_size = \"0 B\"\nl3_dir = \"/tmp\"").is_ok());
    }

    #[test]
    fn the_environment_overrides_and_bad_values_are_typed_errors() {
        let env: HashMap<&str, &str> = [
            ("GPUIO_CACHE_BLOCK_SIZE", "16KiB"),
            ("GPUIO_CACHE_L1_SIZE", "1MiB"),
            ("GPUIO_CACHE_L2_SIZE", "8MiB"),
            ("GPUIO_CACHE_L3_DIR", "/var/tmp"),
            ("GPUIO_CACHE_L3_SIZE", "32MiB"),
            ("GPUIO_CACHE_WRITE_POLICY", "write-through"),
            ("GPUIO_CACHE_PREFETCH", "off"),
            ("GPUIO_CACHE_PREFETCH_DEPTH", "5"),
        ]
        .into();
        let mut c = Config::default();
        c.apply_env(|k| env.get(k).map(|v| v.to_string())).unwrap();
        let want = CacheSection {
            block_size: ByteSize::kib(16),
            l1_size: ByteSize::mib(1),
            gpu: 0,
            l2_size: ByteSize::mib(8),
            l3_dir: "/var/tmp".into(),
            l3_size: ByteSize::mib(32),
            write_policy: WritePolicy::WriteThrough,
            prefetch: false,
            prefetch_depth: 5,
            prefetch_history: 4096,
        };
        assert_eq!(c.cache, want);
        for (var, value) in [
            ("GPUIO_CACHE_L2_SIZE", "lots"),
            ("GPUIO_CACHE_PREFETCH", "maybe"),
            ("GPUIO_CACHE_WRITE_POLICY", "write-around"),
            ("GPUIO_CACHE_PREFETCH_DEPTH", "-1"),
        ] {
            let e = Config::default()
                .apply_env(|k| (k == var).then(|| value.to_string()))
                .unwrap_err();
            assert!(matches!(e, Error::ConfigEnv { .. }), "{var}: {e}");
            assert!(e.to_string().contains(var), "{e}");
        }
        // Parsed, then out of bounds: the bounds' error, naming the key.
        let e = Config::default()
            .apply_env(|k| (k == "GPUIO_CACHE_BLOCK_SIZE").then(|| "1KiB".to_string()))
            .unwrap_err();
        assert!(matches!(e, Error::Config { .. }), "{e}");
        assert!(e.to_string().contains("cache.block_size"), "{e}");
    }

    #[test]
    fn levels_the_machine_cannot_back_are_refused_when_the_cache_is_built() {
        let gpus = host_gpus();
        let refused = |toml: &str, key: &str| {
            let e = cache(toml).unwrap().cache_config(&gpus).unwrap_err();
            assert!(matches!(e, Error::Config { .. }), "{toml}: {e}");
            assert!(e.to_string().contains(key), "{toml}: {e}");
        };
        refused("l1_size = \"1 MiB\"\ngpu = 7", "cache.gpu = 7");
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        refused(
            &format!("l3_dir = {:?}", missing.to_str().unwrap()),
            "cache.l3_dir",
        );
        let free = gpuio_hal::file::available_space(dir.path()).unwrap();
        if free < MAX_CACHE_L3 {
            refused(
                &format!(
                    "block_size = \"16 MiB\"\nl3_dir = {:?}\nl3_size = \"64 TiB\"",
                    dir.path().to_str().unwrap()
                ),
                "cache.l3_size",
            );
        }
        if gpus[0].info().total_memory < MAX_CACHE_MEMORY {
            refused(
                "block_size = \"1 MiB\"\nl1_size = \"1 TiB\"",
                "cache.l1_size",
            );
        }
        let room = gpuio_hal::memory::backing::backable_bytes(false).unwrap_or(u64::MAX);
        if room < MAX_CACHE_MEMORY {
            // Pinned for L1's GPU: swap does not count.
            refused(
                "block_size = \"1 MiB\"\nl1_size = \"1 MiB\"\nl2_size = \"1 TiB\"",
                "cache.l2_size",
            );
        }
    }
}
