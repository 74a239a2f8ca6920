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
//! gpuio://<engine>/<resource>        the same, engine in the path
//! ```
//!
//! Parse errors name the problem and the byte where it starts.

use crate::error::{Error, Result, UriProblem, escape};
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RemoteTransport {
    /// TCP.
    #[default]
    Tcp,
    /// RDMA verbs.
    Rdma,
}

impl Uri {
    /// Parses a URI or a plain path.
    pub fn parse(input: &str) -> Result<Self> {
        Parser { input, depth: 0 }.parse()
    }

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
                let p = encode_path(&path.to_string_lossy());
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
                };
                write!(
                    f,
                    "/{}?transport={t}&gdr={}",
                    encode_path(resource),
                    *gdr as u8
                )
            }
        }
    }
}

fn encode_path(p: &str) -> String {
    let mut out = String::with_capacity(p.len());
    for b in p.bytes() {
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

struct Parser<'a> {
    input: &'a str,
    /// `gpuio://` levels around this one.
    depth: usize,
}

/// `key=value` parameters with the byte offset of each.
struct Params<'a> {
    items: Vec<(&'a str, &'a str, usize)>,
}

impl<'a> Parser<'a> {
    fn err(&self, position: usize, problem: UriProblem) -> Error {
        Error::Uri {
            input: self.input.into(),
            position,
            problem,
        }
    }

    fn parse(&self) -> Result<Uri> {
        let s = self.input;
        if s.trim().is_empty() {
            return Err(self.err(0, UriProblem::Empty));
        }
        let Some(sep) = s.find("://") else {
            return self.parse_bare(s);
        };
        let scheme = &s[..sep];
        if scheme.is_empty()
            || !scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            || !scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        {
            return Err(self.err(0, UriProblem::BadScheme(scheme.into())));
        }
        let rest_at = sep + 3;
        match scheme.to_ascii_lowercase().as_str() {
            "memio" => self.parse_memio(rest_at),
            "localio" => self.parse_file(rest_at, true),
            "file" => self.parse_file(rest_at, false),
            "remoteio" => self.parse_remote(rest_at),
            "gpuio" => self.parse_gpuio(rest_at),
            _ => Err(self.err(0, UriProblem::UnknownScheme(scheme.into()))),
        }
    }

    /// `gpu<N>` or a plain path.
    fn parse_bare(&self, s: &str) -> Result<Uri> {
        if let Some(n) = s.strip_prefix("gpu")
            && (n.is_empty() || n.starts_with(|c: char| c.is_ascii_digit()))
        {
            return n
                .parse()
                .map(Uri::Gpu)
                .map_err(|_| self.err(0, UriProblem::BadGpuShorthand(s.into())));
        }
        Ok(Uri::File {
            path: PathBuf::from(s),
            direct: false,
            gds: None,
        })
    }

    /// `gpuio://<engine>/<resource>`: re-parse as `<engine>://<resource>`.
    fn parse_gpuio(&self, at: usize) -> Result<Uri> {
        let rest = &self.input[at..];
        let (engine, tail) = rest.split_once('/').unwrap_or((rest, ""));
        if engine.is_empty() {
            return Err(self.err(
                at,
                UriProblem::MissingResource {
                    expected: "an engine: gpuio://memio/..., gpuio://localio/..., gpuio://remoteio/...",
                },
            ));
        }
        // File resources are absolute paths: gpuio://localio/mnt/x is localio:///mnt/x.
        let root = if matches!(engine, "localio" | "file") && !tail.starts_with('/') {
            "/"
        } else {
            ""
        };
        if self.depth >= MAX_URI_NESTING {
            return Err(self.err(
                0,
                UriProblem::TooDeep {
                    max: MAX_URI_NESTING,
                },
            ));
        }
        let inner = format!("{engine}://{root}{tail}");
        let parsed = Parser {
            input: &inner,
            depth: self.depth + 1,
        }
        .parse();
        parsed.map_err(|e| match e {
            Error::Uri {
                position, problem, ..
            } => {
                // Map a position in "<engine>://[/]<tail>" back onto "gpuio://<engine>/<tail>".
                let (e, prefix) = (engine.len(), engine.len() + 3 + root.len());
                let position = if position < e {
                    at + position
                } else if position < prefix {
                    at + e
                } else {
                    at + e + 1 + (position - prefix)
                };
                self.err(position, problem)
            }
            other => other,
        })
    }

