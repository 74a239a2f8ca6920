//! Files read through NVMe queues by their extents: the file system says where a file's bytes
//! lie on the device (FIEMAP), and the driver reads those blocks from the namespace directly,
//! with no file system on the data path. Only extents whose bytes are plainly on the device
//! qualify: a file with unwritten, shared, inline, encoded, encrypted, delayed or unaligned
//! extents, or with holes, is refused with the reason, since reading its blocks would not give
//! its contents. The list can be written out and read back (one extent per line), so that it
//! can be taken while the file system is mounted and used once the controller is handed to
//! this driver.

use super::controller::{BlockIo, IoQueuePair, Namespace};
use super::dma::DmaBuffer;
use gpuio_hal::error::{HalError, Result};
use gpuio_hal::file::Extent;
use std::fs::File;

/// FIEMAP flags that mean the bytes are not plainly at the extent's device location.
const UNREADABLE: &[(u32, &str)] = &[
    (0x2, "its location is unknown"),
    (0x4, "its allocation is delayed"),
    (0x8, "it is encoded (compressed)"),
    (0x80, "it is encrypted"),
    (0x100, "it is not block-aligned"),
    (0x200, "its data is inline in the metadata"),
    (0x400, "it is packed with other files' tails"),
    (0x800, "it is allocated but unwritten (it reads as zeros)"),
    (0x2000, "it is shared with another file (reflink)"),
];

/// Where a file's bytes lie on the whole device (the namespace) its file system is on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileExtents {
    /// The file's length in bytes.
    pub len: u64,
    /// Its extents in file order, covering `0..len` without holes: (file offset, device
    /// offset, length), in bytes.
    pub extents: Vec<(u64, u64, u64)>,
}

