//! MemIO behind the engine seam: memory to memory on this node.

use super::Engine;
use crate::error::Result;
use crate::outcome::Route;
use crate::route::{HostDst, HostSrc, MemTransfer, side};
use gpuio_hal::{HalError, check_range};
use gpuio_transport_memio::MemIo;
use std::sync::Arc;

/// MemIO as an [`Engine`].
#[derive(Debug)]
pub struct MemIoEngine(pub Arc<MemIo>);

impl Engine for MemIoEngine {
    type Transfer<'a> = MemTransfer<'a>;

    fn transfer(&self, t: MemTransfer<'_>, len: usize) -> Result<Route> {
        let io = &self.0;
        let route = match t {
            MemTransfer::HostToDevice(src, d) => {
                src.with(len, |s| Ok(io.upload(s, d.buf, d.offset)?))?
            }
            MemTransfer::DeviceToHost(s, dst) => {
                dst.with(len, |d| Ok(io.download(s.buf, s.offset, d)?))?
            }
            MemTransfer::DeviceToDevice(s, d) => {
                io.copy_device(s.buf, s.offset, d.buf, d.offset, len)?
            }
            MemTransfer::HostToHost(src, dst) => return self.host_to_host(src, dst, len),
        };
        Ok(Route::Mem(route))
    }
}

impl MemIoEngine {
    /// Host to host. Two shared buffers are locked in a global order (by identity), so that
    /// copies in opposite directions cannot deadlock; one buffer on both sides takes one
    /// exclusive guard over both ranges and moves its bytes within itself.
    fn host_to_host(&self, src: HostSrc<'_>, dst: HostDst<'_>, len: usize) -> Result<Route> {
        let io = &self.0;
        if let (HostSrc::Memory(a, from), HostDst::Memory(b, to)) = (&src, &dst) {
            let (from, to) = (*from, *to);
            if a.id() == b.id() {
                // One guard over both ranges; a span refused is put down to the side it
                // overruns.
                check_range("source", from, len, usize::MAX)?;
                check_range("destination", to, len, usize::MAX)?;
                let low = from.min(to);
                let mut g = match a.shared().write_range(low, from.max(to) + len - low) {
                    Ok(g) => g,
                    Err(e) => {
                        if let HalError::OutOfRange { limit, .. } = &e {
                            check_range("source", from, len, *limit as usize)?;
                            check_range("destination", to, len, *limit as usize)?;
                        }
                        return Err(e.into());
                    }
                };
                g.copy_within(from - low..from - low + len, to - low);
                return Ok(Route::HostMove);
            }
            if a.id() > b.id() {
                let mut w = b
                    .shared()
                    .write_range(to, len)
                    .map_err(side("destination"))?;
                let r = a.shared().read_range(from, len).map_err(side("source"))?;
                return Ok(Route::Mem(io.copy_host(&r, &mut w)?));
            }
        }
        // The source is locked first: the global order where both are shared.
        src.with(len, |s| dst.with(len, |d| Ok(io.copy_host(s, d)?)))
            .map(Route::Mem)
    }
}