    /// Splits `<authority>/<path>?<query>` starting at byte `at`.
    fn split(&self, at: usize) -> (&'a str, &'a str, Option<(&'a str, usize)>) {
        let rest = &self.input[at..];
        let (body, query) = match rest.find('?') {
            Some(q) => (&rest[..q], Some((&rest[q + 1..], at + q + 1))),
            None => (rest, None),
        };
        match body.find('/') {
            Some(p) => (&body[..p], &body[p..], query),
            None => (body, "", query),
        }
    }

    fn params(&self, query: Option<(&'a str, usize)>) -> Result<Params<'a>> {
        let mut items = Vec::new();
        let Some((q, base)) = query else {
            return Ok(Params { items });
        };
        let mut pos = base;
        for part in q.split('&') {
            if !part.is_empty() {
                let (k, v) = part
                    .split_once('=')
                    .ok_or_else(|| self.err(pos, UriProblem::MissingValue(part.into())))?;
                if items.iter().any(|(name, _, _)| *name == k) {
                    return Err(self.err(pos, UriProblem::DuplicateParam(k.into())));
                }
                items.push((k, v, pos));
            }
            pos += part.len() + 1;
        }
        Ok(Params { items })
    }

    fn check_allowed(&self, params: &Params<'a>, allowed: &'static str) -> Result<()> {
        for (k, _, pos) in &params.items {
            if !allowed.split(", ").any(|a| a == *k) {
                return Err(self.err(
                    *pos,
                    UriProblem::UnknownParam {
                        name: (*k).into(),
                        allowed,
                    },
                ));
            }
        }
        Ok(())
    }

    fn number<T: FromStr>(
        &self,
        params: &Params<'a>,
        name: &str,
        expected: &'static str,
    ) -> Result<Option<T>> {
        params
            .items
            .iter()
            .find(|(k, _, _)| *k == name)
            .map(|(k, v, pos)| {
                v.parse().map_err(|_| {
                    self.err(
                        *pos,
                        UriProblem::BadParam {
                            name: (*k).into(),
                            value: (*v).into(),
                            expected,
                        },
                    )
                })
            })
            .transpose()
    }

    /// A boolean parameter: `None` where absent.
    fn flag(&self, params: &Params<'a>, name: &str) -> Result<Option<bool>> {
        match params.items.iter().find(|(k, _, _)| *k == name) {
            None => Ok(None),
            Some((_, "1" | "true" | "yes", _)) => Ok(Some(true)),
            Some((_, "0" | "false" | "no", _)) => Ok(Some(false)),
            Some((k, v, pos)) => Err(self.err(
                *pos,
                UriProblem::BadParam {
                    name: (*k).into(),
                    value: (*v).into(),
                    expected: "0 or 1",
                },
            )),
        }
    }

    fn parse_memio(&self, at: usize) -> Result<Uri> {
        let (authority, path, query) = self.split(at);
        let params = self.params(query)?;
        let path_at = at + authority.len();
        let segment = path.trim_start_matches('/').trim_end_matches('/');
        match authority {
            "cpu" => {
                if segment != "dram" {
                    return Err(self.err(
                        path_at,
                        UriProblem::UnknownResource {
                            found: segment.into(),
                            expected: "memio://cpu/dram",
                        },
                    ));
                }
                self.check_allowed(&params, "numa")?;
                Ok(Uri::Dram {
                    numa: self.number(&params, "numa", "a NUMA node number")?,
                })
            }
            "cxl" => {
                if segment.is_empty() || segment.contains('/') {
                    return Err(self.err(
                        path_at,
                        UriProblem::MissingResource {
                            expected: "a pool name: memio://cxl/<pool>?device=N",
                        },
                    ));
                }
                self.check_allowed(&params, "device")?;
                Ok(Uri::Cxl {
                    pool: segment.into(),
                    device: self
                        .number(&params, "device", "a CXL device number")?
                        .unwrap_or(0),
                })
            }
            "gpu" => {
                self.check_allowed(&params, "")?;
                segment.parse().map(Uri::Gpu).map_err(|_| {
                    self.err(
                        path_at,
                        UriProblem::UnknownResource {
                            found: segment.into(),
                            expected: "a GPU number: memio://gpu/N",
                        },
                    )
                })
            }
            "" => Err(self.err(
                at,
                UriProblem::MissingResource {
                    expected: "cpu/dram, cxl/<pool> or gpu/<N>",
                },
            )),
            other => Err(self.err(
                at,
                UriProblem::UnknownResource {
                    found: other.into(),
                    expected: "cpu/dram, cxl/<pool> or gpu/<N>",
                },
            )),
        }
    }

    fn parse_file(&self, at: usize, localio: bool) -> Result<Uri> {
        let (authority, path, query) = self.split(at);
        if !authority.is_empty() && authority != "localhost" {
            return Err(self.err(at, UriProblem::NotAbsolute(format!("{authority}{path}"))));
        }
        if path.is_empty() {
            return Err(self.err(
                at,
                UriProblem::MissingResource {
                    expected: "an absolute path: scheme:///path",
                },
            ));
        }
        let params = self.params(query)?;
        let (direct, gds) = if localio {
            self.check_allowed(&params, "direct, gds")?;
            (
                self.flag(&params, "direct")?.unwrap_or(false),
                self.flag(&params, "gds")?,
            )
        } else {
            self.check_allowed(&params, "")?;
            (false, None)
        };
        let path_at = at + authority.len();
        Ok(Uri::File {
            path: PathBuf::from(self.decode(path, path_at)?),
            direct,
            gds,
        })
    }

    fn parse_remote(&self, at: usize) -> Result<Uri> {
        let (authority, path, query) = self.split(at);
        if authority.is_empty() {
            return Err(self.err(at, UriProblem::MissingHost));
        }
        let target = if let Some(v6) = authority.strip_prefix('[') {
            let (host, port) = v6
                .split_once("]:")
                .ok_or_else(|| self.err(at, UriProblem::BadPort(authority.into())))?;
            RemoteTarget::Address {
                host: host.into(),
                port: self.port(port, at + host.len() + 3)?,
            }
        } else if let Some((host, port)) = authority.rsplit_once(':') {
            if host.is_empty() {
                return Err(self.err(at, UriProblem::MissingHost));
            }
            RemoteTarget::Address {
                host: host.into(),
                port: self.port(port, at + host.len() + 1)?,
            }
        } else {
            RemoteTarget::Segment(authority.into())
        };
        let resource = path.trim_start_matches('/');
        if resource.is_empty() {
            return Err(self.err(
                at + authority.len(),
                UriProblem::MissingResource {
                    expected: "a resource: remoteio://host:port/<resource>",
                },
            ));
        }
        let params = self.params(query)?;
        self.check_allowed(&params, "transport, gdr")?;
        let transport = match params.items.iter().find(|(k, _, _)| *k == "transport") {
            None | Some((_, "tcp", _)) => RemoteTransport::Tcp,
            Some((_, "rdma", _)) => RemoteTransport::Rdma,
            Some((k, v, pos)) => {
                return Err(self.err(
                    *pos,
                    UriProblem::BadParam {
                        name: (*k).into(),
                        value: (*v).into(),
                        expected: "tcp or rdma",
                    },
                ));
            }
        };
        Ok(Uri::Remote {
            target,
            resource: self.decode(resource, at + authority.len() + 1)?,
            transport,
            gdr: self.flag(&params, "gdr")?.unwrap_or(false),
        })
    }

    fn port(&self, s: &str, at: usize) -> Result<u16> {
        match s.parse::<u16>() {
            Ok(p) if p > 0 => Ok(p),
            _ => Err(self.err(at, UriProblem::BadPort(s.into()))),
        }
    }

    /// Percent-decoding.
    fn decode(&self, s: &str, at: usize) -> Result<String> {
        let bytes = s.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%' {
                let hex = s
                    .get(i + 1..i + 3)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| self.err(at + i, UriProblem::BadPercentEncoding))?;
                out.push(hex);
                i += 3;
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        String::from_utf8(out).map_err(|_| self.err(at, UriProblem::BadPercentEncoding))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ok(s: &str) -> Uri {
        Uri::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn problem(s: &str) -> (usize, UriProblem) {
        match Uri::parse(s) {
            Err(Error::Uri {
                position, problem, ..
            }) => (position, problem),
            other => panic!("{s}: expected a URI error, got {other:?}"),
        }
    }

    #[test]
    fn the_sdd_examples_parse() {
        assert_eq!(ok("memio://cpu/dram?numa=0"), Uri::Dram { numa: Some(0) });
        assert_eq!(
            ok("memio://cxl/pool0?device=0"),
            Uri::Cxl {
                pool: "pool0".into(),
                device: 0
            }
        );
        assert_eq!(
            ok("localio:///dev/nvme0n1"),
            Uri::File {
                path: "/dev/nvme0n1".into(),
                direct: false,
                gds: None
            }
        );
        assert_eq!(
            ok("localio:///mnt/data/file.dat?direct=1&gds=1"),
            Uri::File {
                path: "/mnt/data/file.dat".into(),
                direct: true,
                gds: Some(true)
            }
        );
        assert_eq!(
            ok("remoteio://192.168.1.100:5555/dataset?transport=rdma&gdr=1"),
            Uri::Remote {
                target: RemoteTarget::Address {
                    host: "192.168.1.100".into(),
                    port: 5555
                },
                resource: "dataset".into(),
                transport: RemoteTransport::Rdma,
                gdr: true
            }
        );
    }

    #[test]
    fn shorthands_and_aliases() {
        assert_eq!(ok("gpu0"), Uri::Gpu(0));
        assert_eq!(ok("gpu12"), Uri::Gpu(12));
        assert_eq!(ok("memio://gpu/3"), Uri::Gpu(3));
        assert_eq!(
            ok("gpuio://memio/cpu/dram?numa=1"),
            Uri::Dram { numa: Some(1) }
        );
        assert_eq!(
            ok("gpuio://localio/mnt/x?direct=1"),
            ok("localio:///mnt/x?direct=1")
        );
        assert_eq!(ok("file:///tmp/a%20b"), ok("localio:///tmp/a b"));
        assert_eq!(
            ok("data/x.bin"),
            Uri::File {
                path: "data/x.bin".into(),
                direct: false,
                gds: None
            }
        );
        assert_eq!(
            ok("remoteio://kv-segment/layer3"),
            Uri::Remote {
                target: RemoteTarget::Segment("kv-segment".into()),
                resource: "layer3".into(),
                transport: RemoteTransport::Tcp,
                gdr: false
            }
        );
        assert!(matches!(
            ok("remoteio://[::1]:80/r"),
            Uri::Remote { target: RemoteTarget::Address { ref host, port: 80 }, .. } if host == "::1"
        ));
    }

    #[test]
    fn malformed_uris_say_what_and_where() {
        assert_eq!(problem(""), (0, UriProblem::Empty));
        assert_eq!(
            problem("nvme://x").1,
            UriProblem::UnknownScheme("nvme".into())
        );
        assert!(matches!(problem("1a://x").1, UriProblem::BadScheme(_)));
        let (pos, p) = problem("memio://cpu/dram?numa=x");
        assert_eq!(pos, 17);
        assert!(matches!(p, UriProblem::BadParam { ref name, .. } if name == "numa"));
        let (pos, p) = problem("memio://cpu/dram?numa=0&speed=9");
        assert_eq!(pos, 24);
        assert!(matches!(p, UriProblem::UnknownParam { ref name, .. } if name == "speed"));
        assert!(matches!(
            problem("memio://cpu/hbm").1,
            UriProblem::UnknownResource { .. }
        ));
        assert!(matches!(
            problem("memio://").1,
            UriProblem::MissingResource { .. }
        ));
        assert!(matches!(
            problem("memio://tape/x").1,
            UriProblem::UnknownResource { .. }
        ));
        assert!(matches!(
            problem("memio://cxl/?device=0").1,
            UriProblem::MissingResource { .. }
        ));
        assert!(matches!(
            problem("memio://gpu/x").1,
            UriProblem::UnknownResource { .. }
        ));
        assert_eq!(
            problem("memio://cpu/dram?numa=1&numa=2").1,
            UriProblem::DuplicateParam("numa".into())
        );
        assert_eq!(
            problem("memio://cpu/dram?numa").1,
            UriProblem::MissingValue("numa".into())
        );
        assert!(matches!(
            problem("localio://relative/path").1,
            UriProblem::NotAbsolute(_)
        ));
        assert!(matches!(
            problem("localio:///x?direct=maybe").1,
            UriProblem::BadParam { .. }
        ));
        assert!(matches!(
            problem("file:///x?direct=1").1,
            UriProblem::UnknownParam { .. }
        ));
        assert_eq!(problem("file:///a%2").1, UriProblem::BadPercentEncoding);
        assert_eq!(
            problem("remoteio://h:0/r").1,
            UriProblem::BadPort("0".into())
        );
        assert_eq!(
            problem("remoteio://h:99999/r").1,
            UriProblem::BadPort("99999".into())
        );
        assert_eq!(problem("remoteio:///r").1, UriProblem::MissingHost);
        assert!(matches!(
            problem("remoteio://h:1/").1,
            UriProblem::MissingResource { .. }
        ));
        assert!(matches!(
            problem("remoteio://h:1/r?transport=udp").1,
            UriProblem::BadParam { .. }
        ));
        assert!(matches!(problem("gpu").1, UriProblem::BadGpuShorthand(_)));
        assert!(matches!(problem("gpu0x").1, UriProblem::BadGpuShorthand(_)));
        for bad in ["gpuio://memio/cpu/dram?numa=x", "gpuio://localio/x?numa=1"] {
            let (pos, _) = problem(bad);
            assert_eq!(&bad[pos..pos + 4], "numa", "{bad}");
        }
        let msg = Uri::parse("memio://cpu/dram?numa=x")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("numa") && msg.contains("byte 17"), "{msg}");
    }

    #[test]
    fn nesting_is_bounded_not_a_stack_overflow() {
        // `levels` gpuio:// wrappers around `inner`.
        let nest =
            |levels: usize, inner: &str| format!("gpuio://{}{inner}", "gpuio/".repeat(levels - 1));
        // Up to the bound, each level unwraps the next.
        assert_eq!(ok(&nest(MAX_URI_NESTING, "localio/x")), ok("localio:///x"));
        assert_eq!(
            ok(&nest(MAX_URI_NESTING, "memio/cpu/dram")),
            Uri::Dram { numa: None }
        );
        // Beyond it, a typed error; 100k levels used to overflow the stack (SIGABRT).
        for levels in [MAX_URI_NESTING + 1, 100_000] {
            let input = nest(levels, "memio/cpu/dram");
            let (pos, p) = problem(&input);
            assert_eq!(
                p,
                UriProblem::TooDeep {
                    max: MAX_URI_NESTING
                }
            );
            assert_eq!(pos, 8 + 6 * (MAX_URI_NESTING - 1), "{input}");
            let e = Uri::parse(&input).unwrap_err();
            assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg);
        }
    }

    #[test]
    fn display_escapes_control_characters() {
        for (uri, raw) in [
            (ok("rel/\x1b[2Jx\ny"), "\x1b"),
            (ok("memio://cxl/p\x1b]0;t\x07?device=0"), "\x07"),
            (ok("remoteio://seg\x1bment/r"), "\x1b"),
            (ok("remoteio://h\0st:9/r"), "\0"),
            (ok("file:///a%1Bb%0A"), "\x1b"),
        ] {
            let shown = uri.to_string();
            assert!(!shown.contains(raw) && !shown.contains('\n'), "{shown:?}");
        }
        assert_eq!(ok("rel/\x1bx").to_string(), "rel/\\x1bx");
    }

    fn any_uri() -> impl Strategy<Value = Uri> {
        prop_oneof![
            (0u32..64).prop_map(Uri::Gpu),
            proptest::option::of(0u32..8).prop_map(|numa| Uri::Dram { numa }),
            ("[a-z][a-z0-9_]{0,8}", 0u32..4).prop_map(|(pool, device)| Uri::Cxl { pool, device }),
            (
                "(/[a-zA-Z0-9 ._%?#-]{1,12}){1,3}",
                any::<bool>(),
                proptest::option::of(any::<bool>())
            )
                .prop_map(|(p, direct, gds)| Uri::File {
                    path: p.into(),
                    direct,
                    gds
                }),
            (
                "[a-z][a-z0-9.-]{0,10}",
                1u16..,
                "[a-z0-9/_]{1,10}",
                any::<bool>(),
                any::<bool>()
            )
                .prop_filter("resource must not start with /", |(_, _, r, _, _)| !r
                    .starts_with('/'))
                .prop_map(|(host, port, resource, rdma, gdr)| Uri::Remote {
                    target: RemoteTarget::Address { host, port },
                    resource,
                    transport: if rdma {
                        RemoteTransport::Rdma
                    } else {
                        RemoteTransport::Tcp
                    },
                    gdr,
                }),
        ]
    }

    proptest! {
        #[test]
        fn display_round_trips(u in any_uri()) {
            let s = u.to_string();
            prop_assert_eq!(Uri::parse(&s).unwrap(), u);
        }

        #[test]
        fn arbitrary_input_never_panics(s in ".{0,64}") {
            let _ = Uri::parse(&s);
        }
    }
}