impl FileExtents {
    /// The extents of `file` (synced first), as byte offsets in the whole device its file
    /// system lies on (a partition's start added), or why its bytes cannot be read from it.
    pub fn of(file: &File) -> Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let meta = file
            .metadata()
            .map_err(|source| HalError::Os { op: "stat", source })?;
        let len = meta.len();
        let start = partition_start(meta.dev())?;
        if len == 0 {
            return Ok(Self {
                len,
                extents: Vec::new(),
            });
        }
        let found = gpuio_hal::file::extents(file, 0, len)?;
        Self::from_fiemap(len, &found, start)
    }

    /// Checks FIEMAP's extents of a `len`-byte file whose file system starts `start` bytes
    /// into its device.
    pub fn from_fiemap(len: u64, found: &[Extent], start: u64) -> Result<Self> {
        for e in found {
            if let Some((_, why)) = UNREADABLE.iter().find(|(f, _)| e.flags & f != 0) {
                return Err(refused(format!(
                    "its extent at file offset {} ({} bytes): {why}",
                    e.logical, e.length
                )));
            }
        }
        let extents = found
            .iter()
            .map(|e| {
                let physical = e.physical.checked_add(start).ok_or_else(|| {
                    refused(format!("its extent at {} overflows the device", e.physical))
                })?;
                Ok((e.logical, physical, e.length))
            })
            .collect::<Result<Vec<_>>>()?;
        let checked = Self { len, extents };
        checked.check()?;
        Ok(checked)
    }

    /// That the extents cover `0..len` in order, without holes.
    fn check(&self) -> Result<()> {
        let mut covered = 0u64;
        for &(logical, _, length) in &self.extents {
            if logical != covered {
                return Err(refused(format!(
                    "it has a hole at file offset {covered} (sparse files read holes as zeros)"
                )));
            }
            covered = logical.saturating_add(length);
        }
        if covered < self.len {
            return Err(refused(format!(
                "its bytes from {covered} on have no extent"
            )));
        }
        Ok(())
    }

    /// The block reads that bring the file into a buffer from offset 0, on a namespace of
    /// `block`-byte blocks: every extent as whole blocks, the file's last block read whole (the
    /// buffer must hold the length rounded up to a block).
    pub fn block_reads(&self, block: u64) -> Result<Vec<BlockIo>> {
        if !block.is_power_of_two() {
            return Err(HalError::InvalidArgument(format!(
                "a block size of {block} bytes (NVMe blocks are powers of two)"
            )));
        }
        let mut ops = Vec::with_capacity(self.extents.len());
        for &(logical, physical, length) in &self.extents {
            if logical % block != 0 || physical % block != 0 {
                return Err(refused(format!(
                    "its extent at file offset {logical} is not aligned to the namespace's \
                     {block}-byte blocks"
                )));
            }
            // The file's last extent may run past its end: read only what the file holds,
            // in whole blocks.
            let wanted = length.min(self.len.saturating_sub(logical));
            let too_large = || HalError::InvalidArgument("extent too large".into());
            let bytes = wanted
                .checked_next_multiple_of(block)
                .ok_or_else(too_large)?;
            if bytes == 0 {
                continue;
            }
            let len = usize::try_from(bytes).map_err(|_| too_large())?;
            let offset = usize::try_from(logical)
                .map_err(|_| HalError::InvalidArgument("file too large".into()))?;
            ops.push(BlockIo::new(false, physical / block, offset, len));
        }
        Ok(ops)
    }

    /// One line per extent: `file-offset device-offset length`, after a `len` line.
    pub fn to_text(&self) -> String {
        let mut s = format!("len {}\n", self.len);
        for (l, p, n) in &self.extents {
            s.push_str(&format!("{l} {p} {n}\n"));
        }
        s
    }

    /// Reads what [`to_text`](Self::to_text) wrote.
    pub fn from_text(text: &str) -> Result<Self> {
        let bad = |line: &str| HalError::InvalidArgument(format!("bad extent line: {line:?}"));
        let mut lines = text.lines();
        let first = lines.next().unwrap_or_default();
        let len = first
            .strip_prefix("len ")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| bad(first))?;
        let extents = lines
            .map(|line| {
                let v: Vec<u64> = line
                    .split_whitespace()
                    .map(|w| w.parse().map_err(|_| bad(line)))
                    .collect::<Result<_>>()?;
                match v[..] {
                    [l, p, n] => Ok((l, p, n)),
                    _ => Err(bad(line)),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let read = Self { len, extents };
        read.check()?;
        Ok(read)
    }
}

/// Where the file system on block device `dev` starts in its whole device, in bytes (0 for a
/// whole disk); refused for device-mapper and md devices, whose blocks are not one device's.
fn partition_start(dev: u64) -> Result<u64> {
    let (major, minor) = (
        (dev >> 8 & 0xfff) | (dev >> 32 & !0xfff),
        (dev & 0xff) | (dev >> 12 & !0xff),
    );
    let sys = std::path::PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    if !sys.exists() {
        return Err(refused(format!(
            "its file system is not on a block device ({major}:{minor})"
        )));
    }
    if sys.join("dm").exists() || sys.join("md").exists() {
        return Err(refused(
            "its file system is on a device-mapper or md device, whose blocks are not one \
             namespace's"
                .into(),
        ));
    }
    if !sys.join("partition").exists() {
        return Ok(0);
    }
    let sectors: u64 = std::fs::read_to_string(sys.join("start"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| refused(format!("the start of partition {major}:{minor} is unknown")))?;
    Ok(sectors * 512)
}

fn refused(why: String) -> HalError {
    HalError::Unsupported {
        what: "reading this file through its extents",
        reason: why,
    }
}

impl IoQueuePair {
    /// Reads the whole file that `extents` describes from namespace `ns` (the device its file
    /// system lies on, from byte 0) into `buf` from offset 0: every extent as block reads, the
    /// last block of the file read whole (`buf` must hold the length rounded up to a block).
    pub fn read_extents(
        &mut self,
        ns: &Namespace,
        extents: &FileExtents,
        buf: &DmaBuffer,
    ) -> Result<()> {
        let ops = extents.block_reads(ns.identity.block_size as u64)?;
        self.run(ns, buf, &ops)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extent(logical: u64, physical: u64, length: u64, flags: u32) -> Extent {
        Extent {
            logical,
            physical,
            length,
            flags,
        }
    }

    /// A file as long as the address space, in one extent: its last block cannot be rounded
    /// up (this overflowed), so it is refused.
    #[test]
    fn block_reads_never_wrap() {
        let huge = FileExtents {
            len: u64::MAX,
            extents: vec![(0, 0, u64::MAX)],
        };
        assert!(huge.block_reads(512).is_err());
        let small = FileExtents::from_text("len 700\n0 4096 1024\n").unwrap();
        let reads = small.block_reads(512).unwrap();
        assert_eq!((reads.len(), reads[0].lba, reads[0].len), (1, 8, 1024));
        assert!(small.block_reads(0).is_err() && small.block_reads(1000).is_err());
    }

    #[test]
    fn plain_extents_are_taken_and_round_trip_as_text() {
        let found = [
            extent(0, 1 << 20, 8192, 0),
            extent(8192, 4 << 20, 4096, Extent::LAST),
        ];
        let e = FileExtents::from_fiemap(10_000, &found, 0).unwrap();
        let moved = FileExtents::from_fiemap(10_000, &found, 1 << 20).unwrap();
        assert_eq!(moved.extents[0].1, 2 << 20, "a partition's start is added");
        assert_eq!(e.extents.len(), 2);
        assert_eq!(FileExtents::from_text(&e.to_text()).unwrap(), e);
        assert!(FileExtents::from_text("len x\n").is_err());
        assert!(FileExtents::from_text("len 5\n1 2\n").is_err());
        assert!(
            FileExtents::from_text("len 8192\n0 0 4096\n").is_err(),
            "a list that does not cover the file is refused"
        );
    }

    #[test]
    fn what_the_device_does_not_hold_is_refused_with_the_reason() {
        for (flags, word) in [
            (0x800, "unwritten"),
            (0x2000, "shared"),
            (0x200, "inline"),
            (0x2, "unknown"),
        ] {
            let err = FileExtents::from_fiemap(4096, &[extent(0, 0, 4096, flags)], 0).unwrap_err();
            assert!(err.to_string().contains(word), "{err}");
        }
        let hole = [
            extent(0, 0, 4096, 0),
            extent(8192, 8192, 4096, Extent::LAST),
        ];
        let err = FileExtents::from_fiemap(12288, &hole, 0).unwrap_err();
        assert!(err.to_string().contains("hole"), "{err}");
        let short =
            FileExtents::from_fiemap(9000, &[extent(0, 0, 4096, Extent::LAST)], 0).unwrap_err();
        assert!(short.to_string().contains("no extent"), "{short}");
    }
}
