//! Where a gather's index list goes: into pinned memory the kernels read as they go (written
//! piece by piece while the pieces before move), on to device memory, or — for the CPU's
//! paths, from a list already on the device — back into a pinned stage in host memory. The
//! pinned stages are pooled per device.

use crate::{MemIo, Result};
use gpuio_hal::sync::MutexExt;
use gpuio_hal::{DeviceBuffer, Gpu, HostAllocOptions, HostBuffer, RowIndices, RowKernel, Stream};
use rayon::prelude::*;
use std::ops::Range;

use super::GatherIndices;

/// Pinned host memory for an index list, written piece by piece while the kernels read it
/// over PCIe. (Copying it to the device first, even in stream order with no wait between,
/// measured slower for small rows on the H200: the copy runs before the kernel instead of
/// alongside.)
pub(crate) struct IndexStage {
    host: HostBuffer,
    /// Device memory of the same size, for lists copied to the device piece by piece
    /// (allocated on first use).
    device: Option<DeviceBuffer>,
}

/// An index list the CPU reads: the caller's, or a device list's part copied back into a
/// pinned stage, which goes back to the device's pool when this is dropped.
pub(super) enum HostList<'a> {
    Borrowed(&'a [u64]),
    Staged {
        io: &'a MemIo,
        gpu: &'a Gpu,
        stage: Option<IndexStage>,
        len: usize,
    },
}

impl std::ops::Deref for HostList<'_> {
    type Target = [u64];

    fn deref(&self) -> &[u64] {
        match self {
            Self::Borrowed(list) => list,
            Self::Staged { stage, len, .. } => stage
                .as_ref()
                .map_or(&[][..], |s| &s.host.as_u64s()[..*len]),
        }
    }
}

impl Drop for HostList<'_> {
    fn drop(&mut self) {
        if let Self::Staged { io, gpu, stage, .. } = self
            && let Some(stage) = stage.take()
        {
            io.give_stage(gpu, stage);
        }
    }
}

/// From this row size on, each piece of an index list is copied to the device before its
/// rows move (the copy is under 1% of the rows' bytes, and the kernel's index loads stop
/// waiting on PCIe round trips); below it the kernel reads the list from pinned memory as
/// it goes, because the copy would be 3–12% of the bytes, in series with the kernel.
const DEVICE_INDICES_FROM: usize = 1024;

/// Where a call's index list goes and who writes it into pinned memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum IndexPath {
    /// Read by the kernels from pinned memory as they go, written piece by piece on the
    /// calling thread while the kernels move the pieces before.
    Pinned,
    /// Copied to device memory piece by piece, written on the calling thread.
    Device,
    /// Written whole by the engine's copy threads together (not the gather threads, which
    /// may be running a hybrid's CPU share), then copied to device memory: for sorted
    /// gathers, whose rows wait for the whole list anyway (one thread writes ~1 index/ns:
    /// 0.7 ms for a million, a quarter of the time their rows take at 160 B).
    DeviceParallel,
}

impl IndexPath {
    /// The path of a gather of rows of `row_bytes` by `kernel`.
    pub(super) fn of(kernel: RowKernel, row_bytes: usize) -> Self {
        match kernel {
            RowKernel::Sorted => Self::DeviceParallel,
            _ if row_bytes >= DEVICE_INDICES_FROM => Self::Device,
            _ => Self::Pinned,
        }
    }
}

/// Indices per task of a parallel index write.
const ENCODE_TASK: usize = 8 << 10;

/// Writes `indices` as little-endian u64s into `out`, with stores that bypass the CPU caches:
/// the device reads the list next (by DMA or its kernels' loads), and lines still dirty in the
/// cores' caches would have to be snooped out of them first. On the H200 machine an 8 MiB list
/// written by 8 threads then copied took 0.60 ms with plain stores, 0.29 ms with these (the
/// copy alone: 0.16 ms). Staged row copies measured no such gain (CPU-staged gathers of 160 and
/// 656 B rows lost 10–30%): their DMAs overlap the next chunks' gathers.
fn encode_indices(indices: &[u64], out: &mut [u8]) {
    gpuio_hal::write_u64s_streaming(out, indices);
}

