//! Striping (`stripe_size`, `num_devices`; docs/REFERENCE.md#localio): one logical byte stream laid
//! RAID-0 style over several files, typically one per NVMe device, so a transfer reads or writes
//! all of them at once. Stripe unit `k` of the stream lives in file `k % n` at offset
//! `(k / n) * stripe_size`.

use crate::file::{FileHandle, OpenOptions};
use crate::{LocalIoError, Result};
use gpuio_hal::HalError;
use std::path::Path;

/// Files striped with a fixed stripe unit.
#[derive(Debug, Clone)]
pub struct StripeSet {
    files: Vec<FileHandle>,
    stripe_size: u64,
}

impl StripeSet {
    /// Most files in one set (each lane keeps them all registered with its ring).
    pub const MAX_FILES: usize = 32;

    /// A set over `files` in stripe order. `stripe_size` must be a multiple of every file's
    /// O_DIRECT alignment, so that stripe units never share a block.
    pub fn new(files: Vec<FileHandle>, stripe_size: u64) -> Result<Self> {
        let invalid = |msg: String| LocalIoError::Hal(HalError::InvalidArgument(msg));
        if files.is_empty() || files.len() > Self::MAX_FILES {
            return Err(invalid(format!(
                "a stripe set needs 1 to {} files, not {}",
                Self::MAX_FILES,
                files.len()
            )));
        }
        if stripe_size == 0 {
            return Err(invalid("the stripe size must not be zero".into()));
        }
        if let Some(f) = files
            .iter()
            .find(|f| !stripe_size.is_multiple_of(f.required_alignment() as u64))
        {
            return Err(invalid(format!(
                "stripe size {stripe_size} is not a multiple of the {}-byte O_DIRECT alignment of {}",
                f.required_alignment(),
                f.path().display()
            )));
        }
        Ok(Self { files, stripe_size })
    }

    /// Opens `paths` in stripe order with the same options.
    pub fn open(
        paths: impl IntoIterator<Item = impl AsRef<Path>>,
        stripe_size: u64,
        opts: OpenOptions,
    ) -> Result<Self> {
        let files = paths
            .into_iter()
            .map(|p| FileHandle::open(p, opts))
            .collect::<Result<Vec<_>>>()?;
        Self::new(files, stripe_size)
    }

    /// The files, in stripe order (`num_devices` is their count).
    pub fn files(&self) -> &[FileHandle] {
        &self.files
    }

    /// Bytes per stripe unit.
    pub fn stripe_size(&self) -> u64 {
        self.stripe_size
    }

    /// Which file holds logical byte `pos`, and where in it.
    pub fn locate(&self, pos: u64) -> (usize, u64) {
        let n = self.files.len() as u64;
        let unit = pos / self.stripe_size;
        let within = pos % self.stripe_size;
        ((unit % n) as usize, unit / n * self.stripe_size + within)
    }

    /// Logical bytes readable from the start without a gap: where the first byte missing
    /// from any file would sit in the stream.
    pub fn len(&self) -> Result<u64> {
        let n = self.files.len() as u64;
        let mut len = u64::MAX;
        for (i, f) in self.files.iter().enumerate() {
            let have = f.len()?;
            let first_missing = ((have / self.stripe_size) * n + i as u64) * self.stripe_size
                + have % self.stripe_size;
            len = len.min(first_missing);
        }
        Ok(len)
    }

    /// Whether the stream is empty.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// The per-file pieces `(file, offset, length)` of logical range `offset..offset + len`,
    /// in stream order.
    pub(crate) fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = (usize, u64, u64)> {
        let end = offset + len;
        let mut pos = offset;
        std::iter::from_fn(move || {
            (pos < end).then(|| {
                let (file, at) = self.locate(pos);
                let n = (self.stripe_size - pos % self.stripe_size).min(end - pos);
                pos += n;
                (file, at, n)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(n: usize, lens: &[u64], stripe: u64) -> (tempfile::TempDir, StripeSet) {
        let dir = tempfile::tempdir().unwrap();
        let paths: Vec<_> = (0..n).map(|i| dir.path().join(format!("s{i}"))).collect();
        for (p, len) in paths.iter().zip(lens) {
            std::fs::write(p, vec![0u8; *len as usize]).unwrap();
        }
        let s = StripeSet::open(&paths, stripe, OpenOptions::READ).unwrap();
        (dir, s)
    }

    #[test]
    fn units_rotate_over_the_files() {
        let (_d, s) = set(3, &[0, 0, 0], 100);
        assert_eq!(s.locate(0), (0, 0));
        assert_eq!(s.locate(150), (1, 50));
        assert_eq!(s.locate(299), (2, 99));
        assert_eq!(s.locate(300), (0, 100));
        let p: Vec<_> = s.pieces(250, 200).collect();
        assert_eq!(p, vec![(2, 50, 50), (0, 100, 100), (1, 100, 50)]);
        assert_eq!(s.pieces(5, 0).count(), 0);
    }

    #[test]
    fn length_stops_at_the_first_gap() {
        // Stream units: f0[0..100] f1[0..100] f0[100..200] f1[100..200] ...
        let (_d, s) = set(2, &[200, 150], 100);
        assert_eq!(s.len().unwrap(), 350);
        let (_d, s) = set(2, &[120, 100], 100);
        assert_eq!(s.len().unwrap(), 220);
        let (_d, s) = set(2, &[0, 100], 100);
        assert!(s.is_empty().unwrap());
    }

    #[test]
    fn bad_sets_are_refused() {
        assert!(StripeSet::new(Vec::new(), 4096).is_err());
        let (_d, s) = set(1, &[0], 100);
        assert!(StripeSet::new(s.files().to_vec(), 0).is_err());
    }
}
