//! The suite's index lists and the names of its cases.
//!
//! Two kinds of list per cell: drawn uniformly with replacement (about one repeat in three at
//! the default sizes: what a model's lookups look like, and what a cache can serve twice), and
//! distinct rows (a random permutation's prefix), where every delivered byte had to cross the
//! link.

use gpuio_hal::pattern;
use rayon::prelude::*;
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// The multiplier spreading list positions over the seed (the golden ratio's 32 bits).
const SPREAD: u64 = 0x9e37_79b9;

/// `n` row numbers below `rows`, drawn uniformly with replacement.
pub(crate) fn uniform(n: usize, rows: usize, seed: u64) -> Vec<u64> {
    (0..n)
        .into_par_iter()
        .map(|i| pattern::mix64(seed ^ (i as u64).wrapping_mul(SPREAD)) % rows as u64)
        .collect()
}

/// `min(n, rows)` distinct row numbers below `rows` in random order: the prefix of a random
/// permutation. A partial Fisher–Yates shuffle that keeps only the displaced slots, so a
/// 16 GiB pool of 64 B rows costs memory for the `n` rows drawn, not for every row.
pub(crate) fn distinct(n: usize, rows: usize, seed: u64) -> Vec<u64> {
    let (n, rows) = (n.min(rows) as u64, rows as u64);
    let mut moved: HashMap<u64, u64> = HashMap::with_capacity(2 * n as usize);
    (0..n)
        .map(|i| {
            let j = i + pattern::mix64(seed ^ i.wrapping_mul(SPREAD)) % (rows - i);
            let picked = moved.get(&j).copied().unwrap_or(j);
            // Slot i is never read again: only slot j needs what slot i held.
            let displaced = moved.remove(&i).unwrap_or(i);
            if j != i {
                moved.insert(j, displaced);
            }
            picked
        })
        .collect()
}

/// How many distinct rows `list` names.
pub(crate) fn distinct_count(list: &[u64]) -> usize {
    let mut sorted = list.to_vec();
    sorted.par_sort_unstable();
    sorted.dedup();
    sorted.len()
}

/// A directory of one pool's index lists for the torch peer, so it gathers the very rows gpuio
/// did; removed with its files when dropped.
pub(crate) struct ListDir(PathBuf);

impl ListDir {
    /// A fresh directory under the temporary directory.
    pub fn new(pool_bytes: usize) -> std::io::Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "gpuio-gather-{}-{}M",
            std::process::id(),
            pool_bytes >> 20
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Writes one list as `<row>-uniform.u64` or `<row>-distinct.u64`: little-endian 64-bit
    /// integers, which torch reads as int64.
    pub fn write(&self, row: usize, distinct: bool, list: &[u64]) -> std::io::Result<()> {
        let kind = if distinct { "distinct" } else { "uniform" };
        let bytes: Vec<u8> = list.iter().flat_map(|i| i.to_le_bytes()).collect();
        std::fs::write(self.0.join(format!("{row}-{kind}.u64")), bytes)
    }
}

impl Drop for ListDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One case of the grid as its records name it, e.g. `gather_656B_pool256M distinct device
/// list`: the row size, the pool, which list, and where gpuio's call found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct GridCase {
    /// Row size in bytes.
    pub row: usize,
    /// Pool size in MiB.
    pub pool_mib: usize,
    /// Distinct rows (else uniform with replacement).
    pub distinct: bool,
    /// gpuio's list already in device memory (else in host memory).
    pub device_list: bool,
}

impl GridCase {
    /// The cell's name, without list kind or place: `gather_656B_pool256M`.
    pub fn cell(&self) -> String {
        format!("gather_{}B_pool{}M", self.row, self.pool_mib)
    }

    /// Reads a name [`GridCase`]'s `Display` wrote; `None` for the suite's other cases.
    pub fn parse(name: &str) -> Option<Self> {
        let mut words = name.split(' ');
        let cell = words.next()?.strip_prefix("gather_")?;
        let (row, pool) = cell.split_once("B_pool")?;
        let mut case = Self {
            row: row.parse().ok()?,
            pool_mib: pool.strip_suffix('M')?.parse().ok()?,
            distinct: false,
            device_list: false,
        };
        let rest: Vec<&str> = words.collect();
        match rest.as_slice() {
            [] => {}
            ["distinct"] => case.distinct = true,
            ["device", "list"] => case.device_list = true,
            ["distinct", "device", "list"] => (case.distinct, case.device_list) = (true, true),
            _ => return None,
        }
        Some(case)
    }
}

impl fmt::Display for GridCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.cell())?;
        if self.distinct {
            f.write_str(" distinct")?;
        }
        if self.device_list {
            f.write_str(" device list")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_lists_are_permutation_prefixes() {
        let list = distinct(1000, 5000, 7);
        assert_eq!(list.len(), 1000);
        assert_eq!(distinct_count(&list), 1000);
        assert!(list.iter().all(|&r| r < 5000));
        // Asking for every row (or more) gives a permutation of them all.
        let mut all = distinct(9000, 4096, 11);
        all.sort_unstable();
        assert_eq!(all, (0..4096).collect::<Vec<u64>>());
        // Not the identity: the order is random.
        assert_ne!(distinct(64, 64, 3), (0..64).collect::<Vec<u64>>());
    }

    #[test]
    fn uniform_lists_repeat_as_sampling_with_replacement_does() {
        // n draws from n rows leave 1 - 1/e ≈ 63% of them distinct.
        let n = 100_000;
        let share = distinct_count(&uniform(n, n, 5)) as f64 / n as f64;
        assert!((0.62..0.645).contains(&share), "{share}");
    }

    #[test]
    fn case_names_round_trip() {
        for (distinct, device_list) in [(false, false), (true, false), (false, true), (true, true)]
        {
            let case = GridCase {
                row: 656,
                pool_mib: 256,
                distinct,
                device_list,
            };
            assert_eq!(GridCase::parse(&case.to_string()), Some(case));
        }
        assert_eq!(
            GridCase::parse("gather_64B_pool2048M device list").map(|c| c.row),
            Some(64)
        );
        assert_eq!(GridCase::parse("decode_layer_2048x656B"), None);
        assert_eq!(GridCase::parse("gather_64B_pool2048M twice"), None);
    }
}