impl MemIo {
    /// Indices `range` of a list in host memory: borrowed from a host list; from a device
    /// list, copied back by DMA into a pinned index stage (resident memory: a fresh vector
    /// would fault in every page as the copy lands).
    pub(super) fn host_indices<'a>(
        &'a self,
        indices: GatherIndices<'a>,
        range: Range<usize>,
    ) -> Result<HostList<'a>> {
        let list = match indices {
            GatherIndices::Host(list) => return Ok(HostList::Borrowed(&list[range])),
            GatherIndices::Device { list, .. } => list,
        };
        let gpu = list.gpu();
        let len = range.len();
        let mut stage = self.take_stage(gpu, len * 8)?;
        let copied = self.with_stream(gpu, |s| {
            Ok(s.download(
                list,
                range.start * 8,
                &mut stage.host.as_mut_slice()[..len * 8],
            )?)
        });
        if let Err(e) = copied {
            self.give_stage(gpu, stage);
            return Err(e);
        }
        for w in &mut stage.host.as_u64s_mut()[..len] {
            *w = u64::from_le(*w);
        }
        Ok(HostList::Staged {
            io: self,
            gpu,
            stage: Some(stage),
            len,
        })
    }

    /// Runs `f` with a stream and the first `count` indices where the device reads them: a
    /// device list as it is, a host list staged by `path`.
    pub(super) fn with_gpu_indices<T>(
        &self,
        gpu: &Gpu,
        indices: GatherIndices<'_>,
        count: usize,
        path: IndexPath,
        f: impl FnOnce(&Stream, RowIndices<'_>) -> Result<T>,
    ) -> Result<T> {
        match indices {
            GatherIndices::Host(list) => self.with_indices(gpu, &list[..count], path, f),
            GatherIndices::Device { list, .. } => {
                self.with_stream(gpu, |s| f(s, RowIndices::Device(list)))
            }
        }
    }

    /// Stages `indices` in pinned memory the device reads (copied on to device memory piece
    /// by piece unless `path` is `Pinned`) and runs `f` with a stream and them.
    pub(super) fn with_indices<T>(
        &self,
        gpu: &Gpu,
        indices: &[u64],
        path: IndexPath,
        f: impl FnOnce(&Stream, RowIndices<'_>) -> Result<T>,
    ) -> Result<T> {
        let on_device = path != IndexPath::Pinned;
        let mut stage = self.take_stage(gpu, indices.len() * 8)?;
        if on_device && stage.device.is_none() {
            stage.device = Some(gpu.alloc(stage.host.len())?);
        }
        let out = match (path, stage.device.as_ref()) {
            (IndexPath::DeviceParallel, Some(device)) => {
                // Written all at once by the copy threads (one wake-up: each costs ~50 µs,
                // so not one per piece), then copied to the device in one DMA.
                let host = &mut stage.host;
                self.pool.install(|| {
                    host[..indices.len() * 8]
                        .par_chunks_mut(ENCODE_TASK * 8)
                        .zip(indices.par_chunks(ENCODE_TASK))
                        .for_each(|(o, i)| encode_indices(i, o));
                });
                self.with_stream(gpu, |s| f(s, RowIndices::Staged { host, device }))
            }
            _ => {
                // Written piece by piece on this thread while the device moves the pieces
                // before: the device starts after the first 4 Ki indices, and no pool threads
                // are woken.
                let mut encode =
                    |range: Range<usize>, out: &mut [u8]| encode_indices(&indices[range], out);
                self.with_stream(gpu, |s| {
                    f(
                        s,
                        RowIndices::Streamed {
                            stage: &mut stage.host,
                            encode: &mut encode,
                            device: stage.device.as_ref().filter(|_| on_device),
                        },
                    )
                })
            }
        };
        self.give_stage(gpu, stage);
        out
    }

    /// Stages `lists` one after another, whole, where the device reads them (pinned memory,
    /// copied on to device memory in one DMA unless `path` is `Pinned`), and runs `f` with a
    /// stream and them: for one launch that reads them all.
    pub(super) fn with_lists<T>(
        &self,
        gpu: &Gpu,
        lists: &[&[u64]],
        path: IndexPath,
        f: impl FnOnce(&Stream, RowIndices<'_>) -> Result<T>,
    ) -> Result<T> {
        let bytes = lists.iter().map(|l| l.len() * 8).sum::<usize>();
        let mut stage = self.take_stage(gpu, bytes)?;
        let mut at = 0;
        for list in lists {
            encode_indices(list, &mut stage.host[at..at + list.len() * 8]);
            at += list.len() * 8;
        }
        let on_device = path != IndexPath::Pinned;
        let out = (|| {
            if on_device && stage.device.is_none() {
                stage.device = Some(gpu.alloc(stage.host.len())?);
            }
            let indices = match stage.device.as_ref().filter(|_| on_device) {
                Some(device) => RowIndices::Staged {
                    host: &stage.host,
                    device,
                },
                None => RowIndices::Pinned(&stage.host),
            };
            self.with_stream(gpu, |s| f(s, indices))
        })();
        self.give_stage(gpu, stage);
        out
    }

    /// A pinned index stage of at least `bytes` from the device's pool (or a new one).
    fn take_stage(&self, gpu: &Gpu, bytes: usize) -> Result<IndexStage> {
        let dev = self.device(gpu)?;
        let pooled = {
            let mut stages = dev.index_stages.lock_unpoisoned();
            let at = stages.iter().position(|s| s.host.len() >= bytes);
            at.map(|i| stages.swap_remove(i))
        };
        if let Some(s) = pooled {
            return Ok(s);
        }
        let cap = bytes.next_power_of_two().max(64 << 10);
        let opts = HostAllocOptions {
            numa: gpu.info().numa_node,
            ..HostAllocOptions::default()
        };
        Ok(IndexStage {
            host: HostBuffer::alloc_pinned(cap, &opts, gpu)?,
            device: None,
        })
    }

    fn give_stage(&self, gpu: &Gpu, stage: IndexStage) {
        if let Ok(dev) = self.device(gpu) {
            dev.index_stages.lock_unpoisoned().push(stage);
        }
    }
}
