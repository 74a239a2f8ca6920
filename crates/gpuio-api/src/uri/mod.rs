//! Resource URIs (docs/REFERENCE.md#resource-uris): `<engine>://<resource>[?<params>]`.
//!
//! ```text
//! memio://cpu/dram[?numa=N]          host DRAM (on NUMA node N)
//! memio://cxl/<pool>[?device=N]      the N-th CXL memory expander (a CPU-less NUMA node)
//! memio://gpu/N   or   gpuN          memory of GPU N
//! localio:///path[?direct=1&gds=1]   a file or block device
//! file:///path   or   a plain path   a file
//! remoteio://host:port/resource[?transport=tcp|rdma&gdr=1]
//! remoteio://<segment>/resource      through the registry
//! nvme://0000:00:04.0/1              namespace 1 of the NVMe controller at that PCI address,
//!                                    driven by gpuio's own driver (vfio-pci or gpuio_nvme)
//! gpuio://<engine>/<resource>        the same, engine in the path
//! ```
//!
//! Parse errors name the problem and the byte where it starts.
//!
//! This file holds the parsed form and how it is shown (escaped, so that it parses back to the
//! same URI); `parse.rs` the parser.

mod parse;
#[cfg(test)]
mod tests;

use crate::error::{Error, Result, escape};
use gpuio_transport_memio::HostPlacement;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// A parsed resource URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Uri {
    /// Memory of GPU `n` (`gpuN`, `memio://gpu/N`).
    Gpu(u32),
    /// Host DRAM, optionally on one NUMA node.
    Dram {
        /// NUMA node.
        numa: Option<u32>,
    },
    /// CXL memory: the `device`-th memory-only NUMA node; `pool` names the pool.
    Cxl {
        /// Pool name.
        pool: String,
        /// Which expander.
        device: u32,
    },
    /// A file or block device.
    File {
        /// Its path.
        path: PathBuf,
        /// O_DIRECT requested.
        direct: bool,
        /// GPUDirect Storage: `Some(true)` for `gds=1` (cuFile or an error), `Some(false)` for
        /// `gds=0` (never cuFile), `None` to leave it to the engine's policy.
        gds: Option<bool>,
    },
    /// An NVMe namespace gpuio's own driver serves, as a block device (byte offsets).
    Nvme {
        /// The controller's PCI address, `0000:00:04.0`.
        address: String,
        /// The namespace identifier, from 1.
        nsid: u32,
    },
    /// A resource exported by another node.
    Remote {
        /// `host:port`, or a segment name resolved through the registry.
        target: RemoteTarget,
        /// The resource's path on that node.
        resource: String,
        /// TCP or RDMA.
        transport: RemoteTransport,
        /// GPUDirect RDMA requested.
        gdr: bool,
    },
}

/// Where a remote resource lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteTarget {
    /// A host and port.
    Address {
        /// Host name or address (IPv6 without brackets).
        host: String,
        /// Port.
        port: u16,
    },
    /// A segment registered in the registry.
    Segment(String),
}

/// The transport of a remote resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RemoteTransport {
    /// TCP.
    #[default]
    Tcp,
    /// RDMA verbs.
    Rdma,
    /// NIXL (UCX picks the transport).
    Nixl,
}

impl Uri {
    /// The host memory tier this URI names, if it names one.
    pub fn host_placement(&self) -> Option<HostPlacement> {
        match self {
            Self::Dram { numa } => Some(HostPlacement::Dram { numa: *numa }),
            Self::Cxl { device, .. } => Some(HostPlacement::Cxl { device: *device }),
            _ => None,
        }
    }

    /// Whether this names memory (a GPU or a host tier) rather than storage.
    pub fn is_memory(&self) -> bool {
        matches!(self, Self::Gpu(_) | Self::Dram { .. } | Self::Cxl { .. })
    }
}

impl FromStr for Uri {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

impl fmt::Display for Uri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Gpu(n) => write!(f, "gpu{n}"),
            Self::Dram { numa: None } => write!(f, "memio://cpu/dram"),
            Self::Dram { numa: Some(n) } => write!(f, "memio://cpu/dram?numa={n}"),
            Self::Cxl { pool, device } => {
                write!(f, "memio://cxl/{}?device={device}", escape(pool))
            }
            Self::File { path, direct, gds } => {
                use std::os::unix::ffi::OsStrExt;
                let p = encode_path(path.as_os_str().as_bytes());
                match (direct, gds) {
                    (false, None) if path.is_absolute() => write!(f, "file://{p}"),
                    // A plain path is taken as written (no percent-decoding): control
                    // characters are shown escaped, for people, at the cost of the round trip.
                    (false, None) => write!(f, "{}", escape(&path.to_string_lossy())),
                    (_, None) => write!(f, "localio://{p}?direct=1"),
                    (_, Some(g)) => {
                        write!(f, "localio://{p}?direct={}&gds={}", *direct as u8, *g as u8)
                    }
                }
            }
            Self::Nvme { address, nsid } => write!(f, "nvme://{}/{nsid}", escape(address)),
            Self::Remote {
                target,
                resource,
                transport,
                gdr,
            } => {
                match target {
                    RemoteTarget::Address { host, port } if host.contains(':') => {
                        write!(f, "remoteio://[{}]:{port}", escape(host))?
                    }
                    RemoteTarget::Address { host, port } => {
                        write!(f, "remoteio://{}:{port}", escape(host))?
                    }
                    RemoteTarget::Segment(s) => write!(f, "remoteio://{}", escape(s))?,
                }
                let t = match transport {
                    RemoteTransport::Tcp => "tcp",
                    RemoteTransport::Rdma => "rdma",
                    RemoteTransport::Nixl => "nixl",
                };
                write!(
                    f,
                    "/{}?transport={t}&gdr={}",
                    encode_path(resource.as_bytes()),
                    *gdr as u8
                )
            }
        }
    }
}

fn encode_path(p: &[u8]) -> String {
    let mut out = String::with_capacity(p.len());
    for &b in p {
        match b {
            b'%' | b'?' | b'#' | b' ' | 0..=0x1f | 0x7f.. => out.push_str(&format!("%{b:02X}")),
            _ => out.push(b as char),
        }
    }
    out
}

/// How deep `gpuio://gpuio/...` may nest. One level is all the grammar needs; each level is
/// a recursive call, so without a bound a long enough URI overflows the stack.
pub const MAX_URI_NESTING: usize = 4;
