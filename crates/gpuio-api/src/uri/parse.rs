//! The parser of resource URIs (the grammar of docs/REFERENCE.md#resource-uris): schemes,
//! shorthands, parameters (each allowed once, and only where it means something), percent
//! decoding, and `gpuio://` nesting bounded by [`MAX_URI_NESTING`]. Every error names the
//! problem and the byte where it starts.

use super::{MAX_URI_NESTING, RemoteTarget, RemoteTransport, Uri};
use crate::error::{Error, Result, UriProblem};
use std::path::PathBuf;
use std::str::FromStr;

impl Uri {
    /// Parses a URI or a plain path.
    pub fn parse(input: &str) -> Result<Self> {
        Parser { input, depth: 0 }.parse()
    }
}

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
            "nvme" => self.parse_nvme(rest_at),
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
        // Whether a '/' follows the engine (`gpuio://memio` has none).
        let slash = usize::from(rest.len() > engine.len());
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
                    at + e + slash + (position - prefix)
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
            path: self.decode_path(path, path_at)?,
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
                host: self.host(host, at + 1)?,
                port: self.port(port, at + host.len() + 3)?,
            }
        } else if let Some((host, port)) = authority.rsplit_once(':') {
            RemoteTarget::Address {
                host: self.host(host, at)?,
                port: self.port(port, at + host.len() + 1)?,
            }
        } else {
            RemoteTarget::Segment(self.host(authority, at)?)
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
            Some((_, "nixl", _)) => RemoteTransport::Nixl,
            Some((k, v, pos)) => {
                return Err(self.err(
                    *pos,
                    UriProblem::BadParam {
                        name: (*k).into(),
                        value: (*v).into(),
                        expected: "tcp, rdma or nixl",
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

    /// A host (or segment name) at byte `at`: not empty, and no bracket (brackets only
    /// enclose an IPv6 host, and are not part of it).
    fn host(&self, host: &str, at: usize) -> Result<String> {
        if host.is_empty() {
            return Err(self.err(at, UriProblem::MissingHost));
        }
        if let Some(i) = host.find(['[', ']']) {
            return Err(self.err(at + i, UriProblem::BadHost(host.into())));
        }
        Ok(host.into())
    }

    /// `nvme://<PCI address>/<nsid>`.
    fn parse_nvme(&self, at: usize) -> Result<Uri> {
        let (authority, path, query) = self.split(at);
        let address = gpuio_nvme::full_address(authority).map_err(|_| {
            self.err(
                at,
                UriProblem::UnknownResource {
                    found: authority.into(),
                    expected: "a PCI address: nvme://0000:00:04.0/<namespace>",
                },
            )
        })?;
        let segment = path.trim_start_matches('/');
        // Digits only: `u32::from_str` also takes a leading `+`.
        let digits = !segment.is_empty() && segment.bytes().all(|b| b.is_ascii_digit());
        let nsid = match segment.parse::<u32>() {
            Ok(n) if digits && n > 0 && n != u32::MAX => n,
            _ => {
                return Err(self.err(
                    at + authority.len(),
                    UriProblem::UnknownResource {
                        found: segment.into(),
                        expected: "a namespace identifier from 1: nvme://<address>/1",
                    },
                ));
            }
        };
        self.check_allowed(&self.params(query)?, "")?;
        Ok(Uri::Nvme { address, nsid })
    }

    fn port(&self, s: &str, at: usize) -> Result<u16> {
        match s.parse::<u16>() {
            Ok(p) if p > 0 => Ok(p),
            _ => Err(self.err(at, UriProblem::BadPort(s.into()))),
        }
    }

    /// Percent-decoding.
    fn decode(&self, s: &str, at: usize) -> Result<String> {
        String::from_utf8(self.decode_bytes(s, at)?)
            .map_err(|_| self.err(at, UriProblem::BadPercentEncoding))
    }

    /// Percent-decoding of a file's path: its bytes as they are, UTF-8 or not (a file name
    /// is bytes to the kernel).
    fn decode_path(&self, s: &str, at: usize) -> Result<PathBuf> {
        use std::os::unix::ffi::OsStringExt;
        Ok(PathBuf::from(std::ffi::OsString::from_vec(
            self.decode_bytes(s, at)?,
        )))
    }

    fn decode_bytes(&self, s: &str, at: usize) -> Result<Vec<u8>> {
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
        Ok(out)
    }
}
